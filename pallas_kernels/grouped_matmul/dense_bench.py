"""Our Mosaic GPU grouped matmul as a DENSE dot (G = 1 expert holding all M rows) vs XLA's
`pack.dot_t` at K2.6's few-row dense dots (issue 13), CUPTI-timed.

Per shape (the out-major weights of bench_k26_full's layer: q_a | kv_a, o, router | shared gate |
up, q_b, shared down) and M in --dot_rows: XLA's dot (pack.dot_t on the [N, K] weight, as the
model calls it: the baseline) and `api.grouped_matmul(x, (w_kn[None],), group_sizes=[M])` on a [1,
K, N] bf16 copy per --dot_variants, one program each, called in turn on `copies` distinct weights
(and x), >= STREAM_BYTES in all, so the weights stream from HBM as in a 61-layer step and not from
the 50 MB L2: us per dot = the CUPTI kernel sum per call (split-K's partial sum included: XLA
fuses it apart here, a model would fuse it into the consumer), with its launches per call and the
Mosaic kernel's us alone (gmm). The group sizes are a constant: XLA folds the work list into a
literal (as a model's static list would be). M = 1 runs on x [1, K] itself (the kernel's 8-row x
window reads past the one row, the TMA fills zeros, one row is stored); the `pad8` row pads x to 8
rows in the program first (the form the INT4 ar path's broadcast rows take). The copy bandwidth is
measured in the same run: % of copy = (weight bytes / copy TB/s) / us. Every output is checked
against an f64 numpy reference first (rel L2 <= REL_TOL, else FAIL, never fastest). One JSON line
per row in --dots_out, each row printed when timed, the fastest correct kernel row per (shape, M)
last. Flags are named apart from the other benches' (one process, e.g. the tests, imports them
all). Off a GPU: interpret mode and wall time (a smoke run; use small --dot_shapes there).

  python -m pallas_kernels.grouped_matmul.dense_bench --dots_out runs/bench_dense_dots.jsonl
"""

import json
import math
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import roofline, timing
from kdtree_jax.target.pack import dot_t
from pallas_kernels import bench_flags
from pallas_kernels.grouped_matmul import api, kernel, work
from pallas_kernels.grouped_matmul.tuning import default_tuning

# (name, N, K, f32 output) of pack.dot_t's weights on bench_k26_full (the router's dot asks f32;
# the kernel returns x's dtype, bf16: the 16 x 896 output is not what decides the time)
SHAPES = {"qkv_a": (2112, 7168, False), "o": (7168, 1024, False),
          "router_gate_up": (896, 7168, True), "q_b": (1536, 1536, False),
          "shared_down": (7168, 256, False)}
REL_TOL = 1e-2  # bf16 in and out: one bf16 rounding per output, ~2e-3
STREAM_BYTES = 120 << 20  # weight bytes per timed program: > 2x the H200's 50 MB L2
MAX_COPIES = 32
PAD = "pad8"  # a variant part: x padded to 8 rows inside the program (M < 8 only)
SMEM_BYTES = 227 * 1024

_ROWS = flags.DEFINE_list("dot_rows", ["16", "1"],
                          "M: rows of x (16: a ddtree 15 verify, the promotion's M; 1: ar).")
_SHAPES = flags.DEFINE_list("dot_shapes", list(SHAPES), f"Shapes of {list(SHAPES)}.")
_VARIANTS = flags.DEFINE_list(
    "dot_variants", ["default", "p1", "r16", "once", "n64", "p2", "p4", PAD, "r16+once",
                     "n64+p1", "k64"],
    "Kernel rows: tuning.apply_variant names on default_tuning(M, 1, K, N) (e.g. p1: unsplit, "
    "pN: N K splits, r16: 16-row windows, once: store_once, n64: block_n 64, sN: stages, "
    "kBK: block_k, wN: slots), '+'-joined, optionally + 'pad8' (x padded to 8 rows in the "
    "program, M < 8 only). Rows equal to the default's tuning or an earlier row's, with wider "
    "windows than the default's (more rows than M needs), over SMEM or not taken by the kernel "
    "are skipped.")
_OUT = flags.DEFINE_string("dots_out", "runs/bench_dense_dots.jsonl", "JSON lines output.")
_BUDGET = flags.DEFINE_float("dots_budget_s", 0.0,
                             "Stop starting rows after this many seconds (0: no limit); the "
                             "summary of the rows done is still printed.")


def variant_tuning(name, m, n, k):
  """(Tuning, pad8) of a --dot_variants entry at this shape, or None where it does not apply:
  the default's tuning under another name, rows wider than the default's, pad8 at M >= 8,
  a tuning the kernel does not take or whose pipeline overflows SMEM."""
  parts = name.split("+")
  pad = PAD in parts
  rest = "+".join(p for p in parts if p != PAD) or "default"
  if pad and m >= work.ALIGN:
    return None
  base = default_tuning(m, 1, k, n, False)
  t = default_tuning(m, 1, k, n, False, variant=rest)
  if t.rows > base.rows or (t == base and rest != "default"):
    return None
  x = jax.ShapeDtypeStruct((max(m, work.ALIGN) if pad else m, k), jnp.bfloat16)
  if not kernel.supports(x, k, n, None, t) or _smem_bytes(k, n, t) > SMEM_BYTES:
    return None
  return t, pad


def _smem_bytes(k, n, t):
  return kernel.launch_shape(k, n, 1, False, False, t)["smem_kb"] * 1024


def kernel_dot(x_mk, w_kn, m, tuning, pad, backend):
  """The dense dot through the grouped kernel: G = 1 expert of M rows (x [M, K], w [1, K, N])."""
  if pad:
    x_mk = jnp.pad(x_mk, ((0, work.ALIGN - m), (0, 0)))
  y = api.grouped_matmul(x_mk, (w_kn,), np.asarray([m], np.int32), backend=backend,
                         tuning=tuning)
  return y[:m]


def _program(impl, m, tun_pad, pref):
  """One dot: pack.dot_t (as the model calls it) for 'xla', else the kernel at this tuning."""
  if impl == "xla":
    return jax.jit(lambda x, w: dot_t(x, w, preferred_element_type=pref))
  backend = "pallas" if jax.default_backend() == "gpu" else "interpret"
  tun, pad = tun_pad
  return jax.jit(lambda x, w: kernel_dot(x[0], w, m, tun, pad, backend)[None])


def _operands(m, n, k, copies):
  """copies distinct (x [1, M, K] as the model's [B, S, D], w_t [N, K], w_kn [1, K, N]) bf16."""
  keys = jax.random.split(jax.random.key(m * 7 + n), 2 * copies)
  xs = [jax.random.normal(keys[2 * i], (1, m, k), jnp.bfloat16) for i in range(copies)]
  ws = [(jax.random.normal(keys[2 * i + 1], (n, k), jnp.float32) / math.sqrt(k))
        .astype(jnp.bfloat16) for i in range(copies)]
  return xs, ws, [jnp.asarray(w.T[None]) for w in ws]


def rel_f64(y, x, w_t):
  """rel L2 of y [1, M, N] vs x [1, M, K] @ w_t [N, K]^T in f64 numpy."""
  ref = np.asarray(x[0], np.float64) @ np.asarray(w_t, np.float64).T
  got = np.asarray(jnp.asarray(y[0], jnp.float32), np.float64)
  return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _time(fn, xs, ws):
  """(us per dot, launches per dot, the Mosaic kernel's us per dot): CUPTI kernel sums per call
  over calls that take the copies in turn (max(--reps, 2 x copies) calls); the last is the
  gmm_* kernel alone (a split row's partial sum is the rest: a model fuses it into the dot's
  consumer). Off a GPU: the wall time of one copy, None, None."""
  if not timing.cupti_available():
    return 1e6 * roofline.wall_time_s(fn, xs[0], ws[0], reps=2, warmup=1), None, None
  turn = iter(range(1, 1 << 30))
  feed = lambda args, out: (lambda i: (xs[i % len(xs)], ws[i % len(ws)]))(next(turn))
  kernels = timing.kernel_breakdown(fn, (xs[0], ws[0]), feed,
                                    iters=max(bench_flags.REPS.value, 2 * len(ws)))
  return (sum(us for _, _, us in kernels), sum(calls for _, calls, _ in kernels),
          sum(us for name, _, us in kernels if name.startswith("gmm_")))


class Shapes:
  """Per (shape, M): the operands (made once), XLA's us (the x_xla baseline) and the kernel
  forms (tuning, pad) already run (a variant naming one again is skipped)."""

  def __init__(self, copies_cap, shapes=None):
    self.copies_cap, self.shapes, self.operands, self.xla_us = copies_cap, shapes or SHAPES, {}, {}
    self.seen = set()

  def get(self, name, m):
    n, k, _ = self.shapes[name]
    if (name, m) not in self.operands:
      copies = max(1, min(self.copies_cap, math.ceil(STREAM_BYTES / (2 * n * k))))
      self.operands[name, m] = _operands(m, n, k, copies)
    return self.operands[name, m]


def bench_row(name, m, impl, ceil, shapes):
  """One row: XLA's dot ('xla') or the kernel at --dot_variants entry `impl`; None where the
  variant does not apply to this shape."""
  n, k, f32_out = shapes.shapes[name]
  tun_pad = None if impl == "xla" else variant_tuning(impl, m, n, k)
  if impl != "xla" and (tun_pad is None or (name, m, tun_pad) in shapes.seen):
    return None
  shapes.seen.add((name, m, tun_pad))
  xs, ws, ws_kn = shapes.get(name, m)
  nbytes = 2 * n * k
  floor_us = nbytes / ceil["copy_tbps"] / 1e6
  row = dict(part="dense_dots", shape=name, M=m, N=n, K=k, impl=impl, copies=len(ws),
             weight_bytes=nbytes, floor_us=floor_us)
  if tun_pad is not None:
    row["tuning"] = str(tun_pad[0])
    row["short"] = short_tuning(tun_pad[0])
    row.update(kernel.launch_shape(k, n, 1, False, False, tun_pad[0]))
  fn = _program(impl, m, tun_pad, jnp.float32 if f32_out else None)
  weights = ws if impl == "xla" else ws_kn
  try:
    row["rel_err"] = rel_f64(fn(xs[0], weights[0]), xs[0], ws[0])
    row["us"], row["launches"], gmm_us = _time(fn, xs, weights)
    if impl != "xla":
      row["gmm_us"] = gmm_us
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


def short_tuning(t):
  """r R n BN k BK s STAGES p SPLITS w SLOTS [+once]: a Tuning in one table column."""
  return (f"r{t.rows}n{t.block_n}k{t.block_k}s{t.stages}p{t.splits}w{t.slots}"
          + ("+once" if t.store_once else "") + ("+ismem" if t.items_smem else ""))


def _print(row):
  if "error" in row:
    print(f"{row['shape']:15} M={row['M']:2} {row['impl']:12} ERROR {row['error']}", flush=True)
    return
  flag = "" if row["ok"] else f"  FAIL: WRONG OUTPUT rel_err {row['rel_err']:.1e}"
  print(f"{row['shape']:15} M={row['M']:2} {row['impl']:12} {row.get('short', ''):24} "
        f"{row['us']:8.2f} us  {row['pct_copy']:5.1f}% copy  x XLA {row.get('x_xla', 1):5.2f}  "
        f"launches {row['launches'] or 0:.1f}  gmm {row.get('gmm_us') or 0:6.2f} us  "
        f"ctas {row.get('ctas', '-')}  "
        f"floor {row['floor_us']:.2f} us  rel_err {row['rel_err']:.1e}{flag}", flush=True)


def summary(rows):
  """Per (shape, M): XLA's us and the fastest correct kernel row (its tuning, us, x XLA)."""
  print("\nshape           M    XLA us  best kernel row        tuning                      us"
        "  %copy  x XLA  gmm us")
  keys = dict.fromkeys((r["shape"], r["M"]) for r in rows)
  for name, m in keys:
    here = [r for r in rows if (r["shape"], r["M"]) == (name, m) and r.get("ok")]
    xla = next((r for r in here if r["impl"] == "xla"), None)
    best = min((r for r in here if r["impl"] != "xla"), key=lambda r: r["us"], default=None)
    if xla is None or best is None:
      print(f"{name:15} {m:2}  (no correct {'XLA' if xla is None else 'kernel'} row)")
      continue
    print(f"{name:15} {m:2} {xla['us']:8.2f}  {best['impl']:20} {best['short']:24} "
          f"{best['us']:8.2f} {best['pct_copy']:5.1f} {best['x_xla']:6.2f} "
          f"{best.get('gmm_us') or 0:7.2f}", flush=True)


def main(_):
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  t0 = time.time()
  gpu = jax.default_backend() == "gpu"
  ceil = roofline.measure_ceilings(small=not gpu)
  print(f"copy {ceil['copy_tbps']:.2f} TB/s", flush=True)
  with open(_OUT.value, "w") as sink:
    sink.write(json.dumps(dict(part="ceilings", **ceil)) + "\n")
    shapes, rows = Shapes(MAX_COPIES if gpu else 1), []
    for impl in ["xla"] + _VARIANTS.value:  # every shape's baseline and default first
      for m in map(int, _ROWS.value):
        for name in _SHAPES.value:
          if _BUDGET.value and time.time() - t0 > _BUDGET.value:
            print(f"[{time.time() - t0:.0f} s] budget spent: {impl} M={m} {name} not run")
            summary(rows)
            return
          row = bench_row(name, m, impl, ceil, shapes)
          if row is not None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            _print(row)
            rows.append(row)
      print(f"[{time.time() - t0:.0f} s] {impl} done", flush=True)
  summary(rows)


if __name__ == "__main__":
  app.run(main)
