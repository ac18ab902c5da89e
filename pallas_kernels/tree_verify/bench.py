"""Benchmark the Mosaic GPU tree-verify kernel against XLA; roofline from ceilings measured in-run.

  python -m pallas_kernels.tree_verify.bench --json_out=bench.jsonl --plot_out=bench.png
"""

import itertools
import json
import math
import statistics

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import roofline
from pallas_kernels.tree_verify import api, reference
from pallas_kernels.tree_verify.tuning import Tuning, default_tuning

FLAGS = flags.FLAGS
flags.DEFINE_list("L", ["4096", "16384", "46000", "131072"], "cache lengths")
flags.DEFINE_list("N", ["1", "16", "64"], "tree nodes")
flags.DEFINE_list("H", ["8", "16", "64", "128"], "heads")
flags.DEFINE_list("B", ["1", "4"], "batch sizes")
flags.DEFINE_integer("reps", 30, "timed repetitions (median reported)")
flags.DEFINE_string("json_out", "", "JSON lines output")
flags.DEFINE_string("plot_out", "", "plot of % roofline vs L")
flags.DEFINE_string("tunings", "", "extra kernel variants: ';'-separated k=v,k=v (e.g. shared_p=0)")
flags.DEFINE_bool("skip_xla", False, "do not time the XLA baseline")

C, R, L2_BYTES = 576, 512, 60e6


def xla_baseline(q, cache, lengths, tree_mask, *, scale):
  """Plain XLA: bf16 einsums with f32 accumulation, additive mask, f32 softmax."""
  s = jnp.einsum("bnhc,blc->bnhl", q, cache, preferred_element_type=jnp.float32) * scale
  vis = reference.visibility_bnl(lengths, tree_mask, cache.shape[1])[:, :, None, :]
  s = jnp.where(vis, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  den = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bnhl,blr->bnhr", p.astype(q.dtype), cache[..., :R],
                 preferred_element_type=jnp.float32)
  return (o / den).astype(q.dtype)


def device_time_us(fn, sets, reps):
  """Median over reps of the CUPTI-summed kernel time of one call (all kernels it launches).

  One jitted program calls fn once per input set (distinct sets, so XLA cannot CSE the calls;
  rotating sets keeps data that fits in L2 from being re-read from L2); time / len(sets).
  """
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  prog = jax.jit(lambda *all_sets: [fn(*s) for s in all_sets])
  _, ts = profiler.measure(prog, iterations=max(2, reps))(*sets)
  return statistics.median(ts) * 1e3 / len(sets)


def make_set(b, n, h, l, seed):
  """Random inputs; ragged lengths when B > 1 (the longest row uses the whole cache)."""
  kq, kc = jax.random.split(jax.random.key(seed))
  q = jax.random.normal(kq, (b, n, h, C), jnp.bfloat16)
  cache = jax.random.normal(kc, (b, l, C), jnp.bfloat16)
  rng = np.random.default_rng(seed)
  lengths = [l - n] + [int(rng.integers(l // 2, l - n + 1)) for _ in range(b - 1)]
  mask = np.zeros((b, n, n), bool)
  for bb in range(b):
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    for i in range(n):
      j = i
      while j >= 0:
        mask[bb, i, j], j = True, parent[j]
  return q, cache, jnp.asarray(lengths, jnp.int32), jnp.asarray(mask)


def parse_tunings(spec, b, n, h, l):
  """[(name, Tuning)]: the default heuristic plus --tunings variants."""
  out = [("default", default_tuning(b, n, h, l))]
  for item in filter(None, spec.split(";")):
    kv = dict(x.split("=") for x in item.split(","))
    base = default_tuning(b, n, h, l).__dict__ | {k: int(v) for k, v in kv.items()}
    out.append((item, Tuning(**base)))
  return out


def bench_shape(b, n, h, l, ceil, scale=1.0 / math.sqrt(C)):
  """Rows (one per kernel variant, plus XLA) for one shape."""
  set_bytes = 1152 * l * b
  nsets = max(1, min(6, math.ceil(3 * L2_BYTES / set_bytes)))
  sets = [make_set(b, n, h, l, seed) for seed in range(nsets)]
  byts = 1152 * l * b + 2 * b * n * h * C + 2 * b * n * h * R
  flops = 2 * b * h * n * l * (C + R)
  floor_us = max(byts / (ceil["copy_tbps"] * 1e12), flops / (ceil["mm_tflops"] * 1e12)) * 1e6
  rows = []
  ref = reference.tree_verify_attention_reference(*sets[0], scale=scale)[0]
  big = b * n * h * l * 4 > 4e9
  variants = parse_tunings(FLAGS.tunings, b, n, h, l)
  for name, t in variants:
    fn = lambda q, c, le, m, t=t: api.tree_verify_attention(q, c, le, m, scale=scale,
                                                              backend="pallas", tuning=t)
    out = jax.jit(fn)(*sets[0])
    err = float(jnp.linalg.norm((out - ref).astype(jnp.float32)) /
                jnp.linalg.norm(ref.astype(jnp.float32)))
    ok = bool(np.isfinite(err) and err <= 1e-2)
    us = device_time_us(fn, sets, FLAGS.reps) if ok else float("nan")
    rows.append(dict(impl="pallas", variant=name, tuning=t.__dict__, rel_err=err, us=us))
  if not FLAGS.skip_xla:
    fx = lambda q, c, le, m: xla_baseline(q, c, le, m, scale=scale)
    us = device_time_us(fx, sets[:1] if big else sets, max(3, FLAGS.reps // (5 if big else 1)))
    rows.append(dict(impl="xla", variant="einsum", tuning=None, rel_err=None, us=us))
  for r in rows:
    r.update(B=b, N=n, H=h, L=l, bytes=byts, flops=flops, floor_us=floor_us, nsets=nsets,
             tbps=byts / r["us"] / 1e6, tflops=flops / r["us"] / 1e6,
             pct_roofline=100 * floor_us / r["us"])
  return rows


def fmt_row(r, xla_us):
  speed = xla_us / r["us"] if xla_us and r["impl"] == "pallas" else float("nan")
  err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "-"
  return (f"{r['B']:>2} {r['N']:>3} {r['H']:>4} {r['L']:>7} {r['impl']:>6} {r['variant'][:18]:>18} "
          f"{r['us']:>9.1f} {r['tbps']:>6.2f} {r['tflops']:>7.1f} {r['pct_roofline']:>6.1f} "
          f"{speed:>6.2f} {err:>8}")


def plot(rows, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(9, 6))
  keys = sorted({(r["B"], r["N"], r["H"], r["impl"], r["variant"]) for r in rows})
  for key in keys:
    pts = sorted((r["L"], r["pct_roofline"]) for r in rows
                 if (r["B"], r["N"], r["H"], r["impl"], r["variant"]) == key)
    ls = "-" if key[3] == "pallas" else ":"
    ax.plot(*zip(*pts), ls, marker="o", label=f"B{key[0]} N{key[1]} H{key[2]} {key[3]} {key[4]}")
  ax.set_xscale("log")
  ax.set_xlabel("L (cache rows)")
  ax.set_ylabel("% of roofline")
  ax.legend(fontsize=5, ncol=3)
  fig.savefig(path, dpi=130)


def main(_):
  dev = jax.devices()[0]
  ceil = roofline.measure_ceilings()
  print(f"device={dev.device_kind} jax={jax.__version__} copy={ceil['copy_tbps']:.2f} TB/s "
        f"bf16 matmul={ceil['mm_tflops']:.0f} TFLOP/s", flush=True)
  rows = []
  jf = open(FLAGS.json_out, "w") if FLAGS.json_out else None  # pylint: disable=consider-using-with
  if jf:
    jf.write(json.dumps(dict(ceilings=ceil, device=dev.device_kind)) + "\n")
  shapes = itertools.product(*(map(int, v) for v in (FLAGS.B, FLAGS.N, FLAGS.H, FLAGS.L)))
  for b, n, h, l in shapes:
    try:
      new = bench_shape(b, n, h, l, ceil)
    except Exception as e:  # pylint: disable=broad-except
      print(f"FAILED B={b} N={n} H={h} L={l}: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    xla_us = next((r["us"] for r in new if r["impl"] == "xla"), None)
    for r in new:
      print(fmt_row(r, xla_us), flush=True)
      if jf:
        jf.write(json.dumps(r) + "\n")
        jf.flush()
    rows += new
  if FLAGS.plot_out and rows:
    plot(rows, FLAGS.plot_out)
  print(f"\nceilings: copy {ceil['copy_tbps']:.2f} TB/s, bf16 matmul {ceil['mm_tflops']:.0f} TFLOP/s")
  print(" B   N    H       L   impl            variant        us   TB/s  TFLOP/s  %roof  xXLA   relerr")
  for r in rows:
    xla_us = next((x["us"] for x in rows if x["impl"] == "xla" and
                   (x["B"], x["N"], x["H"], x["L"]) == (r["B"], r["N"], r["H"], r["L"])), None)
    print(fmt_row(r, xla_us))


if __name__ == "__main__":
  app.run(main)
