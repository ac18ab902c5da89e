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


def measure_copy_tbps(n_bytes=1 << 32):
  """Device copy bandwidth (bytes read + written) of a large buffer: max of copy and x * 2."""
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
