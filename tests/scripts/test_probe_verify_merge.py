"""scripts/probe_verify_merge.py (the merge=kernel GPU probe, one case per process) at a tiny shape
on a CPU: interpret mode, --check_only (no CUPTI timing), each case's merge=kernel row checked
against the f32 reference and written as a JSON line."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["rows64", "swap"])
def test_probe_case_rows(tmp_path, case):
  out = tmp_path / "rows.jsonl"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "probe_verify_merge.py"), "--case", case,
         "--shape", "1,1,8,700", "--backend", "interpret", "--check_only", "--rows_out", str(out)]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(x) for x in out.read_text().splitlines()]
  assert [r["label"] for r in rows] == ["merge=kernel"]
  assert rows[0]["tuning"]["merge"] == "kernel" and rows[0]["tuning"]["swap_ab"] == (case == "swap")
  assert rows[0]["finite"] and rows[0]["rel_err"] <= 1e-2
  assert "START merge=kernel" in proc.stdout and "WRONG" not in proc.stdout
