"""The notebooks are committed executed (plots visible), run again end to end at small size, and
draw; sweep.py writes one JSON line per point."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NOTEBOOKS = ("01_decode_and_tree.ipynb", "02_benchmarks.ipynb")


@pytest.fixture
def nb_env(monkeypatch):
  """The kernel inherits this environment: small sizes, headless matplotlib, one CPU device."""
  monkeypatch.setenv("KDTREE_NB_SMALL", "1")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, nb_env):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  committed = [o for c in code for o in c.outputs]
  assert any("image/png" in o.get("data", {}) for o in committed), \
      f"{name} is committed without its plots (run notebooks/make_notebooks.py)"
  assert not [o for o in committed if o.output_type == "error"], f"{name} was committed failing"
  assert all(c.execution_count for c in code), f"{name} has cells that were not run"
  for c in code:  # CI runs it again, at small size, from clean
    c.outputs, c.execution_count = [], None
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=120,
                                   resources={"metadata": {"path": ROOT}})
  client.execute()
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert images, f"{name} drew no image"


def test_notebooks_match_generator(tmp_path):
  """The committed .ipynb files are what make_notebooks.py writes."""
  spec = importlib.util.spec_from_file_location(
      "make_notebooks", os.path.join(ROOT, "notebooks", "make_notebooks.py"))
  make_notebooks = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(make_notebooks)
  nbformat = pytest.importorskip("nbformat")
  for name, cells in (("01_decode_and_tree.ipynb", make_notebooks.DECODE),
                      ("02_benchmarks.ipynb", make_notebooks.BENCH)):
    committed = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
    assert [c.source for c in committed.cells] == [s for _, s in cells], name


def _bench_script(name, *args, timeout=120):
  """Runs scripts/<name> on configs/bench_tiny.py (one CPU device); returns the finished process."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, os.path.join(ROOT, "scripts", name),
         "--config", os.path.join(ROOT, "configs", "bench_tiny.py"), *args]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


@pytest.mark.slow
def test_sweep_json_lines(tmp_path):
  out = tmp_path / "sweep.jsonl"
  proc = _bench_script("sweep.py", "--mode", "chain,ddtree", "--budgets", "4", "--block_sizes",
                       "4", "--ctx", "32,64", "--gen", "2", "--json_out", str(out))
  assert "[2/2] ddtree" in proc.stdout
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["mode"], r["budget"], r["block_size"], r["ctx"]) for r in rows] == [
      ("chain", None, 4, 32), ("chain", None, 4, 64), ("ddtree", 4, 4, 32), ("ddtree", 4, 4, 64)]
  for r in rows:
    assert r["kind"] == "sweep" and r["ms_per_step"] > 0 and r["tokens_per_s"] > 0
    assert 1 <= r["accepted_per_step"] <= min(r["forced_accept"], r["block_size"] - 1) + 1
  assert rows[0]["accepted_per_step"] == 4  # chain: the forced 3 nodes + the root
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from kdtree_jax import plots  # pylint: disable=import-outside-toplevel
  res = plots.load([str(out)])
  fig = plt.figure()
  plots.plot_sweep(fig, res["sweep"])
  fig.savefig(tmp_path / "sweep.png")
  assert (tmp_path / "sweep.png").stat().st_size > 0


@pytest.mark.slow
def test_context_bench_with_phase_table(tmp_path):
  """bench_context_decode.py: the throughput rows and the phase table (each phase compiled alone)."""
  out = tmp_path / "ctx.jsonl"
  _bench_script("bench_context_decode.py", "--ctx", "64", "--mode", "ar,ddtree", "--gen", "2",
                "--profile_ctx", "64", "--json_out", str(out), timeout=300)
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  (table,) = [r for r in rows if r["kind"] == "phases"]
  phases = [r["phase"] for r in table["rows"]]
  for name in ("draft_ctx", "draft_block", "tree", "verify", "attention", "moe", "accept",
               "commit", "step"):
    assert name in phases, phases
  assert all(r["ms"] > 0 for r in table["rows"] if r["phase"] != "rest")
  runs = [(r["mode"], r["ctx"]) for r in rows if r["kind"] == "throughput"]
  assert runs == [("ar", 64), ("ddtree", 64)]
