"""budget='auto' tables: the width chooser vs brute force, the fitted step-cost model and its
held-out errors, finding a run config's tables, and scripts/bench_pair.py at minimal size."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax import run_config
from kdtree_jax.decoding import budget, step_cost
from kdtree_jax.draft.config import DraftConfig

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.parametrize("seed", range(5))
def test_chooser_matches_brute_force(seed):
  """choose_width = the argmax, over compiled widths, of the live rows' summed expected tokens
  over the cost table interpolated at the context, computed here by explicit loops."""
  rng = np.random.default_rng(seed)
  nodes, ctxs = (1, 3, 7, 15), (0, 1000, 5000)
  cost = rng.uniform(1.0, 10.0, size=(len(ctxs), len(nodes)))
  b = 3
  expected = 1.0 + np.cumsum(np.concatenate([np.zeros((b, 1)), rng.uniform(0, 1, (b, 15))], 1), 1)
  live = np.array([True, False, True])
  ctx = int(rng.integers(0, 5000))
  auto = budget.AutoBudget(node_counts=nodes, cost_contexts=ctxs,
                           cost_ms=tuple(map(tuple, cost)))
  best, best_rate = None, -1.0
  for j, n in enumerate(nodes):
    i = 0 if ctx < ctxs[1] else 1
    t = (ctx - ctxs[i]) / (ctxs[i + 1] - ctxs[i])
    ms = cost[i, j] + t * (cost[i + 1, j] - cost[i, j])
    tokens = sum(expected[r, n] for r in range(b) if live[r])
    if tokens / ms > best_rate:
      best, best_rate = j, tokens / ms
  idx, _, _ = budget.choose_width(auto, jnp.asarray(expected, jnp.float32), jnp.asarray(live),
                                  jnp.int32(ctx))
  assert int(idx) == best


def test_fit_cost_recovers_a_known_model():
  """Step times drawn from a known model: the fit recovers its coefficients, and every
  prediction (in-sample, without the width, without the context) is exact."""
  coef = np.array([2.0, 0.05, 0.01, 0.3, 0.2])
  widths, ctxs = (2, 4, 8, 16, 32, 64), (4096, 46000, 131072)
  w, c = np.meshgrid(widths, ctxs)
  ms = step_cost.cost_features(w.ravel(), c.ravel(), 384, 8) @ coef
  fit = step_cost.fit_cost(w.ravel(), c.ravel(), ms, 384, 8)
  np.testing.assert_allclose(fit.coef, coef, rtol=1e-6)
  errs = step_cost.prediction_errors(list(zip(w.ravel(), c.ravel(), ms)), 384, 8)
  assert len(errs) == 18
  for e in errs:
    for k in ("in_sample", "without_width", "without_ctx"):
      assert abs(e[f"{k}_error"]) < 1e-6, (k, e)


def test_held_out_error_is_measured_against_the_left_out_point():
  """One point off the model by 20%: the fit without it predicts the model's value there, so its
  held-out errors are 1 / 1.2 - 1 (the other points are exact and determine the fit)."""
  coef = np.array([1.0, 0.02, 0.01, 0.1, 0.05])
  widths, ctxs = (2, 4, 8, 16, 32, 64), (4096, 46000, 131072)
  pts = [(wi, ci, float(step_cost.cost_features([wi], [ci], 384, 8)[0] @ coef))
         for ci in ctxs for wi in widths]
  pts[7] = (pts[7][0], pts[7][1], 1.2 * pts[7][2])
  e = step_cost.prediction_errors(pts, 384, 8)[7]
  assert e["without_width_error"] == pytest.approx(1 / 1.2 - 1, abs=1e-6)
  assert e["without_ctx_error"] == pytest.approx(1 / 1.2 - 1, abs=1e-6)
  assert e["in_sample_error"] > 1 / 1.2 - 1 + 1e-3  # the fit leans toward the outlier
  few = step_cost.prediction_errors(pts[:6], 384, 8)  # one context: nothing to fit L with
  assert all(x["in_sample_error"] is None and x["without_ctx_error"] is None for x in few)


def _write_tables(stem, widths=(2, 4, 8), ctxs=(100, 1000)):
  rows = [dict(mode="ddtree", width=w, ctx=c, loop_ms=1.0 + w + c / 1000, kernel_ms=None)
          for w in widths for c in ctxs]
  with open(stem + ".step_cost.json", "w") as f:
    json.dump(dict(rows=rows, device="TestGPU"), f)
  cal = budget.AcceptCalibration((1, 3), (-1.0,), ((0.9, 0.8), (0.5, 0.4), (0.2, 0.1)))
  with open(stem + ".accept.json", "w") as f:
    json.dump(dict(calibration=cal.to_dict()), f)
  return cal


def test_auto_budget_reads_the_tables_beside_the_config(tmp_path):
  tcfg = C.tiny()
  dcfg = DraftConfig.tiny(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                          mask_token_id=tcfg.vocab_size - 1, target_layer_ids=(0, 2),
                          num_target_layers=3, block_size=4)
  cfg_path = str(tmp_path / "pair.py")
  cal = _write_tables(str(tmp_path / "pair"))
  assert step_cost.table_paths(cfg_path) == (str(tmp_path / "pair.step_cost.json"),
                                             str(tmp_path / "pair.accept.json"))
  logged = []
  auto = step_cost.auto_for_run(run_config.trained_pair(auto_tables=""), cfg_path, tcfg, dcfg,
                                log=logged.append)
  assert auto.node_counts == (1, 3, 7) and auto.cost_contexts == (100, 1000)
  assert auto.cost_ms[1][2] == pytest.approx(1.0 + 8 + 1.0)  # ctx 1000, width 8
  assert auto.calibration == cal
  assert "calibrated" in logged[0] and "TestGPU" in logged[0] and "pair.accept.json" in logged[0]
  # a table of another device kind than this run's says the choice is that device's
  here = jax.devices()[0].device_kind
  assert f"this run is on {here}: the choice is the one that is best on TestGPU" in logged[0]
  # the config field names another stem; absent files fall back, and say so
  other = run_config.trained_pair(auto_tables=str(tmp_path / "none"))
  auto = step_cost.auto_for_run(other, cfg_path, tcfg, dcfg, log=logged.append)
  assert auto.calibration == budget.AcceptCalibration() and auto.cost_source == "analytic"
  assert auto.cost_ms and "analytic" in logged[-1] and "raw draft marginals" in logged[-1]


def test_trained_pair_names_its_tables():
  assert run_config.trained_pair().auto_tables == "configs/k2tiny"
  cost_json, accept_json = step_cost.table_paths("configs/tiny.py", run_config.trained_pair())
  assert accept_json == "configs/k2tiny.accept.json" and os.path.exists(
      os.path.join(ROOT, accept_json))
  assert cost_json == "configs/k2tiny.step_cost.json"


def test_bench_pair_flags_a_step_cost_cliff():
  """step_cost.step_cliffs (bench_pair's SUSPECT lines) on the H100 rows of 2026-12-05 (trained
  pair, held-out prompts, ms/step by DDTree budget) with the Triton builder at every budget:
  budget 63's 5.921 ms after 31's 0.600 is flagged; the rows after the builder cap (63 at 0.911)
  and other modes are not."""
  row = lambda ps, b, ms: dict(prompts=ps, mode="ddtree", budget=b, ms_per_step=ms)
  before = [row("heldout", b, ms) for b, ms in
            ((1, 0.381), (3, 0.424), (7, 0.446), (15, 0.488), (31, 0.600), (63, 5.921))]
  after = [row("default", b, ms) for b, ms in ((31, 0.593), (63, 0.911))]
  lines = step_cost.step_cliffs(before + after + [dict(prompts="heldout", mode="chain",
                                                        budget=None, ms_per_step=0.1)])
  assert len(lines) == 1 and "heldout: ddtree 63" in lines[0] and "9.9x ddtree 31" in lines[0]


@pytest.mark.slow
def test_bench_pair_script(tmp_path):
  """scripts/bench_pair.py at minimal size: every run lossless; the switch chooses only table
  widths and its modelled ms per step is the table's at the widths it chose; auto runs the
  program of most modelled tok/s (here chain: the table makes it 10x cheaper) and says so."""
  _write_tables(str(tmp_path / "pair"), widths=(2, 4))
  cost = json.loads((tmp_path / "pair.step_cost.json").read_text())
  cost["rows"] += [dict(mode=m, width=w, ctx=c, loop_ms=ms, kernel_ms=None)
                   for m, w, ms in (("chain", 4, 0.3), ("ddtree_fixed", 2, 3.0),
                                    ("ddtree_fixed", 4, 4.0)) for c in (100, 1000)]
  (tmp_path / "pair.step_cost.json").write_text(json.dumps(cost))
  accept = json.loads((tmp_path / "pair.accept.json").read_text())
  accept["programs"] = dict(node_counts=[1, 3], observed=[[2, 3], [1, 2]],
                            expected=[[1.5, 2.5], [1.5, 2.5]], chain_tokens_per_step=2.0)
  (tmp_path / "pair.accept.json").write_text(json.dumps(accept))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_pair.py"), "--prompts", "1",
         "--gen", "8", "--budgets", "3", "--step_cost", str(tmp_path / "pair.step_cost.json"),
         "--accept", str(tmp_path / "pair.accept.json"), "--compile_cache_dir=",
         "--out", str(tmp_path / "pair.jsonl")]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(x) for x in (tmp_path / "pair.jsonl").read_text().splitlines()]
  assert sorted((r["prompts"], r["mode"], str(r["budget"])) for r in rows) == sorted(
      [(p, m, b) for p, b3 in (("heldout", "3"), ("default", "32")) for m, b in
       (("ar", "None"), ("chain", "None"), ("ddtree", b3), ("switch", "auto"), ("auto", "auto"))])
  assert all(r["same_tokens_as_ar"] for r in rows)
  for r in rows:
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] * 1e3 / r["ms_per_step"])
    if r["mode"] == "switch":
      assert set(map(int, r["width_histogram"])) <= {1, 3}
      assert sum(r["width_histogram"].values()) <= r["steps"]
      assert 1.0 + 2 + 0.0 <= r["modelled_ms_per_step"] <= 1.0 + 4 + 1.0
    if r["mode"] == "auto":
      chain = next(x for x in rows if (x["prompts"], x["mode"]) == (r["prompts"], "chain"))
      assert r["program"] == "chain" and r["steps"] == chain["steps"]
      assert r["modelled_tokens_per_s"] == pytest.approx(1e3 * 2.0 / 0.3)
  assert "budget auto: runs chain" in proc.stdout
  assert "best of chain, fixed and switch" in proc.stdout and "auto vs chain" in proc.stdout
