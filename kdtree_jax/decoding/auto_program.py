"""budget='auto' as a choice among whole decode programs: chain, DDTree at each fixed compiled
width, and the per-step width switch (`budget.verify_auto`).

Why: on the H200 the trained pair's every program is launch-bound (kernels ~0.03 ms of ~0.9 ms
per step), chain's program has far fewer kernels than any DDTree program, and the switch adds
~0.25 ms per step (a conditional inside the device loop): choosing only among the switch's
widths lost 2.5x to chain (WORKSPACE.md, issue 15). So each candidate program is charged its own
MEASURED loop ms per step (`calibrate_step_cost.py` rows: 'chain', 'ddtree_fixed' at width n + 1,
'ddtree' = the switch's branch n + 1) and its expected tokens per step from recorded steps of
the trained pair (the acceptance JSON's 'programs' table: per recorded step, the tokens a
prefix of n nodes accepted, and the calibrated expectation the on-device chooser sees; chain's
mean tokens per step from a chain run). Modelled tok/s = tokens per step / ms per step; the
switch's is a replay of its own rule on the recorded steps (per step the width of most expected
tokens per branch ms, charged what that width actually accepted). The best candidate at the
run's mean context is compiled and run (a static choice per run).

Letters: S recorded steps, W compiled node counts.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from kdtree_jax.decoding import step_cost

CHAIN, SWITCH = "chain", "switch"


@dataclasses.dataclass(frozen=True)
class Replay:
  """Recorded steps of the pair (verified at the largest width): observed[s][j] tokens a
  node_counts[j]-node prefix committed (root included), expected[s][j] the calibrated
  expectation; chain_tokens_per_step from a chain run on the same prompts."""

  node_counts: tuple[int, ...]
  observed: tuple[tuple[float, ...], ...]
  expected: tuple[tuple[float, ...], ...]
  chain_tokens_per_step: float

  def to_dict(self):
    return dict(node_counts=list(self.node_counts), observed=[list(r) for r in self.observed],
                expected=[list(r) for r in self.expected],
                chain_tokens_per_step=self.chain_tokens_per_step)

  @classmethod
  def from_dict(cls, d):
    rows = lambda k: tuple(tuple(float(x) for x in r) for r in d[k])
    return cls(tuple(int(n) for n in d["node_counts"]), rows("observed"), rows("expected"),
               float(d["chain_tokens_per_step"]))


def switch_replay(replay: Replay, branch_ms) -> tuple[float, float, dict]:
  """(tokens per step, ms per step, {nodes: steps}) of the per-step switch with branch costs
  branch_ms[j] (ms of a step verifying node_counts[j] + 1): each step takes the first width of
  most expected tokens per ms (`budget.choose_width`'s rule) and commits what it observed."""
  obs, exp = np.asarray(replay.observed, float), np.asarray(replay.expected, float)
  ms = np.asarray(branch_ms, float)
  pick = np.argmax(exp / ms[None, :], axis=1)
  hist = {int(replay.node_counts[j]): int(np.sum(pick == j)) for j in np.unique(pick)}
  return float(obs[np.arange(len(pick)), pick].mean()), float(ms[pick].mean()), hist


@dataclasses.dataclass(frozen=True)
class ProgramCosts:
  """MEASURED loop ms per step of each candidate program at `contexts`: chain_ms[i],
  fixed_ms[n][i] (DDTree compiled at n nodes), switch_ms[n][i] (the switch's branch n)."""

  contexts: tuple[int, ...]
  chain_ms: tuple[float, ...] = ()
  fixed_ms: dict = dataclasses.field(default_factory=dict)
  switch_ms: dict = dataclasses.field(default_factory=dict)


def program_costs(rows) -> ProgramCosts:
  """ProgramCosts from calibrate_step_cost.py JSON rows (a program missing at some context is
  left out)."""
  ctxs = tuple(sorted({r["ctx"] for r in rows}))
  by = {(r["mode"], r["width"], r["ctx"]): r["loop_ms"] for r in rows}

  def series(mode, width):
    vals = [by.get((mode, width, c)) for c in ctxs]
    return None if None in vals else tuple(float(v) for v in vals)

  widths = lambda mode: sorted({r["width"] for r in rows if r["mode"] == mode})
  chain = next((s for w in widths(CHAIN) if (s := series(CHAIN, w))), ())
  grab = lambda mode: {w - 1: s for w in widths(mode) if w >= 2 and (s := series(mode, w))}
  return ProgramCosts(ctxs, chain, grab("ddtree_fixed"), grab("ddtree"))


def candidates(costs: ProgramCosts, replay: Replay, ctx: int) -> list[dict]:
  """Every candidate with a measured cost and an acceptance record: name, nodes, tokens per
  step, ms per step at ctx, modelled tok/s (and the switch's width histogram)."""
  at = lambda series: step_cost.interp_ctx(costs.contexts, series, ctx)
  obs = np.asarray(replay.observed, float)
  out = []
  if costs.chain_ms:
    out.append(dict(name=CHAIN, nodes=None, tokens_per_step=replay.chain_tokens_per_step,
                    ms_per_step=at(costs.chain_ms)))
  for j, n in enumerate(replay.node_counts):
    if n in costs.fixed_ms:
      out.append(dict(name=f"ddtree {n}", nodes=n, tokens_per_step=float(obs[:, j].mean()),
                      ms_per_step=at(costs.fixed_ms[n])))
  if all(n in costs.switch_ms for n in replay.node_counts):
    tok, ms, hist = switch_replay(replay, [at(costs.switch_ms[n]) for n in replay.node_counts])
    out.append(dict(name=SWITCH, nodes=None, tokens_per_step=tok, ms_per_step=ms,
                    width_histogram=hist))
  for c in out:
    c["tokens_per_s"] = 1e3 * c["tokens_per_step"] / c["ms_per_step"]
  return out


def best(cands: list[dict]) -> dict:
  """The candidate of most modelled tok/s (the first listed on a tie)."""
  return max(cands, key=lambda c: c["tokens_per_s"])


def spec_for(spec, choice: dict):
  """The decode spec of a candidate, from the budget='auto' spec (the switch: unchanged)."""
  if choice["name"] == CHAIN:
    return dataclasses.replace(spec, mode="chain", budget=type(spec)().budget, auto=None)
  if choice["nodes"] is not None:
    return dataclasses.replace(spec, budget=choice["nodes"], auto=None)
  return spec


def explain(choice: dict, cands: list[dict], ctx: int) -> str:
  """One line: which program auto runs and why (MODELLED tok/s of every candidate)."""
  others = ", ".join(f"{c['name']} {c['tokens_per_s']:.0f}" for c in
                     sorted(cands, key=lambda c: -c["tokens_per_s"]) if c is not choice)
  return (f"budget auto: runs {choice['name']} at ctx {ctx}: modelled "
          f"{choice['tokens_per_s']:.0f} tok/s = {choice['tokens_per_step']:.2f} tok/step "
          f"(recorded) / {choice['ms_per_step']:.3f} ms/step (MEASURED loop); others: {others}")


def load_replay(accept_json: str) -> Replay | None:
  """The acceptance JSON's 'programs' table, or None (an older JSON without it)."""
  if not accept_json or not os.path.exists(accept_json):
    return None
  with open(accept_json) as f:
    raw = json.load(f)
  return Replay.from_dict(raw["programs"]) if "programs" in raw else None


def choose_for_tables(spec, cost_json: str, accept_json: str, ctx: int):
  """(spec to run, one line saying which and why, the chosen candidate or None) for a
  budget='auto' spec: the best whole program by `candidates`, or the switch itself (None) when
  a table lacks the candidates."""
  replay = load_replay(accept_json)
  missing = ([] if replay is not None else [f"no 'programs' table in {accept_json or '-'}"]) + (
      [] if cost_json and os.path.exists(cost_json) else [f"no {cost_json or 'step-cost JSON'}"])
  if missing:
    return spec, (f"budget auto: runs the per-step switch (no whole-program candidates: "
                  f"{'; '.join(missing)})"), None
  with open(cost_json) as f:
    cands = candidates(program_costs(json.load(f)["rows"]), replay, ctx)
  if not cands:
    return spec, (f"budget auto: runs the per-step switch ({cost_json} times no candidate "
                  "program)"), None
  choice = best(cands)
  return spec_for(spec, choice), explain(choice, cands, ctx), choice


def for_run(spec, config, config_path, prompt_len: int, log=print):
  """decode.py's budget='auto': the program to run for a prompt of prompt_len tokens (chosen at
  the run's mean context, prompt + half the new tokens), from the tables beside the config
  (`step_cost.table_paths`); any other spec unchanged."""
  if spec.budget != "auto":
    return spec
  cost_json, accept_json = step_cost.table_paths(config_path, config)
  spec, line, _ = choose_for_tables(spec, cost_json, accept_json,
                                    prompt_len + spec.max_new_tokens // 2)
  log(line)
  return spec
