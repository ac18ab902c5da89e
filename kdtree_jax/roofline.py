"""Measured ceilings (copy bandwidth, bf16 matmul rate) and timing helpers for benchmarks."""

import statistics
import time

import jax
import jax.numpy as jnp


def wall_time_s(fn, *args, reps=20, warmup=2):
  """Median wall time of fn(*args) (jitted; block_until_ready), after warm-up calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


COPY_LIVE_BUFFERS = 8  # the input, the 5 outputs a timed call keeps alive, slack
MIN_COPY_BYTES = 1 << 28  # 256 MiB: still 5x an H100's / H200's 50 MB L2


def fit_copy_bytes(n_bytes, memory_stats):
  """The copy buffer's size: n_bytes, or less where the device's free memory (its allocator's
  bytes_limit - bytes_in_use) cannot hold COPY_LIVE_BUFFERS of them (a benchmark measuring its
  ceilings after loading a model that fills the GPU: bench_k26_full's 32 layers on an H100
  asked for 4 GiB and ran out, s17); never under MIN_COPY_BYTES. No memory_stats (CPU): n_bytes."""
  if not memory_stats or "bytes_limit" not in memory_stats:
    return n_bytes
  free = memory_stats["bytes_limit"] - memory_stats.get("bytes_in_use", 0)
  fitted = (free // COPY_LIVE_BUFFERS) >> 20 << 20  # whole MiB
  return max(MIN_COPY_BYTES, min(n_bytes, fitted))


def measure_copy_tbps(n_bytes=1 << 32):
  """Device copy bandwidth (bytes read + written) of a large buffer: max of copy and x * 2. The
  buffer shrinks to fit the device's free memory (fit_copy_bytes)."""
  n_bytes = fit_copy_bytes(n_bytes, jax.devices()[0].memory_stats())
  x = jax.random.normal(jax.random.key(0), (n_bytes // 4,), jnp.float32)
  best = 0.0
  for f in (jax.jit(lambda a: a.copy()), jax.jit(lambda a: a * 2)):
    t = wall_time_s(lambda a, f=f: [f(a) for _ in range(5)], x, reps=10) / 5
    best = max(best, 2 * x.nbytes / t / 1e12)
  return best


def measure_matmul_tflops(n=8192):
  """bf16 n^3 jnp.dot on random data."""
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, (n, n), jnp.bfloat16)
  b = jax.random.normal(kb, (n, n), jnp.bfloat16)
  f = jax.jit(jnp.dot)
  t = wall_time_s(lambda x, y: [f(x, y) for _ in range(10)], a, b, reps=10) / 10
  return 2 * n ** 3 / t / 1e12


def measure_ceilings(small=False):
  """{'copy_tbps', 'mm_tflops'} measured now (small=True: tiny sizes for CPU smoke runs)."""
  if small:
    return dict(copy_tbps=measure_copy_tbps(1 << 24), mm_tflops=measure_matmul_tflops(512))
  return dict(copy_tbps=measure_copy_tbps(), mm_tflops=measure_matmul_tflops())


def floor_s(n_bytes, flops, ceil):
  """Roofline floor: max(bytes / bandwidth, FLOPs / matmul rate)."""
  return max(n_bytes / (ceil["copy_tbps"] * 1e12), flops / (ceil["mm_tflops"] * 1e12))
