"""Every test that can only run on a GPU carries the `gpu` marker, so `pytest -m gpu` (every
GPU part of scripts/gpu_measure.sh) selects it. A test skipped off the GPU by its own
`skipif(jax.default_backend() != "gpu")` alone is deselected by `-m gpu` and never runs
anywhere: the DDTree builder kernel's GPU test was lost this way in s11's k26_tree part."""
import ast
import pathlib

TESTS = pathlib.Path(__file__).parent


def _decorator_sources(fn: ast.FunctionDef, source: str) -> list[str]:
  return [ast.get_source_segment(source, d) or "" for d in fn.decorator_list]


def _gpu_only_tests_without_marker(path: pathlib.Path, root: pathlib.Path = TESTS) -> list[str]:
  source = path.read_text()
  missing = []
  for node in ast.walk(ast.parse(source)):
    if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")
            or isinstance(node, ast.ClassDef) and node.name.startswith("Test")):
      continue
    decorators = _decorator_sources(node, source)
    gpu_only = any("skipif" in d and "gpu" in d.lower() for d in decorators)
    if gpu_only and not any(d.replace(" ", "") == "pytest.mark.gpu" for d in decorators):
      missing.append(f"{path.relative_to(root)}::{node.name}")
  return missing


def test_gpu_only_tests_carry_the_gpu_marker():
  missing = [name for path in sorted(TESTS.rglob("test_*.py"))
             for name in _gpu_only_tests_without_marker(path)]
  assert not missing, f"GPU-only tests without @pytest.mark.gpu (-m gpu skips them): {missing}"


def test_the_check_finds_an_unmarked_gpu_test(tmp_path):
  """The check itself: an unmarked skipif-GPU test is reported, a marked one is not."""
  unmarked = tmp_path / "test_x.py"
  unmarked.write_text('import jax, pytest\n'
                      '@pytest.mark.skipif(jax.default_backend() != "gpu", reason="GPU")\n'
                      'def test_a():\n  pass\n'
                      '@pytest.mark.gpu\n'
                      '@pytest.mark.skipif(jax.default_backend() != "gpu", reason="GPU")\n'
                      'def test_b():\n  pass\n'
                      '@pytest.mark.skipif(not ON_GPU, reason="compiled kernel: GPU only")\n'
                      'class TestC:\n  def test_c(self):\n    pass\n')
  assert _gpu_only_tests_without_marker(unmarked, tmp_path) == ["test_x.py::test_a",
                                                               "test_x.py::TestC"]
