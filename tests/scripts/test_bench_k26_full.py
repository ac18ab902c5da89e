"""scripts/bench_k26_full.py end to end at tiny size on a CPU (configs/bench_tiny.py): every part
writes its JSON lines, compiles are counted, and the time box stops the run cleanly; and how its
host-gap rows and summary read a loop run as one CUDA graph (the H200 numbers of s9_k26_core)."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = "bench_k26_full_script"  # module name of the script loaded in this process


@pytest.fixture(scope="module", name="bench")
def bench_module():
  """The script as a module (its absl flags defined once per process)."""
  if SCRIPT not in sys.modules:
    spec = importlib.util.spec_from_file_location(
        SCRIPT, os.path.join(ROOT, "scripts", "bench_k26_full.py"))
    sys.modules[SCRIPT] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[SCRIPT])
  return sys.modules[SCRIPT]


def _tput(mode, budget, ms, graphs, busy, gap, suspect):
  return dict(kind="throughput", mode=mode, budget=budget, ctx=46000, ms_per_step=ms,
              accepted_per_step=2.0, tokens_per_s=2e3 / ms, kernel_us=busy, host_gap_us=gap,
              gap_suspect=suspect, gap_warning="", graphs=graphs, command_buffers=graphs,
              ab_variant=False)


STEP_NOGRAPH = [dict(phase="step", timer="cupti", ms=10.395, floor_ms=3.6, pct_roofline=35.0),
                dict(phase="step_nograph", timer="cupti", ms=10.312, floor_ms=3.6,
                     pct_roofline=35.3)]


def test_host_gap_of_a_graph_loop_under_its_kernels_is_no_error(bench):
  """s9_k26_core ddtree 15: graph loop 9.826 ms/step, the step's no-graph CUPTI kernel sum 10.312
  ms: -486 us/step, printed as what the graph saves, not IMPOSSIBLE."""
  rows = [_tput("ddtree", 15, 9.826, True, None, None, None)]
  gap = bench.host_gap_row(rows, "ddtree", 15, STEP_NOGRAPH, 46000)
  assert gap["graphs"] and gap["kernel_ms"] == 10.312
  assert abs(gap["host_gap_us"] + 486.0) < 1e-6
  assert "IMPOSSIBLE" not in gap["warning"] and "no host gap visible" in gap["warning"]


def test_host_gap_of_a_host_launched_loop_under_its_kernels_stays_impossible(bench):
  rows = [_tput("ddtree", 15, 9.826, False, None, None, None)]
  gap = bench.host_gap_row(rows, "ddtree", 15, STEP_NOGRAPH, 46000)
  assert not gap["graphs"] and gap["warning"].startswith("IMPOSSIBLE")


def test_summary_prints_no_trace_gap_for_a_graph_loop(bench):
  """The graph row's busy / gap columns read n/a (graph), without the trace's numbers or SUSPECT
  (s9: busy 1283.5, gap 8542.6 SUSPECT from an op-by-op trace); a host-launched row keeps them."""
  rows = [_tput("ddtree", 15, 9.826, True, 1283.5, None, None),
          _tput("ar", None, 9.044, False, 8400.0, 644.0, False),
          dict(_tput("ddtree", 15, 10.2, True, None, None, None), ab_variant=True,
               variant="_opts"),
          dict(bench.host_gap_row([_tput("ddtree", 15, 9.826, True, None, None, None)],
                                  "ddtree", 15, STEP_NOGRAPH, 46000), kind="host_gap")]
  text = bench.summary(rows)
  (graph,) = [x for x in text.splitlines() if x.strip().startswith("46000 ddtree   15")]
  assert graph.count("n/a (graph)") == 2 and "1283.5" not in graph and "SUSPECT" not in graph
  (plain,) = [x for x in text.splitlines() if x.strip().startswith("46000     ar")]
  assert "8400.0" in plain and "644.0" in plain and "n/a" not in plain
  (opts,) = [x for x in text.splitlines() if x.strip().startswith("46000 ddtree_opts")]
  assert "10.200" in opts and opts.count("n/a (graph)") == 2  # an --ab_loop_options row
  (host,) = [x for x in text.splitlines() if x.strip().startswith("ddtree   15   46000")]
  assert "-486.0" in host and "no host gap visible" in host and "IMPOSSIBLE" not in text


def _launch(out_dir, *args, timeout=600):
  """The script at tiny size on the CPU, no compilation cache: the finished process."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_k26_full.py"), "--config",
         os.path.join(ROOT, "configs", "bench_tiny.py"), "--out_dir", str(out_dir),
         "--compile_cache_dir=", *args]
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _run(out_dir, *args, timeout=600):
  proc = _launch(out_dir, *args, timeout=timeout)
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
  setup = rows[0]  # the configs that ran, in full: a later default change leaves them readable
  assert setup["kind"] == "setup"
  assert setup["target"]["num_hidden_layers"] == setup["layers"]
  assert "align_expert_rows_from" in setup["target"] and setup["draft"]["block_size"] > 1
  assert setup["bench"]["ctxs"] and setup["bench"]["gen"] > 0


@pytest.mark.slow
def test_compile_only_needs_no_weights(tmp_path):
  stdout, rows = _run(tmp_path, "--compile_only")
  assert [r["kind"] for r in rows] == ["setup"] + ["compile"] * 6
  assert all(r["status"] == "ok" and r["xla_compiles"] >= 1 for r in rows[1:])
  assert "==== summary" in stdout


@pytest.mark.slow
def test_ab_loop_modes_flag_compiles_the_loop_with_command_buffers(tmp_path):
  """--ab_loop_modes=ar in a run without command buffers (on by default): ar's loop compiled
  again with them and XLA's dump; a CPU compile writes no thunk dump, so the thunk row says none
  was found (the GPU's says which thunks stayed outside graphs) and the dump folder is gone."""
  stdout, rows = _run(tmp_path, "--compile_only", "--ab_loop_modes=ar", "--nocommand_buffers")
  parts = [(r["mode"], r["part"]) for r in rows if r["kind"] == "compile"]
  assert ("ar", "loop_cmdbuf") in parts and ("ddtree", "loop_cmdbuf") not in parts
  assert all(r["status"] == "ok" for r in rows if r["kind"] == "compile")
  (thunks,) = [r for r in rows if r["kind"] == "thunks"]
  assert thunks["label"] == "ar_cmdbuf" and not thunks["found"]
  assert "thunk report ar_cmdbuf: no thunk dump" in stdout


def test_parse_options_types_values_for_compiler_options(bench):
  assert bench.parse_options("xla_gpu_enable_pdl=false, xla_gpu_graph_min_graph_size=1,"
                             "xla_gpu_command_buffer_scheduling_mode=CONCURRENT") == {
      "xla_gpu_enable_pdl": False, "xla_gpu_graph_min_graph_size": 1,
      "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
  assert bench.parse_options("") == {}


@pytest.mark.slow
def test_ab_loop_options_compile_the_loop_again_with_those_options(tmp_path):
  """--ab_loop_options: the A/B loop keeps the run's command-buffer setting and adds the options
  (`loop_opts`, e.g. PDL off: the GPU A/B of why a graph loop beats its no-graph kernels)."""
  stdout, rows = _run(tmp_path, "--compile_only", "--ab_loop_modes=ar",
                      "--ab_loop_options=xla_gpu_enable_pdl=false")
  parts = [(r["mode"], r["part"]) for r in rows if r["kind"] == "compile"]
  assert ("ar", "loop_opts") in parts and ("ddtree", "loop_opts") not in parts
  assert not [p for p in parts if p[1] in ("loop_cmdbuf", "loop_nograph")]
  assert all(r["status"] == "ok" for r in rows if r["kind"] == "compile")
  assert not [r for r in rows if r["kind"] == "thunks"] and "==== summary" in stdout


def test_unknown_ab_loop_option_stops_the_run_before_loading(tmp_path):
  """A field XLA does not parse (jax 0.11.2 has no 'xla_gpu_enable_split_k_autotuning') is a
  usage error naming it, before the weights load and no JSON line is written."""
  proc = _launch(tmp_path, "--ab_loop_modes=ar",
                 "--ab_loop_options=xla_gpu_enable_split_k_autotuning=false", timeout=300)
  assert proc.returncode != 0
  assert "No such compile option: 'xla_gpu_enable_split_k_autotuning'" in proc.stderr
  assert not (tmp_path / "bench_k26_full.jsonl").exists()


@pytest.mark.slow
def test_ab_loop_bench_times_a_second_spec_in_the_same_process(tmp_path):
  """--ab_loop_bench=tree_impl=xla: ddtree's loop lowered again from the overridden spec
  (`loop_spec`, the run's compiler options) and timed beside the default, rows marked `_spec`."""
  stdout, rows = _run(tmp_path, "--config.bench.phase_modes=none", "--ab_loop_modes=ddtree",
                      "--ab_loop_bench=tree_impl=xla")
  parts = [r["part"] for r in rows if r["kind"] == "compile" and r["mode"] == "ddtree"]
  assert parts == ["prefill", "loop", "loop_spec"]
  tput = [r for r in rows if r["kind"] == "throughput" and r["mode"] == "ddtree"]
  assert [(r["ctx"], r["variant"]) for r in tput] == [(32, ""), (64, ""), (32, "_spec"),
                                                      (64, "_spec")]
  assert len({r["command_buffers"] for r in tput}) == 1
  paired = [r for r in rows if r["kind"] == "paired_ab"]  # the interleaved decision row
  assert [(r["mode"], r["variant"], r["ctx"]) for r in paired] == [("ddtree", "_spec", 64)]
  rounds = paired[0]["rounds"]
  base, variant = paired[0]["base_slopes_ms"], paired[0]["variant_slopes_ms"]
  assert len(base) == len(variant) == rounds == 8
  # No timing asserted (a host stall inside a round's short chunk reads as a negative slope on
  # a CPU, where the tiny loop's step is < 1 ms): the row is the summary of its own rounds.
  assert all(np.isfinite(base + variant))
  assert paired[0]["variant_faster"] == sum(v < b for b, v in zip(base, variant))
  assert paired[0]["base_ms"] == pytest.approx(float(np.median(base)))
  summary = stdout[stdout.index("==== summary"):]
  assert "paired A/B (interleaved rounds" in summary
  assert f"_spec faster in {paired[0]['variant_faster']} of 8 rounds" in summary


@pytest.mark.slow
def test_ab_loop_bench_target_field_compiles_the_loop_on_the_same_params(tmp_path):
  """--ab_loop_bench=target.lean_glue=false: ar's loop lowered again with that target config
  (run-time field: the same params) and timed beside the default, the same tokens per step."""
  _, rows = _run(tmp_path, "--config.bench.phase_modes=none", "--ab_loop_modes=ar",
                 "--ab_loop_bench=target.lean_glue=false")
  assert [r["part"] for r in rows if r["kind"] == "compile" and r["mode"] == "ar"] == [
      "prefill", "loop", "loop_spec"]
  tput = [r for r in rows if r["kind"] == "throughput" and r["mode"] == "ar"]
  assert [r["variant"] for r in tput] == ["", "", "_spec", "_spec"]
  assert {r["emitted_per_step"] for r in tput} == {1.0}
  paired = [r for r in rows if r["kind"] == "paired_ab"]  # each loop on its own config
  assert [(r["mode"], r["variant"], r["rounds"]) for r in paired] == [("ar", "_spec", 8)]


def test_ab_loop_bench_takes_only_keys_that_leave_the_state_and_params_alone(bench):
  assert bench.ab_overrides("tree_impl=xla, target.mosaic_pdl=true") == (
      {"tree_impl": "xla"}, ["mosaic_pdl=true"])
  assert bench.ab_overrides("target.router_impl=xla,target.align_expert_rows_from=16") == (
      {}, ["router_impl=xla", "align_expert_rows_from=16"])
  for bad in ("budget=31", "target.fold_norm_weights=true", "mosaic_pdl=true"):
    with pytest.raises(ValueError, match="cannot share"):
      bench.ab_overrides(bad)


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
    # the A/B loop has the other command-buffer setting than the run's default
    assert len({r["command_buffers"] for r in plain}) == 1
    assert {r["command_buffers"] for r in ab} == {not r["command_buffers"] for r in plain}
    assert {r["emitted_per_step"] for r in plain} == {r["emitted_per_step"] for r in ab}
  assert not [r for r in tput if r["mode"] == "chain" and r.get("ab_variant")]


def test_paired_row_names_its_stalled_rounds(bench):
  from kdtree_jax import throughput
  row = dict(mode="ddtree", budget=15, ctx=46000, variant="_spec",
             **throughput.paired_summary([10.6, 6.0, 6.1, 6.2], [5.0, 6.1, 6.2, 6.3]))
  line = bench.format_paired(row)
  assert "_spec faster in 1 of 4 rounds; 1 stalled" in line
  assert "stalled" not in bench.format_paired(dict(row, stalled=0))
