"""GPU probe of Tuning(merge="kernel") (the split merge inside the tree-verify kernel), ONE case
per process: a fault in the kernel (the 2026-12-01 build died with CUDA_ERROR_MISALIGNED_ADDRESS)
loses the process' CUDA context, and with it every later row of that process.

  python3 scripts/probe_verify_merge.py --case rows64 [--rows_out F] [--check_only]

A case (CASES) times, in this order, the default call (swap-AB, Triton merge), the case's own
Triton-merge twin when it differs from the default, then the merge=kernel variant, each with the
packed tree mask (the model's per-layer call: kernel + merge, no mask fusion). Every row: rel L2
err vs the f32 reference (on the CPU) and CUPTI us of the whole call (bench.device_time_us: the
sum of every kernel of one call, median over --reps, input sets rotated), then each kernel's
CUPTI us (median of 10 calls on one set: the zero-fill and the kernel's merge tail against the
Triton merge). Rows print as they
finish, each preceded by a START line (the log shows which call faulted). The default rows come
first so they survive a merge=kernel fault. --check_only: the merge=kernel variant alone, one call
and the check, no timing (for compute-sanitizer). scripts/gpu_measure.sh part verify_merge runs
the cases one process each under their own `timeout`. Exit status 1 if a row is wrong (rel err
> 1e-2 or not finite), so the part's `exit` line shows it.
"""

import json
import math
import os
import statistics
import sys
import time

from absl import app, flags
import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
# pylint: disable=wrong-import-position
from pallas_kernels import bench_flags
from pallas_kernels.tree_verify import api, bench, masks
from pallas_kernels.tree_verify.tuning import Tuning, default_tuning

AR = (1, 1, 8, 46000)  # one GPU's share of K2.6's ar call: B, N, H, L
# name: (shape, Tuning fields over default_tuning(shape) for the merge=kernel variant). Order of
# gpu_measure's part: the 64-row kernel (its LSE slots were 256 bytes, aligned even before the
# fix), then swap-AB (the shape that faulted), then two levels (~sqrt(S) a chunk).
CASES = {
    "rows64": (AR, dict(swap_ab=False, merge="kernel")),
    "swap": (AR, dict(merge="kernel")),
    "swap_chunk": (AR, dict(merge="kernel", merge_chunk=12)),
    "ddtree16": ((1, 16, 8, 46000), dict(merge="kernel")),  # not in the part (2 row tiles)
}
_CASE = flags.DEFINE_enum("case", "swap", list(CASES), "the one case this process runs")
_JSON_OUT = flags.DEFINE_string("rows_out", "", "append one JSON line per row to this file")
_CHECK_ONLY = flags.DEFINE_bool("check_only", False, "merge=kernel alone: one call + the check")
_SHAPE = flags.DEFINE_string("shape", "", "B,N,H,L instead of the case's (CPU smoke tests)")
_BACKEND = flags.DEFINE_enum("backend", "pallas", ["pallas", "interpret"],
                             "interpret: the CPU smoke test (--check_only, a small --shape)")


def variants(shape, fields):
  """[(label, Tuning)]: the default, the Triton twin (the variant's fields with the default's
  merge) unless it is the default, the merge=kernel variant."""
  base = default_tuning(*shape)
  variant = Tuning(**(base.__dict__ | fields))
  twin = Tuning(**(variant.__dict__ | dict(merge=base.merge, merge_chunk=0)))
  out = [("default", base)] + ([("triton twin", twin)] if twin != base else [])
  return out + [("merge=kernel", variant)]


def time_row(label, t, sets, ref, scale, check_only):
  """One row: rel err vs the reference, then (unless check_only or wrong) CUPTI us."""
  print(f"START {label}: {t}", flush=True)
  fn = lambda q, c, le, m: api.tree_verify_attention(q, c, le, m, scale=scale,
                                                     backend=_BACKEND.value, tuning=t)
  t0 = time.time()
  prog = bench.timing_program(fn)
  err, finite = bench.check(prog(*sets)[0], ref)  # blocks: a fault surfaces here
  ok = finite and err <= 1e-2
  us, kernels = float("nan"), []
  if ok and not check_only:
    us = bench.device_time_us(fn, sets, bench_flags.REPS.value, prog)
    try:
      kernels = per_kernel_us(fn, sets[0])
    except Exception as e:  # pylint: disable=broad-except
      print(f"per-kernel listing failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
  row = dict(label=label, tuning=t.__dict__, rel_err=err, finite=finite, ok=ok, us=us,
             kernels=kernels, wall_s=round(time.time() - t0, 1))
  print(f"ROW {label}: {us:.2f} us, rel err {err:.2e}, finite {finite}"
        + ("" if ok else "  WRONG"), flush=True)
  for name, k_us in kernels:
    print(f"  {k_us:8.2f} us  {name}", flush=True)
  return row


def per_kernel_us(fn, args, iterations=10):
  """[(kernel name, CUPTI us, median over `iterations` calls)] of one call on one input set:
  where the call's time goes (merge=kernel: XLA's zero-fill of the counters + the Mosaic kernel;
  the default: the Mosaic kernel + the Triton merge)."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  _, runs = profiler.measure(jax.jit(fn), aggregate=False, iterations=iterations)(*args)
  return [(name[:80], round(1e3 * statistics.median(run[i][1] for run in runs), 2))
          for i, (name, _) in enumerate(runs[0])]


def main(_):
  shape, fields = CASES[_CASE.value]
  shape = tuple(map(int, _SHAPE.value.split(","))) if _SHAPE.value else shape
  b, n, h, l = shape
  scale = 1.0 / math.sqrt(bench.C)
  print(f"case {_CASE.value} shape {b}x{n}x{h}x{l} device={jax.devices()[0].device_kind} "
        f"jax={jax.__version__}", flush=True)
  nsets = max(1, min(6, math.ceil(3 * bench.L2_BYTES / (1152 * l * b))))
  sets = [bench.make_set(b, n, h, l, seed) for seed in range(nsets)]
  ref = bench.reference_out(sets[0], scale)
  packed = [(q, c, le, masks.pack_tree_mask(m, h)) for q, c, le, m in sets]
  rows = variants(shape, fields)
  if _CHECK_ONLY.value:
    rows = rows[-1:]
  wrong = []
  for label, t in rows:
    row = dict(case=_CASE.value, B=b, N=n, H=h, L=l, packed_mask=True, nsets=nsets,
               **time_row(label, t, packed, ref, scale, _CHECK_ONLY.value))
    if not row["ok"]:
      wrong.append(label)
    if _JSON_OUT.value:
      with open(_JSON_OUT.value, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
  print(f"case {_CASE.value} done" + (f": WRONG rows {wrong}" if wrong else ""), flush=True)
  return 1 if wrong else 0  # gpu_measure's "== case C exit N" line shows a wrong row as 1


if __name__ == "__main__":
  np.seterr(all="ignore")
  app.run(main)
