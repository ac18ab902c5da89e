"""scripts/bench_tree_builder.py at tiny size on a CPU: one XLA and one interpret-mode kernel row
per budget, each tree checked node for node against XLA's (ok), the padded candidate counts and
the `auto` decision of ddtree_build."""

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_bench_tree_builder_rows(tmp_path):
  out = tmp_path / "rows.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_tree_builder.py"), "--budgets",
         "3,15", "--vocab", "64", "--iters", "2", "--compile_cache_dir=", "--out", str(out)]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(x) for x in out.read_text().splitlines()]
  assert [(r["budget"], r["builder"]) for r in rows] == [
      (b, name) for b in (3, 15) for name in ("xla", "interpret")]
  assert all(r["ok"] and r["us"] is None and r["auto_takes_kernel"] for r in rows)
  assert [r["padded_candidates"] for r in rows] == [8, 8, 64, 64]
  assert "FAIL" not in proc.stdout
