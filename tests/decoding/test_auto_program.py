"""budget='auto' as a choice among whole programs (decoding/auto_program.py): the best candidate
vs brute force on random tables, the switch replay vs the on-device chooser, reading the
calibrate rows, the spec of each candidate, and each candidate auto can pick lossless (f32)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.decoding import auto_program, budget
from kdtree_jax.decoding.spec_config import SpecConfig

from test_decoding import make_pair, run  # its neighbour (pytest imports by folder)

BLOCK = 6
NODES = (1, 3, 7, 15)
CTXS = (100, 1000, 5000)


def _random_tables(rng, steps=40):
  """Calibrate-style rows (chain, fixed widths, switch branches at every context) and a
  Replay whose observed tokens grow with the prefix (like real records)."""
  rows = [dict(mode="chain", width=BLOCK, ctx=c, loop_ms=float(rng.uniform(0.3, 3))) for c in CTXS]
  for mode in ("ddtree_fixed", "ddtree"):
    rows += [dict(mode=mode, width=n + 1, ctx=c, loop_ms=float(rng.uniform(0.3, 3)))
             for n in NODES for c in CTXS]
  obs = 1 + np.cumsum(rng.integers(0, 3, size=(steps, len(NODES))), axis=1)
  exp = obs + rng.normal(0, 0.5, size=obs.shape)
  replay = auto_program.Replay(NODES, tuple(map(tuple, obs.astype(float))),
                               tuple(map(tuple, exp)), float(rng.uniform(1, 5)))
  return rows, replay


def _brute_force(rows, replay, ctx):
  """{name: tok/s} by explicit loops: each program's ms linear in context between the rows."""
  def ms(mode, width):
    pts = sorted((r["ctx"], r["loop_ms"]) for r in rows if (r["mode"], r["width"]) == (mode, width))
    return float(np.interp(ctx, [p[0] for p in pts], [p[1] for p in pts]))

  out = {"chain": 1e3 * replay.chain_tokens_per_step / ms("chain", BLOCK)}
  for j, n in enumerate(NODES):
    col = [replay.observed[s][j] for s in range(len(replay.observed))]
    out[f"ddtree {n}"] = 1e3 * (sum(col) / len(col)) / ms("ddtree_fixed", n + 1)
  tokens = total_ms = 0.0
  for s in range(len(replay.observed)):
    best_j, best_rate = 0, -1.0
    for j, n in enumerate(NODES):
      rate = replay.expected[s][j] / ms("ddtree", n + 1)
      if rate > best_rate:
        best_j, best_rate = j, rate
    tokens += replay.observed[s][best_j]
    total_ms += ms("ddtree", NODES[best_j] + 1)
  out["switch"] = 1e3 * tokens / total_ms
  return out


@pytest.mark.parametrize("seed", range(8))
def test_best_candidate_matches_brute_force(seed):
  rng = np.random.default_rng(seed)
  rows, replay = _random_tables(rng)
  for ctx in (100, 640, 5000):
    want = _brute_force(rows, replay, ctx)
    cands = auto_program.candidates(auto_program.program_costs(rows), replay, ctx)
    assert {c["name"]: c["tokens_per_s"] for c in cands} == pytest.approx(want, rel=1e-9)
    assert auto_program.best(cands)["name"] == max(want, key=want.get)


@pytest.mark.parametrize("seed", range(4))
def test_switch_replay_picks_what_the_device_chooser_picks(seed):
  """The replay's per-step width = budget.choose_width's (batch 1) on the same expectations."""
  rng = np.random.default_rng(seed)
  _, replay = _random_tables(rng, steps=12)
  ms = rng.uniform(0.5, 2.0, len(NODES))
  auto = budget.AutoBudget(node_counts=NODES, cost_contexts=(0,), cost_ms=(tuple(ms),))
  picks = []
  for s in range(12):
    row = np.zeros(NODES[-1] + 1)
    row[list(NODES)] = replay.expected[s]
    idx, _, _ = budget.choose_width(auto, jnp.asarray(row[None], jnp.float32),
                                    jnp.array([True]), jnp.int32(0))
    picks.append(NODES[int(idx)])
  one = lambda s: auto_program.Replay(NODES, replay.observed[s:s + 1], replay.expected[s:s + 1], 1)
  got = [next(iter(auto_program.switch_replay(one(s), ms)[2])) for s in range(12)]
  assert got == picks


def test_program_costs_reads_the_calibrate_rows():
  rows = [dict(mode="chain", width=6, ctx=c, loop_ms=0.4 + c) for c in (1, 2)]
  rows += [dict(mode="ar", width=1, ctx=c, loop_ms=0.2) for c in (1, 2)]
  rows += [dict(mode="ddtree_fixed", width=8, ctx=c, loop_ms=0.6 * c) for c in (1, 2)]
  rows += [dict(mode="ddtree", width=w, ctx=c, loop_ms=w + c) for w in (2, 8) for c in (1, 2)]
  rows += [dict(mode="ddtree_fixed", width=16, ctx=1, loop_ms=9.0)]  # one context only: left out
  costs = auto_program.program_costs(rows)
  assert costs.contexts == (1, 2) and costs.chain_ms == (1.4, 2.4)
  assert costs.fixed_ms == {7: (0.6, 1.2)}
  assert costs.switch_ms == {1: (3.0, 4.0), 7: (9.0, 10.0)}


def _write(tmp_path, chain_ms, fixed_ms, switch_ms, replay):
  rows = [dict(mode="chain", width=BLOCK, ctx=c, loop_ms=chain_ms) for c in CTXS]
  rows += [dict(mode="ddtree_fixed", width=n + 1, ctx=c, loop_ms=fixed_ms[j])
           for j, n in enumerate(NODES) for c in CTXS]
  rows += [dict(mode="ddtree", width=n + 1, ctx=c, loop_ms=switch_ms[j])
           for j, n in enumerate(NODES) for c in CTXS]
  (tmp_path / "p.step_cost.json").write_text(json.dumps(dict(rows=rows)))
  (tmp_path / "p.accept.json").write_text(json.dumps(dict(programs=replay.to_dict())))
  return str(tmp_path / "p.step_cost.json"), str(tmp_path / "p.accept.json")


# Half the steps accept everything a wide tree offers, half only the root: a per-step choice
# (wide on the first kind, 1 node on the second) beats every fixed width when the wide verify
# costs much more.
_MIXED = auto_program.Replay(NODES, ((2, 5, 12, 30),) * 5 + ((1, 1, 1, 1),) * 5,
                             ((2, 5, 12, 30),) * 5 + ((1, 1, 1, 1),) * 5, 2.0)


@pytest.mark.parametrize("chain_ms,fixed,switch,want", [
    (0.3, (1, 1.5, 2.5, 4.5), (1.2, 1.7, 2.7, 4.7), "chain"),  # the H200 case: chain is cheap
    (9.0, (1, 1.2, 1.4, 1.6), (1.6, 1.8, 2.0, 2.2), "ddtree 15"),  # wide is nearly free
    (9.0, (1, 2.0, 4.0, 8.0), (1.05, 2.1, 4.2, 8.4), "switch"),  # widths' costs differ enough
])
def test_choose_for_tables_runs_the_best_program(tmp_path, chain_ms, fixed, switch, want):
  cost_json, accept_json = _write(tmp_path, chain_ms, fixed, switch, _MIXED)
  spec = SpecConfig(mode="ddtree", budget="auto", block_size=BLOCK,
                    auto=budget.AutoBudget(node_counts=NODES))
  out, line, choice = auto_program.choose_for_tables(spec, cost_json, accept_json, 500)
  assert choice["name"] == want and line.startswith(f"budget auto: runs {want} at ctx 500")
  assert "MEASURED" in line and "others:" in line
  expect = {"chain": SpecConfig(mode="chain", block_size=BLOCK),
            "ddtree 15": SpecConfig(mode="ddtree", budget=15, block_size=BLOCK),
            "switch": spec}[want]
  assert out == expect


def test_without_a_programs_table_auto_keeps_the_switch(tmp_path):
  spec = SpecConfig(mode="ddtree", budget="auto", block_size=BLOCK)
  (tmp_path / "old.accept.json").write_text(json.dumps(dict(calibration={})))
  out, line, choice = auto_program.choose_for_tables(spec, str(tmp_path / "none.json"),
                                                     str(tmp_path / "old.accept.json"), 10)
  assert out is spec and choice is None and "per-step switch" in line
  fixed = SpecConfig(mode="ddtree", budget=7, block_size=BLOCK)
  assert auto_program.for_run(fixed, None, "configs/x.py", 5, log=None) is fixed


@pytest.mark.parametrize("choice", [dict(name="chain", nodes=None), dict(name="ddtree 3", nodes=3),
                                    dict(name="ddtree 15", nodes=15),
                                    dict(name="switch", nodes=None)])
def test_every_program_auto_can_pick_is_lossless_f32(choice):
  """Same tokens as greedy ar for the spec of each candidate (f32)."""
  pair = make_pair(4)
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  auto = budget.AutoBudget(node_counts=(1, 3, 15), cost_contexts=(0,), cost_ms=((1., 1.2, 3.),))
  switch = SpecConfig(mode="ddtree", budget="auto", max_new_tokens=20, block_size=BLOCK,
                      auto=auto)
  spec = auto_program.spec_for(switch, choice)
  assert spec.mode == ("chain" if choice["name"] == "chain" else "ddtree")
  ar = run(pair, SpecConfig(mode="ar", max_new_tokens=20, block_size=BLOCK), prompts, 64)
  assert run(pair, spec, prompts, 64).tokens == ar.tokens


def test_for_run_reads_the_tables_the_config_names(tmp_path):
  """decode.py's call: the stem in the config's auto_tables, the choice at prompt + half the new
  tokens (here chain: 10x cheaper per step), one line logged."""
  from kdtree_jax import run_config  # pylint: disable=import-outside-toplevel
  _write(tmp_path, 0.1, (1, 1.5, 2.5, 4.5), (1.2, 1.7, 2.7, 4.7), _MIXED)
  config = run_config.trained_pair(auto_tables=str(tmp_path / "p"))
  spec = SpecConfig(mode="ddtree", budget="auto", block_size=BLOCK, max_new_tokens=64)
  logged = []
  out = auto_program.for_run(spec, config, "configs/whatever.py", 36, log=logged.append)
  assert out == SpecConfig(mode="chain", block_size=BLOCK, max_new_tokens=64)
  assert len(logged) == 1 and logged[0].startswith("budget auto: runs chain at ctx 68:")
