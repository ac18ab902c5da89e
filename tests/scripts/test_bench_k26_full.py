"""scripts/bench_k26_full.py end to end at tiny size on a CPU (configs/bench_tiny.py): every part
writes its JSON lines, compiles are counted, and the time box stops the run cleanly."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _run(out_dir, *args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_k26_full.py"), "--config",
         os.path.join(ROOT, "configs", "bench_tiny.py"), "--out_dir", str(out_dir),
         "--compile_cache_dir=", *args]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(x) for x in (out_dir / "bench_k26_full.jsonl").read_text().splitlines()]
  return proc.stdout, rows


@pytest.mark.slow
def test_all_parts_at_tiny_size(tmp_path):
  stdout, rows = _run(tmp_path)
  compiles = [r for r in rows if r["kind"] == "compile"]
  assert [(r["mode"], r["part"]) for r in compiles] == [
      (m, p) for m in ("ar", "ddtree", "chain") for p in ("prefill", "loop")]
  for r in compiles:  # cache off: every program is a fresh XLA compile, counted
    assert r["status"] == "ok" and r["seconds"] > 0 and r["xla_compiles"] >= 1, r
  tables = [(r["mode"], r["budget"]) for r in rows if r["kind"] == "phases"]
  assert tables == [("ar", None), ("ddtree", 7), ("ddtree", 3)]
  for i, t in enumerate(r for r in rows if r["kind"] == "phases"):
    names = {p["phase"] for p in t["rows"]}
    assert {"verify", "accept", "commit", "step"} <= names
    assert t["mode"] == "ar" or {"draft_ctx", "draft_block", "tree"} <= names
    split = {"attention", "moe", "rest"}
    assert split <= names if i < 2 else not split & names  # the split: first two tables only
    assert all(p["ms"] > 0 for p in t["rows"] if p["phase"] != "rest"), t["rows"]
    assert all(p["bytes"] > 0 and p["floor_ms"] > 0 for p in t["rows"]
               if p["phase"] in ("verify", "attention", "moe", "step")), t["rows"]
  tput = [r for r in rows if r["kind"] == "throughput"]
  assert [(r["mode"], r["ctx"]) for r in tput] == [
      (m, c) for m in ("ar", "ddtree", "chain") for c in (32, 64)]
  per_step = {"ar": 1.0, "chain": 4.0}  # forced acceptance 3 along the chain, + the root
  for r in tput:
    assert r["ms_per_step"] > 0 and r["accepted_per_step"] == per_step.get(r["mode"],
                                                                          r["accepted_per_step"])
  assert stdout.rstrip().splitlines()[-1].startswith("results:")
  assert "==== summary" in stdout and "NOT DONE" not in stdout


@pytest.mark.slow
def test_time_box_stops_cleanly(tmp_path):
  stdout, rows = _run(tmp_path, "--time_budget_s=0.1")
  compiles = [r for r in rows if r["kind"] == "compile"]
  assert compiles and all(r["status"] == "timeout" for r in compiles)
  assert not [r for r in rows if r["kind"] == "throughput" and "ctx" in r]
  assert "NOT DONE" in stdout and "==== summary" in stdout


@pytest.mark.slow
def test_compile_only_needs_no_weights(tmp_path):
  stdout, rows = _run(tmp_path, "--compile_only")
  assert [r["kind"] for r in rows] == ["setup"] + ["compile"] * 6
  assert all(r["status"] == "ok" and r["xla_compiles"] >= 1 for r in rows[1:])
  assert "==== summary" in stdout


@pytest.mark.slow
def test_ab_loop_modes_flag_compiles_the_loop_with_command_buffers(tmp_path):
  """--ab_loop_modes=ar: ar's loop compiled again with command buffers and XLA's dump; a CPU
  compile writes no thunk dump, so the thunk row says none was found (the GPU's says which
  thunks stayed outside graphs) and the dump folder is gone."""
  stdout, rows = _run(tmp_path, "--compile_only", "--ab_loop_modes=ar")
  parts = [(r["mode"], r["part"]) for r in rows if r["kind"] == "compile"]
  assert ("ar", "loop_cmdbuf") in parts and ("ddtree", "loop_cmdbuf") not in parts
  assert all(r["status"] == "ok" for r in rows if r["kind"] == "compile")
  (thunks,) = [r for r in rows if r["kind"] == "thunks"]
  assert thunks["label"] == "ar_cmdbuf" and not thunks["found"]
  assert "thunk report ar_cmdbuf: no thunk dump" in stdout


@pytest.mark.slow
def test_loops_only_ab_times_each_loop_with_and_without_command_buffers(tmp_path):
  """configs/bench_k26_loops.py's form at tiny size (phase_modes none, both modes' loops A/B'd):
  no phase table, one throughput row per mode and ctx for each command-buffer setting, the
  A/B rows marked, the same tokens emitted per step in both (forced acceptance)."""
  _, rows = _run(tmp_path, "--config.bench.phase_modes=none", "--ab_loop_modes=ar,ddtree")
  assert not [r for r in rows if r["kind"] == "phases"]
  tput = [r for r in rows if r["kind"] == "throughput"]
  for mode in ("ar", "ddtree"):
    plain = [r for r in tput if r["mode"] == mode and not r.get("ab_variant")]
    ab = [r for r in tput if r["mode"] == mode and r.get("ab_variant")]
    assert [r["ctx"] for r in plain] == [r["ctx"] for r in ab] == [32, 64], (mode, tput)
    assert all(r["command_buffers"] for r in ab) and not any(r["command_buffers"] for r in plain)
    assert {r["emitted_per_step"] for r in plain} == {r["emitted_per_step"] for r in ab}
  assert not [r for r in tput if r["mode"] == "chain" and r.get("ab_variant")]
