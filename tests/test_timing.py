"""Device-busy time from kernel intervals: overlapping kernels (concurrent graph nodes) count
once, gaps between kernels do not count; and the compiler-option check benchmarks run before
loading weights."""

import pytest

from kdtree_jax import timing


def test_busy_union_merges_overlaps_and_skips_gaps():
  assert timing.busy_union_ns([]) == 0
  assert timing.busy_union_ns([(0, 10), (5, 12), (20, 25), (21, 22)]) == 12 + 5
  assert timing.busy_union_ns([(30, 40), (0, 10)]) == 20


def test_trace_summary_per_call():
  s = timing.trace_summary([(0, 1_000_000), (500_000, 1_500_000), (3_000_000, 4_000_000)], 2)
  assert s == dict(busy_ms=1.25, span_ms=2.0, kernel_sum_ms=1.5, kernels=1.5)
  assert timing.trace_summary([], 1) is None


def test_device_trace_is_none_off_gpu():
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  if jax.default_backend() == "gpu":
    return
  out, args = timing.device_trace(jax.jit(jnp.sin), (jnp.ones(3),))
  assert out is None and len(args) == 1


def test_family_strips_instance_numbers_only():
  assert timing.family("loop_add_fusion_12") == "loop_add_fusion"
  assert timing.family("gemm_fusion_dot.3") == "gemm_fusion_dot"
  assert timing.family("input_reduce_fusion") == "input_reduce_fusion"
  assert timing.family("tree_verify_v1") == "tree_verify_v1"


def test_breakdown_sums_calls_and_us_per_program_call():
  rows = timing.breakdown([("a", 1.0), ("b", 0.5), ("a", 1.0), ("a", 2.0)], 2)
  assert rows == [("a", 1.5, 2000.0), ("b", 0.5, 250.0)]


def test_check_compiler_options_refuses_an_unknown_field_and_accepts_known_ones():
  """XLA itself is the reference: a field it does not parse raises before any weights load."""
  timing.check_compiler_options(None)
  timing.check_compiler_options({"xla_gpu_experimental_force_split_k": 1})
  timing.check_compiler_options(timing.NO_COMMAND_BUFFERS)
  with pytest.raises(ValueError, match="xla_gpu_enable_split_k_autotuning"):
    timing.check_compiler_options({"xla_gpu_enable_split_k_autotuning": False})
