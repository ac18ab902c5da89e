"""Timing of compiled programs: GPU kernel time (CUPTI) and wall time, for programs that donate.

A program that donates its inputs (the decode step donates the state) cannot be called twice on
the same arguments; `feed(args, out) -> next args` threads each call's outputs into the next call,
as the decode loop does. GPU kernel time comes from CUPTI through Mosaic GPU's extension: every
kernel of `iters` back-to-back calls, summed and divided by `iters`. No check that each call ran
the same kernels in the same order (under XLA command buffers the first call records a graph and
CUPTI then reports the graph's kernels, so per-call kernel lists differ; Mosaic's
`profiler.measure(iterations=n)` raises "Kernel names are not consistent across iterations").
"""

import statistics
import time

import jax


def same_args(args, out):
  """`feed` for programs that donate nothing: every call sees the same arguments."""
  del out
  return args


def _call(fn, args, feed):
  out = fn(*args)
  return out, feed(args, out)


def wall_ms(fn, args, feed=same_args, reps=10, warmup=2):
  """(median wall ms of one call, the args after the last call). Each call is waited for."""
  for _ in range(warmup):
    out, args = _call(fn, args, feed)
    jax.block_until_ready(out)
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out, args = _call(fn, args, feed)
    jax.block_until_ready(out)
    ts.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(ts), args


def cupti_available() -> bool:
  if jax.default_backend() != "gpu":
    return False
  try:
    from jax._src.lib import mosaic_gpu  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  return mosaic_gpu is not None


def kernel_ms(fn, args, feed=same_args, iters=10):
  """(GPU kernel ms per call, summed over every kernel; the args after the last call), or
  (None, args) off-GPU. One warm-up call first (compiles; records command buffers)."""
  if not cupti_available():
    return None, args
  from jax._src.lib import mosaic_gpu  # pylint: disable=import-outside-toplevel
  ext = mosaic_gpu._mosaic_gpu_ext  # pylint: disable=protected-access
  out, args = _call(fn, args, feed)
  jax.block_until_ready(out)
  ext._cupti_init()  # pylint: disable=protected-access
  timings = []
  try:
    for _ in range(iters):
      out, args = _call(fn, args, feed)
    jax.block_until_ready(out)
  finally:
    timings = ext._cupti_get_timings(True)  # pylint: disable=protected-access
  return sum(t for _, t in timings or []) / iters, args
