"""Timing of compiled programs: GPU kernel time (CUPTI) and wall time, for programs that donate.

A program that donates its inputs (the decode step donates the state) cannot be called twice on
the same arguments; `feed(args, out) -> next args` threads each call's outputs into the next call,
as the decode loop does. GPU kernel time comes from CUPTI through Mosaic GPU's extension: every
kernel of `iters` back-to-back calls, summed and divided by `iters`. No check that each call ran
the same kernels in the same order (under XLA command buffers the first call records a graph and
CUPTI then reports the graph's kernels, so per-call kernel lists differ; Mosaic's
`profiler.measure(iterations=n)` raises "Kernel names are not consistent across iterations").

What Mosaic's CUPTI extension (jax 0.11.2) records: only CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
records, as (name, end - start) with no timestamps, and its V1 path detaches CUPTI
(`cuptiFinalize`) at the end of every trace (`_cupti_get_timings(True)`). Measured on the H200
under command buffers (2026-12-01, calibrate_step_cost): the FIRST trace of an executable saw the
kernels its CUDA graphs launched (ar 4096: 7.34 ms of kernels vs a 6.68 ms loop step); every
later trace of it saw only ~0.001-0.5 ms (the kernels launched outside graphs), and the
executable's loop ran slower afterwards (6.68 -> 12.93 ms per step). So: (1) take a program's
wall times before any CUPTI trace of it; (2) trust a CUPTI sum of a graph-launched program only
from its first trace, or measure it compiled without command buffers (`NO_COMMAND_BUFFERS`, every
kernel launched by the host and recorded); (3) a sum of kernel durations is not device-busy time
when graph nodes overlap: `device_trace` (a jax.profiler trace: kernels with timestamps) gives
the union of the kernels' intervals.
"""

import concurrent.futures
import glob
import os
import re
import statistics
import tempfile
import threading
import time

import jax

NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}  # compiler_options: no CUDA graphs


def check_compiler_options(options: dict | None) -> None:
  """Compile a one-op program with `options` (XLA DebugOptions fields for `compiler_options`) and
  raise ValueError naming them where XLA refuses one: a benchmark checks its A/B options before
  loading weights. A name can be in jaxlib's binary and still not be an option of this jax
  (jax 0.11.2: 'xla_gpu_enable_split_k_autotuning' is "No such compile option"; an H100 call
  found it only after 95 s of loading and compiling, 2026-12-06)."""
  if not options:
    return
  program = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), "float32"))
  try:
    program.compile(compiler_options=options)
  except jax.errors.JaxRuntimeError as e:
    raise ValueError(f"XLA refuses compiler options {options}: {e}") from None


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


def _cupti_kernels(fn, args, feed, iters):
  """([(kernel name, ms)] of `iters` calls after one warm-up call (compiles; records command
  buffers), the args after the last call)."""
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
    timings = ext._cupti_get_timings(True) or []  # pylint: disable=protected-access
  return timings, args


def kernel_ms(fn, args, feed=same_args, iters=10):
  """(GPU kernel ms per call, summed over every kernel; the args after the last call), or
  (None, args) off-GPU."""
  if not cupti_available():
    return None, args
  timings, args = _cupti_kernels(fn, args, feed, iters)
  return sum(t for _, t in timings) / iters, args


def kernel_trace(fn, args, feed=same_args, iters=10):
  """(GPU kernel ms per call, [(kernel family, calls per call, us per call)] slowest first, the
  args after the last call) from ONE CUPTI trace, or (None, [], args) off-GPU. A family = the
  kernel name without its trailing instance number (`family`), so the 61 layers' copies of one
  fusion add up."""
  if not cupti_available():
    return None, [], args
  timings, args = _cupti_kernels(fn, args, feed, iters)
  grouped = [(family(name), ms) for name, ms in timings]
  return sum(t for _, t in timings) / iters, breakdown(grouped, iters), args


def family(kernel_name: str) -> str:
  """A kernel name without trailing instance numbers ('loop_add_fusion_12' -> 'loop_add_fusion',
  'gemm_fusion_dot.3' -> 'gemm_fusion_dot'): XLA numbers each fusion instance."""
  return re.sub(r"([._]\d+)+$", "", kernel_name)


def kernel_breakdown(fn, args, feed=same_args, iters=10):
  """[(kernel name, calls per program call, us per program call)], slowest first, summed over
  `iters` calls (CUPTI), or [] off-GPU. Says where a program's time goes kernel by kernel."""
  if not cupti_available():
    return []
  timings, _ = _cupti_kernels(fn, args, feed, iters)
  return breakdown(timings, iters)


def breakdown(timings, iters):
  """[(kernel name, calls per program call, us per program call)] of CUPTI (name, ms) records
  of `iters` calls, slowest first."""
  by_name = {}
  for name, ms in timings:
    n, total = by_name.get(name, (0, 0.0))
    by_name[name] = (n + 1, total + ms)
  rows = [(name, n / iters, 1e3 * total / iters) for name, (n, total) in by_name.items()]
  return sorted(rows, key=lambda r: -r[2])


def busy_union_ns(intervals) -> int:
  """Length of the union of [start, end) intervals (ns): time at least one kernel ran."""
  total, end = 0, None
  for s, e in sorted(intervals):
    if end is None or s > end:
      total += e - s
      end = e
    elif e > end:
      total += e - end
      end = e
  return total


def device_intervals(profile_data):
  """[(start_ns, end_ns)] of every activity on the GPU planes' stream lines of a jax.profiler
  trace (kernels and copies, graph-launched ones included when the tracer records them)."""
  out = []
  for plane in profile_data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if line.name.startswith("Stream"):
        out += [(ev.start_ns, ev.end_ns) for ev in line.events if ev.end_ns > ev.start_ns]
  return out


def trace_summary(intervals, calls: int) -> dict | None:
  """{busy_ms, span_ms, kernel_sum_ms, kernels} per call from device intervals, or None."""
  if not intervals:
    return None
  span = max(e for _, e in intervals) - min(s for s, _ in intervals)
  return dict(busy_ms=busy_union_ns(intervals) / 1e6 / calls, span_ms=span / 1e6 / calls,
              kernel_sum_ms=sum(e - s for s, e in intervals) / 1e6 / calls,
              kernels=len(intervals) / calls)


def device_trace(fn, args, feed=same_args, iters=1):
  """(trace_summary of `iters` calls after one warm-up call, args after the last call) from a
  jax.profiler trace (XLA's own CUPTI tracer: kernels with start and end timestamps), or
  (None, args) off-GPU or when the trace has no device activity."""
  if jax.default_backend() != "gpu":
    return None, args
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  out, args = _call(fn, args, feed)
  jax.block_until_ready(out)
  with tempfile.TemporaryDirectory() as logdir:
    jax.profiler.start_trace(logdir)
    try:
      for _ in range(iters):
        out, args = _call(fn, args, feed)
      jax.block_until_ready(out)
    finally:
      jax.profiler.stop_trace()
    files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    data = ProfileData.from_file(files[0]) if files else None
  return (trace_summary(device_intervals(data), iters) if data else None), args


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
  """Counts XLA backend compiles (and their seconds) and persistent-cache hits while active, in
  the thread that entered it and the worker threads `Deadline` boxes start from that thread
  (compiles run in the calling thread; other threads may compile at the same time):

    with CompileCounter() as cc:
      ...
    cc.compiles, cc.compile_s, cc.cache_hits
  """

  _active: list = []
  _installed = False

  def __init__(self):
    self.compiles, self.compile_s, self.cache_hits = 0, 0.0, 0
    self.threads = {threading.get_ident()}

  @classmethod
  def _install(cls):
    if cls._installed:
      return
    jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
    jax.monitoring.register_event_listener(cls._on_event)
    cls._installed = True

  @classmethod
  def _on_duration(cls, event, secs, **_):
    if event == BACKEND_COMPILE_EVENT:
      for c in cls._mine():
        c.compiles += 1
        c.compile_s += secs

  @classmethod
  def _on_event(cls, event, **_):
    if event == CACHE_HIT_EVENT:
      for c in cls._mine():
        c.cache_hits += 1

  @classmethod
  def _mine(cls):
    me = threading.get_ident()
    return [c for c in list(cls._active) if me in c.threads]

  @classmethod
  def adopt(cls, parent: int, child: int, on: bool):
    """Counts (on) or stops counting (off) `child`'s compiles for the counters of `parent`."""
    for c in list(cls._active):
      if parent in c.threads:
        (c.threads.add if on else c.threads.discard)(child)

  def __enter__(self):
    self._install()
    self.threads = {threading.get_ident()}
    CompileCounter._active.append(self)
    return self

  def __exit__(self, *exc):
    CompileCounter._active.remove(self)
    return False

  def as_dict(self):
    return dict(xla_compiles=self.compiles, xla_compile_s=self.compile_s, cache_hits=self.cache_hits)


class Deadline:
  """A wall-clock budget for a whole benchmark run: `left()` seconds remain; `box(fn, limit)`
  runs fn in a worker thread for at most min(limit, left()) seconds.

  A call that runs past its box is abandoned, not stopped (XLA compiles cannot be interrupted):
  it keeps a CPU busy until the process exits, so callers end with `os._exit` once results
  are written.
  """

  def __init__(self, seconds: float):
    self.end = time.perf_counter() + seconds

  def left(self) -> float:
    return self.end - time.perf_counter()

  def box(self, fn, limit: float | None = None):
    """(result, seconds, status): status 'ok', 'timeout' or 'error: ...'."""
    wait = self.left() if limit is None else min(limit, self.left())
    if wait <= 0:
      return None, 0.0, "timeout"
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    t0 = time.perf_counter()
    fut = pool.submit(_counted, threading.get_ident(), fn)
    try:
      return fut.result(timeout=wait), time.perf_counter() - t0, "ok"
    except concurrent.futures.TimeoutError:
      return None, time.perf_counter() - t0, "timeout"
    except Exception as e:  # pylint: disable=broad-except
      return None, time.perf_counter() - t0, f"error: {type(e).__name__}: {e}"[:500]
    finally:
      pool.shutdown(wait=False)

  def box_all(self, fns, limit: float | None = None):
    """`box` for several calls run at once (one thread each), all inside one box; a list of
    (result, seconds, status), each call's seconds its own."""
    wait = self.left() if limit is None else min(limit, self.left())
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(fns)))
    t0 = time.perf_counter()
    ends = {}

    parent = threading.get_ident()

    def timed(i, fn):
      start = time.perf_counter()
      try:
        return _counted(parent, fn)
      finally:
        ends[i] = time.perf_counter() - start

    futs = [pool.submit(timed, i, fn) for i, fn in enumerate(fns)]
    concurrent.futures.wait(futs, timeout=None if wait == float("inf") else max(0.0, wait))
    out = []
    for i, fut in enumerate(futs):
      if not fut.done():
        out.append((None, time.perf_counter() - t0, "timeout"))
      elif fut.exception() is not None:
        e = fut.exception()
        out.append((None, ends.get(i, 0.0), f"error: {type(e).__name__}: {e}"[:500]))
      else:
        out.append((fut.result(), ends[i], "ok"))
    pool.shutdown(wait=False)
    return out


def _counted(parent: int, fn):
  """fn() in a worker thread, its compiles counted by the CompileCounters of `parent`."""
  me = threading.get_ident()
  CompileCounter.adopt(parent, me, True)
  try:
    return fn()
  finally:
    CompileCounter.adopt(parent, me, False)
