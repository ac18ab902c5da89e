"""Benchmark the Mosaic GPU tree-verify kernel against XLA; roofline from ceilings measured in-run.

Time = CUPTI sum of every kernel of one whole call (the kernel, the mask words, the merge),
median over --reps, input sets rotated. The PROBES shapes (open A/Bs) and the issue's other "must
show" shapes run first, then the grid
L x N x H x B until --budget_s is spent; one JSON line per (shape, impl); at the end every pallas
row again, then one line per shape: the default, the fastest variant and its % of copy.
Default grid: B=1, L=46000, N in {1, 8, 16, 64}, H in {8, 64} (~2 min); --full_grid: the issue's
table (L in {4096, 16384, 46000, 131072}, N in {1, 8, 16, 32, 64}, H in {8, 64}, B in {1, 4}).

  python -m pallas_kernels.tree_verify.bench --json_out=bench.jsonl [--full_grid]
"""

import itertools
import json
import math
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import roofline
from pallas_kernels import bench_flags
from pallas_kernels.tree_verify import api, masks, reference
from pallas_kernels.tree_verify.tuning import Tuning, default_tuning

FLAGS = flags.FLAGS
DEFAULT_CACHE = "/tmp/kdtree_jax_compile_cache"
flags.DEFINE_list("L", ["46000"], "cache lengths")
flags.DEFINE_list("N", ["1", "8", "16", "64"], "tree nodes")
flags.DEFINE_list("H", ["8", "64"], "heads")
flags.DEFINE_list("B", ["1"], "batch sizes")
flags.DEFINE_bool("full_grid", False, "the issue's table: replaces L, N, H, B by FULL_GRID")
flags.DEFINE_bool("must_show_first", True,
                  "run the PROBES shapes (in PROBES' order), then the issue's other must-show "
                  "shapes, before the grid")
flags.DEFINE_float("budget_s", 300.0, "stop starting new shapes, and variants other than the "
                   "default, after this many seconds")
flags.DEFINE_string("json_out", "", "JSON lines output")
flags.DEFINE_string("tunings", "", "extra kernel variants for every shape: ';'-separated k=v,k=v "
                    "(Tuning fields, and mask=packed)")
flags.DEFINE_bool("probe_variants", True, "time the PROBES variants on their shapes (notes/kernel.md)")
flags.DEFINE_bool("skip_xla", False, "do not time the XLA baseline")
flags.DEFINE_string("cache_dir", "", "persistent compilation cache folder (default: the one jax "
                    "already has, e.g. from JAX_COMPILATION_CACHE_DIR, else " + DEFAULT_CACHE + ")")

C, R, L2_BYTES = 576, 512, 60e6
# (B, N, H, L) of the issue's "must show", in its order.
MUST_SHOW = [(1, 1, 8, 46000), (1, 1, 8, 131072), (1, 8, 8, 46000), (1, 16, 8, 46000),
             (1, 64, 8, 46000), (1, 64, 64, 46000), (1, 8, 64, 46000), (1, 16, 64, 46000),
             (1, 32, 64, 46000)]
FULL_GRID = dict(L=[4096, 16384, 46000, 131072], N=[1, 8, 16, 32, 64], H=[8, 64], B=[1, 4])
# Knob variants timed beside the default on a few shapes, most informative first (past --budget_s
# the rest is skipped): k=v Tuning fields, plus mask=packed (the tree mask packed once outside the
# call, as the model does per step: the call is the kernel + the merge; a must-show shape without
# a packed probe gets one). Measured and dropped (s3, notes/kernel.md): merge=triton (now the
# default where the call splits), prefetch=2 and block_kv=32,stages=4 (+ prefetch=4): no gain
# (both since removed from the kernel, as were shared_p=0, f32 partials and kernel=v1).
# swap_ab (kernel_swap.py): one row tile of M = N*H <= 64 rows scored as S^T = K Q^T (keys the
# wgmma M, the q rows its N): at N=1, H=8 1/8 of the default's tensor work and a 9 KB Q tile.
# Measured (H200, fifth session): N=1 H=8 21.4 vs 23.6 us, the default there since
# (tuning.SWAP_AB_MAX_ROWS); swap_ab=0 is the previous kernel's row. Measured slower the same
# week and dropped: pipeline_qk (tile i + 1's QK^T under tile i's softmax; 1.4-1.5x slower at
# N=64, removed from the kernel), shared_p=0 and the 32-key ring at N=1. At N=8, H=8 and N=1,
# H=64 (M = 64) swap-AB does the same tensor work (a check of the swapped structure). At 1x1x8
# the default's own packed row (the model's ar call) is listed: swap_ab=0's suppresses the auto one.
# verify11 (notes/kernel.md "Why N=16, H=8 costs 28 us"): cluster_rows=2 (the two row tiles of a
# split in one cluster, KV tiles TMA-multicast: each leaves L2 once per split) at the DDTree 15
# verify's M = 128 (also in the model's packed form, beside the default's), 2 and 4 at N=64;
# merge_cols (Triton merge programs of 256 / 512 value columns instead of 64) where the partials
# are 8.6 MB (N=8, N=16). The default's packed row is listed where another packed row would
# suppress the auto one. The cluster rows come last in their shape: a first run of a new
# multicast / cluster-barrier path that faults loses the CUDA context for every later row (s7).
# vn1 (notes/kernel.md "Why N=1, H=8 costs 17 + 3 us"), the ar call (packed mask, against the
# default's packed row): 128 splits (the same 6-tile critical path and 120 streaming CTAs as 132,
# the merge one 128-split piece), balanced_splits (59 x 6 + 73 x 5 tiles: all 132 SMs stream),
# merge_loads_first (the Triton merge's partial loads in flight with its LSE loads), merge_cols=32
# (128 merge programs instead of 64), and the three together.
# pdl11 (pallas_kernels/pdl.py): pdl=1 (programmatic dependent launch: griddepcontrol.wait
# before the first input read, launch_dependents after the last load) in the model's packed form
# at the ar and DDTree 15 shapes; before the cluster rows at 1x16x8 (those stay last, above).
# s28 (no GPU lent; queued): merge_loads_first at N=8 and N=16, where the merge reads 8.6 MB of
# partials (5.1 us at N=16, H200 s9), measured only at N=1 (-0.6 us, H200 s11: the default there).
AR_PROBES = ("num_splits=128,mask=packed;balanced_splits=1,mask=packed;"
             "merge_loads_first=1,mask=packed;merge_cols=32,mask=packed;"
             "num_splits=128,balanced_splits=1,merge_loads_first=1,mask=packed")
PROBES = {(1, 16, 8, 46000): ("mask=packed;merge_cols=256;merge_cols=512;pdl=1,mask=packed;"
                              "merge_loads_first=1,mask=packed;"
                              "cluster_rows=2;cluster_rows=2,mask=packed"),
          (1, 8, 8, 46000): "merge_cols=256;merge_cols=512;swap_ab=1;merge_loads_first=1",
          (1, 1, 8, 46000): ("mask=packed;swap_ab=0;swap_ab=0,mask=packed;num_splits=66;"
                             + AR_PROBES + ";pdl=1,mask=packed"),
          (1, 64, 8, 46000): "cluster_rows=2;cluster_rows=4",
          (1, 1, 64, 46000): "swap_ab=1",
          (4, 1, 8, 46000): "swap_ab=0;num_splits=66",
          (4, 16, 8, 46000): "num_splits=32"}


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


def timing_program(fn):
  """One jitted program calling fn once per input set (distinct sets, so XLA cannot CSE the
  calls; rotating sets keeps data that fits in L2 from being re-read from L2)."""
  return jax.jit(lambda *all_sets: [fn(*s) for s in all_sets])


def device_time_us(fn, sets, reps, prog=None):
  """Median over reps of the CUPTI-summed kernel time of one call (all kernels it launches):
  time of `prog` (default timing_program(fn); pass one already run to reuse its compile) over
  the sets / len(sets)."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  prog = prog if prog is not None else timing_program(fn)
  _, ts = profiler.measure(prog, iterations=max(2, reps))(*sets)
  return statistics.median(ts) * 1e3 / len(sets)


def make_set(b, n, h, l, seed):
  """Random inputs; ragged lengths when B > 1 (the longest row uses the whole cache)."""
  kq, kc = jax.random.split(jax.random.key(seed))
  q = jax.random.normal(kq, (b, n, h, C), jnp.bfloat16)
  cache = jax.random.normal(kc, (b, l, C), jnp.bfloat16)
  rng = np.random.default_rng(seed)
  lengths = [l - n] + [int(rng.integers(l // 2, l - n + 1)) for _ in range(b - 1)]
  mask = masks.random_tree_mask(rng, b, n)
  return q, cache, jnp.asarray(lengths, jnp.int32), jnp.asarray(mask)


def parse_tunings(spec, b, n, h, l):
  """[(name, Tuning, packed mask)]: the default heuristic plus the ';'-separated variants."""
  out = [("default", default_tuning(b, n, h, l), False)]
  for item in filter(None, spec.split(";")):
    kv = dict(x.split("=") for x in item.split(","))
    packed = kv.pop("mask", "bool") == "packed"
    kv = {k: v if k == "merge" else int(v) for k, v in kv.items()}
    base = default_tuning(b, n, h, l).__dict__ | kv
    out.append((item, Tuning(**base), packed))
  return out


def variant_spec(shape):
  """--tunings plus the shape's PROBES; a must-show shape without a packed-mask probe gets the
  default with the mask packed (the model's per-layer call)."""
  spec = FLAGS.tunings
  if FLAGS.probe_variants:
    spec += ";" + PROBES.get(shape, "")
    if shape in MUST_SHOW and "mask=packed" not in spec:
      spec += ";mask=packed"
  return spec


def shape_cost(b, n, h, l, lengths, ceil):
  """Bytes (the keys each batch row reads, q, out), FLOPs, roofline floor in us."""
  keys = sum(min(int(x) + n, l) for x in np.asarray(lengths))
  byts = 1152 * keys + 2 * b * n * h * (C + R)
  flops = 2 * h * n * keys * (C + R)
  return byts, flops, roofline.floor_s(byts, flops, ceil) * 1e6


def check(out, ref):
  """(relative L2 error vs the f32 reference, all finite), on the host."""
  o32, r32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  err = float(np.linalg.norm(o32 - r32) / np.linalg.norm(r32))
  return err, bool(np.isfinite(o32).all())


CPU_REFERENCE_BYTES = 1e9  # f32 scores [B, N, H, L] up to this size: the reference runs on the CPU


def reference_out(args, scale):
  """The f32 reference's output for one input set, as numpy. Compiled for and run on the host CPU
  when its scores take <= CPU_REFERENCE_BYTES (every default-grid shape): its XLA GPU compile took
  ~10 s a shape on the H200 (s3 verify_probes log: a shape's first variant 13-16 s after the
  last, every further variant, a kernel compile + check + timing, ~3 s)."""
  b, n, h, _ = args[0].shape
  small = b * n * h * args[1].shape[1] * 4 <= CPU_REFERENCE_BYTES
  if small:
    args = jax.device_put(args, jax.devices("cpu")[0])
  fn = jax.jit(lambda *a: reference.tree_verify_attention_reference(*a, scale=scale)[0])
  return np.asarray(fn(*args), np.float32)


def time_variant(t, sets, ref, scale):
  """{rel_err, finite, us}: checked against the reference first (us NaN if wrong); a variant that
  fails to compile or run gives us NaN and its error, and the other variants still run."""
  fn = lambda q, c, le, m: api.tree_verify_attention(q, c, le, m, scale=scale, backend="pallas",
                                                     tuning=t)
  try:
    prog = timing_program(fn)  # compiled once: checked on set 0's output, then timed
    err, finite = check(prog(*sets)[0], ref)
    ok = finite and err <= 1e-2
    return dict(rel_err=err, finite=finite,
                us=device_time_us(fn, sets, bench_flags.REPS.value, prog) if ok else float("nan"))
  except Exception as e:  # pylint: disable=broad-except
    print(f"FAILED {t}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return dict(rel_err=None, finite=None, us=float("nan"), error=f"{type(e).__name__}: {e}"[:500])


def bench_shape(b, n, h, l, ceil, deadline, scale=1.0 / math.sqrt(C)):
  """Rows (one per kernel variant, plus XLA) for one shape; past `deadline` (time.time()) only
  the default runs."""
  nsets = max(1, min(6, math.ceil(3 * L2_BYTES / (1152 * l * b))))
  sets = [make_set(b, n, h, l, seed) for seed in range(nsets)]
  byts, flops, floor_us = shape_cost(b, n, h, l, sets[0][2], ceil)
  ref = reference_out(sets[0], scale)
  packed_sets = [(q, c, le, masks.pack_tree_mask(m, h)) for q, c, le, m in sets]
  rows = []
  for name, t, packed in parse_tunings(variant_spec((b, n, h, l)), b, n, h, l):
    if rows and time.time() > deadline:
      print(f"budget spent: variant {name} of B={b} N={n} H={h} L={l} not run", flush=True)
      continue
    rows.append(dict(impl="pallas", variant=name, tuning=t.__dict__, packed_mask=packed,
                     **time_variant(t, packed_sets if packed else sets, ref, scale)))
    print(f"  [{time.time() - deadline + FLAGS.budget_s:5.0f} s] {b}x{n}x{h}x{l} {name}: "
          f"{rows[-1]['us']:.1f} us, rel err {rows[-1]['rel_err']}", flush=True)
  del ref
  if not FLAGS.skip_xla:
    big = b * n * h * l * 4 > 4e9
    fx = lambda q, c, le, m: xla_baseline(q, c, le, m, scale=scale)
    us = device_time_us(fx, sets[:1] if big else sets, max(3, bench_flags.REPS.value // (5 if big else 1)))
    rows.append(dict(impl="xla", variant="einsum", tuning=None, rel_err=None, finite=None, us=us))
  xla_us = next((r["us"] for r in rows if r["impl"] == "xla"), float("nan"))
  copy_us = byts / (ceil["copy_tbps"] * 1e6)
  for r in rows:
    r.update(B=b, N=n, H=h, L=l, bytes=byts, flops=flops, floor_us=floor_us, nsets=nsets,
             tbps=byts / r["us"] / 1e6, tflops=flops / r["us"] / 1e6,
             pct_roofline=100 * floor_us / r["us"], pct_copy=100 * copy_us / r["us"],
             x_xla=xla_us / r["us"])
  return rows


def ordered_shapes():
  axes = [FULL_GRID[k] if FLAGS.full_grid else list(map(int, FLAGS[k].value)) for k in "BNHL"]
  grid = list(itertools.product(*axes))
  # PROBES' shapes in their order (the open A/Bs first), then the rest of the must-show shapes
  first = [s for s in list(PROBES) + MUST_SHOW if s in grid] if FLAGS.must_show_first else []
  first = list(dict.fromkeys(first))
  return first + [s for s in grid if s not in first]


def fmt_row(r):
  err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "-"
  return (f"{r['B']:>2} {r['N']:>3} {r['H']:>3} {r['L']:>7} {r['impl']:>6} {r['variant'][:56]:>56} "
          f"{r['us']:>8.1f} {r['floor_us']:>7.1f} {r['tbps']:>5.2f} {r['tflops']:>6.1f} "
          f"{r['pct_roofline']:>6.1f} {r['pct_copy']:>6.1f} {r['x_xla']:>5.2f} {err:>8}")


HEADER = (" B   N   H       L   impl" + " " * 50 + "variant       us floor_us  TB/s TFLOP/s  %roof "
          " %copy  xXLA   relerr")


def best_table(rows):
  """Per shape (sorted): the default, the fastest correct pallas variant with the bool mask (what
  a default flip gives) and the fastest overall; % of copy = (bytes / copy rate) / time."""
  lines = ["best per shape (bool mask: the library call; any: incl. mask=packed):",
           f"{'B x N x H x L':>16} {'default us':>10} {'best (bool mask)':>56} {'us':>6} "
           f"{'%copy':>6} {'%roof':>6} {'best (any)':>56} {'us':>6} {'%copy':>6}"]
  by_shape = {}
  for r in rows:
    if r["impl"] == "pallas" and r["us"] == r["us"]:  # not NaN (failed the check)
      by_shape.setdefault((r["B"], r["N"], r["H"], r["L"]), []).append(r)
  for shape in sorted(by_shape):
    rs = by_shape[shape]
    default = next((r["us"] for r in rs if r["variant"] == "default"), float("nan"))
    bool_rows = [r for r in rs if not r.get("packed_mask")] or rs
    bb, ba = min(bool_rows, key=lambda r: r["us"]), min(rs, key=lambda r: r["us"])
    lines.append(f"{'x'.join(map(str, shape)):>16} {default:>10.1f} {bb['variant'][:56]:>56} "
                 f"{bb['us']:>6.1f} {bb['pct_copy']:>6.1f} {bb['pct_roofline']:>6.1f} "
                 f"{ba['variant'][:56]:>56} {ba['us']:>6.1f} {ba['pct_copy']:>6.1f}")
  return "\n".join(lines)


def main(_):
  cache_dir = FLAGS.cache_dir or jax.config.jax_compilation_cache_dir or DEFAULT_CACHE
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  t0 = time.time()
  dev = jax.devices()[0]
  ceil = roofline.measure_ceilings()
  print(f"device={dev.device_kind} jax={jax.__version__} copy={ceil['copy_tbps']:.2f} TB/s "
        f"bf16 matmul={ceil['mm_tflops']:.0f} TFLOP/s", flush=True)
  jf = open(FLAGS.json_out, "w") if FLAGS.json_out else None  # pylint: disable=consider-using-with
  if jf:
    jf.write(json.dumps(dict(ceilings=ceil, device=dev.device_kind, jax=jax.__version__)) + "\n")
  rows, shapes = [], ordered_shapes()
  print(HEADER, flush=True)
  for i, (b, n, h, l) in enumerate(shapes):
    if time.time() - t0 > FLAGS.budget_s:
      print(f"budget {FLAGS.budget_s:.0f} s spent: {len(shapes) - i} shapes not run", flush=True)
      break
    try:
      new = bench_shape(b, n, h, l, ceil, deadline=t0 + FLAGS.budget_s)
    except Exception as e:  # pylint: disable=broad-except
      print(f"FAILED B={b} N={n} H={h} L={l}: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    for r in new:
      print(fmt_row(r), flush=True)
      if jf:
        jf.write(json.dumps(r) + "\n")
        jf.flush()
    rows += new
  print(f"\nceilings: copy {ceil['copy_tbps']:.2f} TB/s, bf16 matmul {ceil['mm_tflops']:.0f} "
        f"TFLOP/s; {time.time() - t0:.0f} s\n{HEADER}")
  for r in rows:
    if r["impl"] == "pallas":
      print(fmt_row(r))
  print("\n" + best_table(rows), flush=True)


if __name__ == "__main__":
  app.run(main)
