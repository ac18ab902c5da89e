"""The measured ceilings' copy buffer fits the device's free memory (kdtree_jax/roofline.py)."""
from kdtree_jax import roofline

GIB, MIB = 1 << 30, 1 << 20


def test_copy_buffer_unchanged_without_memory_stats_or_with_room():
  assert roofline.fit_copy_bytes(4 * GIB, None) == 4 * GIB  # CPU devices report none
  assert roofline.fit_copy_bytes(4 * GIB, {"bytes_in_use": 0}) == 4 * GIB
  assert roofline.fit_copy_bytes(4 * GIB, {"bytes_limit": 60 * GIB, "bytes_in_use": 20 * GIB}) \
      == 4 * GIB


def test_copy_buffer_shrinks_to_an_eighth_of_free_memory_in_whole_mib():
  # s17's H100: a 32-layer share loaded, ~4.5 GB left, 4 GiB asked for -> OOM before this
  stats = {"bytes_limit": 62_000_000_000, "bytes_in_use": 57_500_000_000}
  assert roofline.fit_copy_bytes(4 * GIB, stats) == 536 * MIB  # 4.5e9 / 8 = 562.5e6 B = 536.4 MiB


def test_copy_buffer_never_below_the_l2_safe_minimum():
  stats = {"bytes_limit": 10 * GIB, "bytes_in_use": 10 * GIB - 100 * MIB}
  assert roofline.fit_copy_bytes(4 * GIB, stats) == 256 * MIB


def test_small_ceilings_measure_on_cpu():
  ceil = roofline.measure_ceilings(small=True)
  assert ceil["copy_tbps"] > 0 and ceil["mm_tflops"] > 0
