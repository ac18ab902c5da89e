"""budget='auto': the prefix claim, the cost models, the acceptance calibration, losslessness."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax import tree as ddtree
from kdtree_jax.decoding import auto_program, budget, step, step_cost
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.draft.config import DraftConfig

from test_decoding import make_pair, oracle_draft, run  # its neighbour (pytest imports by folder)

BLOCK = 6


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_prefix_of_the_largest_tree_is_the_best_smaller_tree(seed):
  """DDTree pops best-first, so its first n nodes ARE build_ddtree(logits, n), node for node."""
  logits = 3.0 * jax.random.normal(jax.random.key(seed), (7, 40))
  big = ddtree.build_ddtree(logits, 63)
  for n in (1, 7, 15, 31):
    small = ddtree.build_ddtree(logits, n)
    np.testing.assert_array_equal(big[0][:n], small[0])  # tokens
    np.testing.assert_array_equal(big[1][:n], small[1])  # depths
    np.testing.assert_array_equal(big[2][:n + 1], small[2])  # parents
    np.testing.assert_array_equal(big[3][:n + 1, :n + 1], small[3])  # visibility


def test_node_logq_is_the_path_product_of_marginals():
  logits = jax.random.normal(jax.random.key(0), (5, 12))
  tokens, depths, parents, vis = ddtree.build_ddtree(logits, 20)
  logq = budget.node_logq(logits, tokens, depths, vis)
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float64 if jax.config.x64_enabled
                                                     else jnp.float32), axis=-1), np.float64)
  par, tok, dep = np.asarray(parents), np.asarray(tokens), np.asarray(depths)
  for i in range(20):
    want, k = 0.0, i + 1
    while k > 0:
      want += logp[dep[k - 1] - 1, tok[k - 1]]
      k = par[k]
    assert abs(float(logq[i]) - want) < 1e-5 * max(1.0, abs(want))


def _k26_pair():
  t = C.kimi_k2_6()
  d = DraftConfig.tiny(hidden_size=t.hidden_size, num_hidden_layers=3, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                       vocab_size=t.vocab_size, mask_token_id=t.vocab_size - 1,
                       num_target_layers=61, target_layer_ids=(0, 30, 60), block_size=16,
                       layer_types=("full_attention",) * 3)
  return t, d


def test_analytic_cost_reproduces_the_worked_k26_table():
  """research/moe_spec_economics.md (hand-computed, 8 x H200, INT4 experts, 46k): 4.2 / 7.1 /
  9.7 / 14.2 / 20.7 ms at T = 1 (ar) / 9 / 17 / 33 / 65; rounding to 0.1 ms -> 0.05 ms, and the
  table's draft is 0.66 GB where this draft shape reads 0.73 GB (+0.02 ms)."""
  t, d = _k26_pair()
  model = step_cost.AnalyticCost(t, d, step_cost.MeshShare(gpus=8, expert_bits=4.5,
                                                           collectives=True))
  assert abs(model.mode_ms("ar", 46000) - 4.2) < 0.05
  for n, want in ((9, 7.1), (17, 9.7), (33, 14.2), (65, 20.7)):
    assert abs(model.ms(n, 46000) - want) < 0.07, (n, model.ms(n, 46000))
  assert model.ms(65, 131072) > model.ms(65, 46000) > model.ms(65, 4096)


def test_experts_touched_matches_sampling():
  """E(1 - (1 - 1/E)^(KT)) vs distinct experts of KT uniform draws (the formula's assumption)."""
  rng = np.random.default_rng(0)
  for t in (1, 9, 33, 65):
    sims = [len(np.unique(rng.integers(0, 384, 8 * t))) for _ in range(400)]
    sd = np.std(sims) / np.sqrt(len(sims))
    assert abs(np.mean(sims) - step_cost.experts_touched(384, 8, t)) < 4 * sd + 0.05


def test_calibrated_cost_interpolates_and_refuses_extrapolation(tmp_path):
  rows = [dict(mode="ddtree", width=w, ctx=c, loop_ms=float(w + c / 1000), kernel_ms=None)
          for w in (8, 16, 32) for c in (1000, 3000)]
  rows += [dict(mode="ar", width=1, ctx=c, loop_ms=1.0 + c / 1000, kernel_ms=None)
           for c in (1000, 3000)]
  path = tmp_path / "x.step_cost.json"
  path.write_text(json.dumps(dict(rows=rows)))
  cost = step_cost.load_calibration(str(path))
  assert cost.ms(16, 1000) == pytest.approx(17.0)
  assert cost.ms(24, 2000) == pytest.approx(26.0)  # linear in width and context
  assert cost.ms(8, 5000) == pytest.approx(13.0)  # linear beyond the context grid
  assert cost.mode_ms("ar", 2000) == pytest.approx(3.0)
  with pytest.raises(ValueError, match="outside the calibrated widths"):
    cost.ms(64, 1000)
  with pytest.raises(ValueError, match="kernel_ms"):
    step_cost.load_calibration(str(path), key="kernel_ms")
  assert step_cost.calibration_path("configs/a.py") == "configs/a.step_cost.json"


def test_chooser_prefers_tokens_per_ms():
  auto = budget.AutoBudget(node_counts=(1, 3), cost_contexts=(0,), cost_ms=((1.0, 2.0),))
  expected = jnp.array([[1.0, 1.5, 2.0, 2.5]])  # E[n nodes], n = 0..3
  live = jnp.array([True])
  assert int(budget.choose_width(auto, expected, live, jnp.int32(0))[0]) == 0  # 1.5/1 > 2.5/2
  expected = jnp.array([[1.0, 1.5, 2.5, 3.5]])
  assert int(budget.choose_width(auto, expected, live, jnp.int32(0))[0]) == 1  # 3.5/2 > 1.5/1


def test_calibration_fit_recovers_known_rates():
  """Nodes accepted with a known probability per (width slot, q bin); the fit recovers it within
  4 binomial standard errors, and empty cells fall back to the draft's q."""
  rng = np.random.default_rng(1)
  s, n = 4000, 15
  logq = np.log(rng.choice([0.05, 0.5], size=(s, n)))
  truth = np.where(np.arange(n)[None] < 7, 0.8, 0.3) * (np.exp(logq) > 0.1) + 0.02
  acc = rng.uniform(size=(s, n)) < truth
  cal = budget.fit_calibration(logq, np.ones((s, n), int), acc, bounds=(7,), edges=(-1.0,))
  for slot, width, high in ((0, 7, 0.82), (1, 8, 0.32)):
    for b, want in ((0, 0.02), (1, high)):
      se = np.sqrt(want * (1 - want) / (s * width / 2))
      assert abs(cal.rate[slot][b] - want) < 4 * se + 1e-3, (slot, b, cal.rate[slot][b], want)
  assert budget.AcceptCalibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal
  empty = budget.AcceptCalibration((7,), (-1.0,), ((-1.0, 0.5), (0.2, 0.3)))
  p = empty.node_prob(jnp.log(jnp.full((1, 8), 0.05)))
  np.testing.assert_allclose(np.asarray(p[0, :2]), [0.05, 0.05], rtol=1e-6)  # slot 0, bin 0
  np.testing.assert_allclose(np.asarray(p[0, 7]), 0.2, rtol=1e-6)


@pytest.mark.slow
def test_calibrated_acceptance_is_honest_on_held_out_prompts():
  """The trained pair (k2tiny, f32, greedy), DDTree order verified at 63 nodes, 96 tokens per
  prompt: calibrate on 8 held-out windows, test on 6 others. For every compiled width n, per step
  d = observed - expected tokens of the first n nodes. Tolerance, from the data: |mean d| <= 3
  standard errors, sd(d) / sqrt(steps) (a 3-sigma test of zero bias; steps taken as
  independent). The band must be under 15% of the observed mean (else the test has no power),
  and DDTree's raw surrogate (uncalibrated q) must fail it (the test can fail)."""
  from kdtree_jax import data, run_config  # pylint: disable=import-outside-toplevel
  from kdtree_jax.decoding import accept_trace  # pylint: disable=import-outside-toplevel
  from kdtree_jax.loader import load_pair  # pylint: disable=import-outside-toplevel
  pair, _ = load_pair(run_config.trained_pair())
  held = data.build_corpus().eval
  starts = np.linspace(0, len(held) - 193, 14).astype(int)
  prompts = [list(map(int, held[s0:s0 + 192])) for s0 in starts]
  spec = SpecConfig(mode="ddtree", budget=63, block_size=pair.dcfg.block_size, max_new_tokens=96)
  collect = lambda ps: accept_trace.collect(pair, spec, ps, 512)
  fit_recs, test_recs = collect(prompts[0::2][:8] + prompts[1::2][6:]), collect(prompts[1::2][:6])
  cal = accept_trace.fit(fit_recs, (7, 15, 31, 63))
  raw_fails = 0
  for n in (7, 15, 31, 63):
    obs = accept_trace.prefix_accept(test_recs, n)
    for c in (cal, budget.AcceptCalibration()):
      d = obs - accept_trace.prefix_expected(test_recs, n, c)
      band = 3 * d.std() / np.sqrt(len(d))
      assert band < 0.15 * obs.mean(), (n, band, obs.mean())
      if c is cal:
        assert abs(d.mean()) <= band, (n, d.mean(), band)
      else:
        raw_fails += abs(d.mean()) > band
  assert raw_fails == 4


@pytest.mark.parametrize("nodes,cost", [((3, 7, 15), None), ((3, 7, 15), ((1.0, 5.0, 50.0),)),
                                        ((2, 5), ((9.0, 1.0),))])
@pytest.mark.slow
def test_auto_is_lossless_f32(nodes, cost):
  """Same tokens as greedy ar whichever widths the chooser picks (f32)."""
  pair = make_pair(4)
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  auto = budget.AutoBudget(node_counts=nodes, cost_contexts=(0,) if cost else (),
                           cost_ms=cost or ())
  ar = run(pair, SpecConfig(mode="ar", max_new_tokens=20, block_size=BLOCK), prompts, 64)
  au = run(pair, SpecConfig(mode="ddtree", budget="auto", max_new_tokens=20, block_size=BLOCK,
                            auto=auto), prompts, 64)
  assert au.tokens == ar.tokens
  assert len(au.widths_per_step) == au.steps and set(au.widths_per_step) <= set(nodes)
  if cost == ((1.0, 5.0, 50.0),):  # the largest width costs 50x: never worth it here
    assert 15 not in au.widths_per_step


@pytest.mark.slow
def test_auto_is_lossless_when_the_width_changes_between_steps(monkeypatch):
  """An oracle draft (right token favoured, 25% confident misses) makes the expected acceptance
  vary per step, so the chooser switches widths mid-sequence; tokens stay those of ar (f32)."""
  pair = make_pair(0)
  prompts = [[5, 9, 1, 3], [4, 5, 6, 7, 8, 2, 9]]
  ar = run(pair, SpecConfig(mode="ar", max_new_tokens=40, block_size=BLOCK), prompts, 96)
  ref = np.zeros((2, 40 + 2 * BLOCK), np.int32)
  for i, t in enumerate(ar.tokens):
    ref[i, :len(t)] = t
  jax.clear_caches()
  monkeypatch.setattr(step, "draft_phase", oracle_draft(ref, miss_rate=0.25))
  auto = budget.AutoBudget(node_counts=(1, 3, 7, 15), cost_contexts=(0,),
                           cost_ms=((1.0, 1.5, 2.5, 4.5),))
  au = run(pair, SpecConfig(mode="ddtree", budget="auto", max_new_tokens=40, block_size=BLOCK,
                            auto=auto), prompts, 96)
  assert au.tokens == ar.tokens
  assert len(set(au.widths_per_step)) >= 2, au.widths_per_step
  jax.clear_caches()


def test_budget_auto_validation():
  with pytest.raises(ValueError, match="needs mode 'ddtree'"):
    SpecConfig(mode="chain", budget="auto")
  with pytest.raises(ValueError, match="not a budget"):
    SpecConfig(mode="ddtree", budget="big")
  assert SpecConfig(budget="auto").verify_width == 64
  assert SpecConfig(budget="auto", auto=budget.AutoBudget(node_counts=(7, 15))).verify_width == 16


@pytest.mark.slow
def test_calibrate_step_cost_script(tmp_path):
  """scripts/calibrate_step_cost.py on the tiny bench pair: a row per (context, width) and mode,
  router-counted experts that never shrink as the prefix grows (a verify's node sees only its
  ancestors, so a longer prefix routes the shorter one's tokens the same way), and a JSON that
  load_calibration turns into the same numbers."""
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, os.path.join(root, "scripts", "calibrate_step_cost.py"),
         "--config", os.path.join(root, "configs", "bench_tiny.py"), "--nodes", "3,7,15",
         "--ctx", "64,96,128", "--modes", "ar", "--steps", "2,4", "--small",
         "--compile_cache_dir=", "--out_dir", str(tmp_path)]
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  raw = json.loads((tmp_path / "step_cost.json").read_text())
  rows = raw["rows"]
  got = sorted((r["mode"], r["width"], r["ctx"]) for r in rows)
  assert got == sorted([(m, w, c) for m in ("ddtree", "ddtree_fixed") for w in (4, 8, 16)
                        for c in (64, 96, 128)] + [("ar", 1, c) for c in (64, 96, 128)])
  held = raw["held_out_contexts"]
  assert sorted((k["mode"], k["width"], k["ctx"]) for k in held) == sorted(
      [(m, w, 96) for m in ("ddtree", "ddtree_fixed") for w in (4, 8, 16)] + [("ar", 1, 96)])
  for k in held:
    assert k["error"] == pytest.approx(k["predicted_ms"] / k["measured_ms"] - 1)
  assert all(r["loop_ms"] > 0 and r["analytic_ms"] > 0 for r in rows)
  counted = [r["experts_touched_per_layer"] for r in rows if r["mode"] == "ddtree"
             and r["ctx"] == 64]
  e = C.tiny().n_routed_experts
  assert all(len(c) == C.tiny().num_moe_layers for c in counted)
  assert np.all(np.diff(np.array(counted), axis=0) >= 0) and np.max(counted) <= e
  cost = step_cost.load_calibration(str(tmp_path / "step_cost.json"))
  by = {(r["mode"], r["width"], r["ctx"]): r["loop_ms"] for r in rows}
  assert cost.ms(8, 128) == pytest.approx(by[("ddtree", 8, 128)])
  assert cost.mode_ms("ar", 64) == pytest.approx(by[("ar", 1, 64)])
  fixed = auto_program.program_costs(rows).fixed_ms  # auto's whole-program candidates
  assert sorted(fixed) == [3, 7, 15] and fixed[7][2] == pytest.approx(by[("ddtree_fixed", 8, 128)])


@pytest.mark.slow
def test_eval_budget_script(tmp_path):
  """scripts/eval_budget.py at minimal size: every run lossless, the simulated rows charge the
  K2.6 cost model per step, the measured rows use the pair's own (here synthetic) table."""
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
  table = [dict(mode="ddtree", width=w, ctx=c, loop_ms=1.0 + w, kernel_ms=None)
           for w in (2, 4) for c in (100, 1000)]
  table += [dict(mode=m, width=w, ctx=c, loop_ms=1.0, kernel_ms=None)
            for m, w in (("ar", 1), ("chain", 16)) for c in (100, 1000)]
  (tmp_path / "pair.json").write_text(json.dumps(dict(rows=table)))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, os.path.join(root, "scripts", "eval_budget.py"), "--prompts", "1",
         "--fit_prompts", "1", "--gen", "16", "--ctx", "46000", "--nodes", "1,3", "--budgets",
         "3", "--measure_cost", str(tmp_path / "pair.json"), "--compile_cache_dir=",
         "--out_dir", str(tmp_path)]
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(x) for x in (tmp_path / "budget_eval.jsonl").read_text().splitlines()]
  sim = [r for r in rows if "simulated_tokens_per_s" in r]
  assert sorted((r["cost_model"], r["mode"]) for r in sim) == sorted(
      (m, x) for m in ("1gpu", "8gpu") for x in ("ar", "chain", "ddtree", "auto", "auto_program"))
  assert all(r["same_tokens_as_ar"] and r["label"].startswith("SIMULATED") for r in sim)
  models = step_cost.k26_models()
  for r in sim:
    if r["mode"] == "ddtree":
      assert r["modelled_ms_per_step"] == pytest.approx(models[r["cost_model"]].ms(4, 46000))
    assert r["simulated_tokens_per_s"] == pytest.approx(
        1e3 * r["tokens"] / (r["modelled_ms_per_step"] * r["steps"]))
    if r["mode"] == "auto":
      assert sum(r["width_histogram"].values()) == r["steps"]
      assert set(map(int, r["width_histogram"])) <= {1, 3}
  for r in (r for r in sim if r["mode"] == "auto_program"):  # decode's whole-program choice
    same = [x for x in sim if x["cost_model"] == r["cost_model"] and x["mode"] != "auto_program"]
    fixed = r["program"].startswith("ddtree ")
    named = ("ddtree", int(r["program"].split()[-1])) if fixed else {
        "chain": ("chain", None), "switch": ("auto", 3)}[r["program"]]
    src = next(x for x in same if (x["mode"], x["budget"]) == named)
    assert r["simulated_tokens_per_s"] == src["simulated_tokens_per_s"], (r["program"], src)
  assert len([r for r in rows if r.get("kind") == "summary"]) == 2
  assert [r["nodes"] for r in rows if r.get("kind") == "calibration"] == [1, 3]
  meas = {r["mode"]: r for r in rows if r.get("kind") == "measured"}
  assert set(meas) == {"ar", "chain", "ddtree", "auto"} and meas["auto"]["same_tokens_as_ar"]
  assert meas["auto"]["modelled_ms_per_step"] >= 3.0  # every width costs 1 + (n + 1) ms here
