"""The skinny dot vs XLA's `pack.dot_t` at K2.6's few-row dense dots (issue 13), CUPTI-timed.

Per shape (the out-major weights of bench_k26_full's layer: q_a | kv_a, o, router | shared gate
| up, q_b, shared down) and M in --dot_rows: XLA's dot (pack.dot_t, as the model calls it) and the
kernel per --dot_variants, one program each, called in turn on `copies` distinct weights (and x),
>= STREAM_BYTES in all, so the weights stream from HBM as in a 61-layer step and not from the
50 MB L2: us per dot = the CUPTI kernel sum per call (split-K's sum included), with its
launches per call. The copy
bandwidth is measured in the same run: % of copy = (weight bytes / copy TB/s) / us. Every output
is checked against an f64 numpy reference first (rel L2 <= REL_TOL, else FAIL, never fastest).
One JSON line per row in --dots_out (flags named apart from the other benches' flags: one
process, e.g. the tests, may import them all); off a GPU: interpret mode and wall time (a smoke
run).

  python -m pallas_kernels.skinny_dot.bench --dots_out runs/bench_dots.jsonl
"""

import dataclasses
import json
import math
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import roofline, timing
from kdtree_jax.target.pack import dot_t
from pallas_kernels import bench_flags
from pallas_kernels.skinny_dot import default_tuning, skinny_dot, supports
from pallas_kernels.skinny_dot import tuning as tuning_lib

# (name, N, K, f32 output) of pack.dot_t's weights on bench_k26_full (the router's dot asks f32)
SHAPES = {"qkv_a": (2112, 7168, False), "o": (7168, 1024, False),
          "router_gate_up": (896, 7168, True), "q_b": (1536, 1536, False),
          "shared_down": (7168, 256, False)}
REL_TOL = 1e-2  # bf16 in and out: one bf16 rounding per output, ~2e-3
STREAM_BYTES = 120 << 20  # weight bytes per timed program: > 2x the H200's 50 MB L2
MAX_COPIES = 32

_ROWS = flags.DEFINE_list("dot_rows", ["1", "16"], "M: rows of x (1: ar; 16: a ddtree 15 verify).")
_SHAPES = flags.DEFINE_list("dot_shapes", list(SHAPES), f"Shapes of {list(SHAPES)}.")
_VARIANTS = flags.DEFINE_list(
    "dot_variants", ["default", "u1", "x2", "b2"],
    "Kernel rows: 'default' (tuning.default_tuning), '+'-joined changes to it: wN (warps), "
    "sN (stages), uN (unroll), x2 (twice the K splits, unroll 1), b2 (twice BN and the "
    "splits), h (half BN), d (double BK); or a whole tuning 'n16k512w4s3x1u1' (rows where it "
    "divides the shape).")
_OUT = flags.DEFINE_string("dots_out", "runs/bench_dots.jsonl", "JSON lines output.")


def variant_tuning(name, m, n, k):
  """The Tuning of a --dot_variants entry at this shape, or None where it does not apply (or
  is the default's tuning under another name)."""
  base = default_tuning(m, n, k)
  if name.startswith("n"):
    t = tuning_lib.parse(name)
    return t if supports(m, n, k, jnp.bfloat16, jnp.bfloat16, t) else None
  t = base
  for change in ([] if name == "default" else name.split("+")):
    if change[0] == "u":
      t = dataclasses.replace(t, unroll=int(change[1:]))
    elif change[0] == "w":
      t = dataclasses.replace(t, num_warps=int(change[1:]))
    elif change[0] == "s":
      t = dataclasses.replace(t, num_stages=int(change[1:]))
    elif change == "x2":  # BK halved until it divides the shorter share
      t = dataclasses.replace(t, splits=2 * t.splits, unroll=1)
      while k % t.splits == 0 and (k // t.splits) % t.bk and t.bk > 16:
        t = dataclasses.replace(t, bk=t.bk // 2)
    elif change == "b2":  # twice BN and the K splits: as many programs, half the x reads per
      t = dataclasses.replace(t, bn=2 * t.bn, splits=2 * t.splits, unroll=1)  # weight byte
      while k % t.splits == 0 and (k // t.splits) % t.bk and t.bk > 16:
        t = dataclasses.replace(t, bk=t.bk // 2)
    elif change == "h":
      t = dataclasses.replace(t, bn=t.bn // 2)
    elif change == "d":
      t = dataclasses.replace(t, bk=2 * t.bk)
    else:
      raise ValueError(f"--dot_variants {name!r}: unknown change {change!r}")
  ok = t.bn >= 1 and supports(m, n, k, jnp.bfloat16, jnp.bfloat16, t)
  return t if ok and (name == "default" or t != base) else None


def _operands(m, n, k, copies):
  """copies distinct (x [1, M, K] as the model's [B, S, D], w_t [N, K]) bf16 pairs."""
  keys = jax.random.split(jax.random.key(m * 7 + n), 2 * copies)
  xs = [jax.random.normal(keys[2 * i], (1, m, k), jnp.bfloat16) for i in range(copies)]
  ws = [(jax.random.normal(keys[2 * i + 1], (n, k), jnp.float32) / math.sqrt(k))
        .astype(jnp.bfloat16) for i in range(copies)]
  return xs, ws


def _program(impl, tun, pref):
  """One dot: pack.dot_t (as the model calls it) for 'xla', else the kernel at this tuning."""
  if impl == "xla":
    return jax.jit(lambda x, w: dot_t(x, w, preferred_element_type=pref))
  return jax.jit(lambda x, w: skinny_dot(x[0], w, pref, tun)[None])


def _rel_f64(y, x, w):
  ref = np.asarray(x[0], np.float64) @ np.asarray(w, np.float64).T
  got = np.asarray(jnp.asarray(y[0], jnp.float32), np.float64)
  return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _time(fn, xs, ws):
  """(us per dot, launches per dot): the CUPTI kernel sum per call over calls that take the
  copies in turn (max(--reps, 2 x copies) calls); off a GPU the wall time of one copy."""
  if not timing.cupti_available():
    return 1e6 * roofline.wall_time_s(fn, xs[0], ws[0], reps=2, warmup=1), None
  turn = iter(range(1, 1 << 30))
  feed = lambda args, out: (lambda i: (xs[i % len(xs)], ws[i % len(ws)]))(next(turn))
  kernels = timing.kernel_breakdown(fn, (xs[0], ws[0]), feed,
                                    iters=max(bench_flags.REPS.value, 2 * len(ws)))
  return sum(us for _, _, us in kernels), sum(calls for _, calls, _ in kernels)


class Shapes:
  """Per (shape, M): the operands (made once) and XLA's us (the x_xla baseline)."""

  def __init__(self, copies_cap):
    self.copies_cap, self.operands, self.xla_us = copies_cap, {}, {}

  def get(self, name, m):
    n, k, _ = SHAPES[name]
    if (name, m) not in self.operands:
      copies = max(1, min(self.copies_cap, math.ceil(STREAM_BYTES / (2 * n * k))))
      self.operands[name, m] = _operands(m, n, k, copies)
    return self.operands[name, m]


def bench_row(name, m, impl, ceil, shapes):
  """One row: XLA's dot ('xla') or the kernel at --dot_variants entry `impl`; None where the
  variant does not apply to this shape."""
  n, k, f32_out = SHAPES[name]
  tun = None if impl == "xla" else variant_tuning(impl, m, n, k)
  if impl != "xla" and tun is None:
    return None
  xs, ws = shapes.get(name, m)
  nbytes = 2 * n * k
  floor_us = nbytes / ceil["copy_tbps"] / 1e6
  row = dict(part="dots", shape=name, M=m, N=n, K=k, impl=impl, copies=len(ws),
             weight_bytes=nbytes, floor_us=floor_us)
  if tun is not None:
    row["tuning"] = str(tun)
  fn = _program(impl, tun, jnp.float32 if f32_out else None)
  try:
    row["rel_err"] = _rel_f64(fn(xs[0], ws[0]), xs[0], ws[0])
    row["us"], row["launches"] = _time(fn, xs, ws)
  except Exception as ex:  # one failing variant must not hide the rest
    row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
    return row
  row["ok"] = row["rel_err"] <= REL_TOL
  row["pct_copy"] = 100 * floor_us / row["us"]
  if impl == "xla":
    shapes.xla_us[name, m] = row["us"]
  if (name, m) in shapes.xla_us:
    row["x_xla"] = shapes.xla_us[name, m] / row["us"]  # > 1: faster than XLA
  return row


def _print(row):
  if "error" in row:
    print(f"{row['shape']:15} M={row['M']:2} {row['impl']:10} ERROR {row['error']}", flush=True)
    return
  flag = "" if row["ok"] else f"  FAIL: WRONG OUTPUT rel_err {row['rel_err']:.1e}"
  print(f"{row['shape']:15} M={row['M']:2} {row['impl']:10} {row.get('tuning', ''):16} "
        f"{row['us']:8.2f} us  {row['pct_copy']:5.1f}% copy  x XLA {row.get('x_xla', 1):5.2f}  "
        f"launches {row['launches'] or 0:.1f}  floor {row['floor_us']:.2f} us  "
        f"rel_err {row['rel_err']:.1e}{flag}", flush=True)


def summary(rows):
  """Per (shape, M): XLA's us and the fastest correct kernel row (its tuning, us, x XLA)."""
  print("\nshape           M    XLA us  best kernel                 us  %copy  x XLA")
  keys = dict.fromkeys((r["shape"], r["M"]) for r in rows)
  for name, m in keys:
    here = [r for r in rows if (r["shape"], r["M"]) == (name, m) and r.get("ok")]
    xla = next((r for r in here if r["impl"] == "xla"), None)
    best = min((r for r in here if r["impl"] != "xla"), key=lambda r: r["us"], default=None)
    if xla is None or best is None:
      print(f"{name:15} {m:2}  (no correct {'XLA' if xla is None else 'kernel'} row)")
      continue
    print(f"{name:15} {m:2} {xla['us']:8.2f}  {best['impl']:8} {best['tuning']:17} "
          f"{best['us']:8.2f} {best['pct_copy']:5.1f} {best['x_xla']:6.2f}", flush=True)


def main(_):
  import os  # pylint: disable=import-outside-toplevel
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  t0 = time.time()
  gpu = jax.default_backend() == "gpu"
  ceil = roofline.measure_ceilings(small=not gpu)
  print(f"copy {ceil['copy_tbps']:.2f} TB/s", flush=True)
  with open(_OUT.value, "w") as sink:
    sink.write(json.dumps(dict(part="ceilings", **ceil)) + "\n")

    def emit(row):
      sink.write(json.dumps(row) + "\n")
      sink.flush()
      _print(row)
    shapes, rows = Shapes(MAX_COPIES if gpu else 1), []
    for impl in ["xla"] + _VARIANTS.value:  # every shape's baseline and default first
      for m in map(int, _ROWS.value):
        for name in _SHAPES.value:
          row = bench_row(name, m, impl, ceil, shapes)
          if row is not None:
            emit(row)
            rows.append(row)
      print(f"[{time.time() - t0:.0f} s] {impl} done", flush=True)
  summary(rows)


if __name__ == "__main__":
  app.run(main)
