"""Test setup: 8 simulated CPU devices (multi-device code is tested on CPU), f32 matmuls, and the
markers: `gpu` tests (a compiled Mosaic GPU kernel) skip without a GPU; `slow` ones (over ~30 s
on 2 CPU cores) run in the whole suite and are left out of the fast set (`-m "not slow"`).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  """Marks every `gpu` test skipped when JAX has no GPU backend, and every `gpu_full_grid` test
  (or parametrization) skipped without --gpu-full-grid."""
  full_grid = config.getoption("--gpu-full-grid")
  skip_grid = pytest.mark.skip(reason="GPU full grid: pass --gpu-full-grid")
  on_gpu = jax.default_backend() == "gpu"
  skip_gpu = pytest.mark.skip(reason="gpu: a compiled Mosaic GPU kernel; this machine has no GPU")
  for item in items:
    if not on_gpu and item.get_closest_marker("gpu"):
      item.add_marker(skip_gpu)
    elif not full_grid and item.get_closest_marker("gpu_full_grid"):
      item.add_marker(skip_grid)


def pytest_addoption(parser):
  parser.addoption("--gpu-full-grid", action="store_true", default=False,
                   help="GPU kernels: also run the full grids (tree-verify (N, H, L), the bitonic DDTree builder per budget and warps)")
