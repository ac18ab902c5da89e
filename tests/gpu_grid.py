"""The one helper for the GPU full grid (tests/GPU_TESTS.md): the default GPU set compiles each
kernel path once, and the same path at other shapes, tile sizes or layouts (or one only an A/B
tuning takes) runs with --gpu-full-grid. tests/conftest.py skips the `gpu_full_grid` mark
without that option. Importable from every test folder: pytest puts conftest.py's folder on
sys.path."""
import pytest


def full_grid(*values):
  """A parametrization run on a GPU only with --gpu-full-grid."""
  return pytest.param(*values, marks=pytest.mark.gpu_full_grid)
