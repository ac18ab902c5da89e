"""SIMULATED K2.6 tokens/s of budget='auto' vs every fixed budget, chain and ar.

Real acceptance from the trained pair (k2tiny, f32, greedy, held-out prompts: every step's
accepted tokens and, for auto, its chosen width), charged per step with a K2.6 step-cost model
at a fixed context: one GPU's share of full K2.6 (8-way split, INT4 experts) and the 8 x H200
projection (+ collectives); from a calibration JSON (scripts/calibrate_step_cost.py) when given,
else the analytic floor. The tokens/s are therefore SIMULATED (real acceptance x modelled time),
never a measurement of K2.6. The acceptance calibration is fitted first on other held-out
prompts (records of steps verified at the largest width) and saved as JSON. Every run must emit
exactly the `ar` tokens (f32).

  python scripts/eval_budget.py --out_dir results/budget_eval      # analytic K2.6 floors
  python scripts/eval_budget.py --step_cost runs/calib/step_cost.json --out_dir ...  # measured
"""

import collections
import json
import os
import time

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from kdtree_jax import data, plots, runtime  # noqa: E402
from kdtree_jax.decoding import accept_trace, auto_program, budget, step_cost  # noqa: E402
from kdtree_jax.decoding.loop import generate  # noqa: E402
from kdtree_jax.decoding.spec_config import SpecConfig  # noqa: E402
from kdtree_jax.loader import DTYPES, load_pair  # noqa: E402

runtime.define_flags()
DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "k2tiny.py")
_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Run config (the pair).")
_NODES = flags.DEFINE_list("nodes", ["1", "3", "7", "15", "31", "63"],
                          "budget='auto' node counts (a --step_cost JSON must cover them + 1).")
_BUDGETS = flags.DEFINE_list("budgets", ["1", "3", "7", "15", "31", "32", "63"], "Fixed budgets.")
_CTX = flags.DEFINE_list("ctx", ["4096", "46000", "131072"], "Simulated K2.6 contexts.")
_PROMPTS = flags.DEFINE_integer("prompts", 6, "Held-out test prompts.")
_FIT_PROMPTS = flags.DEFINE_integer("fit_prompts", 8, "Held-out prompts to fit acceptance on.")
_GEN = flags.DEFINE_integer("gen", 96, "Tokens per prompt.")
_STEP_COST = flags.DEFINE_string("step_cost", "", "Calibration JSON of one GPU's K2.6 share.")
_OUT = flags.DEFINE_string("out_dir", "results/budget_eval", "Output folder.")
_FIT_ONLY = flags.DEFINE_bool("fit_only", False, "Only fit the acceptance JSON (--out_dir/"
                              "accept_calibration.json; copy it to configs/X.accept.json).")
_MEASURE = flags.DEFINE_string("measure_cost", "", "Calibration JSON of THIS pair on THIS device "
                               "(calibrate_step_cost.py --config configs/k2tiny.py): also time "
                               "every run for real here, auto choosing from that table.")

LABEL = "SIMULATED: real k2tiny acceptance x modelled K2.6 step time"


def prompt_sets(n_test, n_fit, length=192):
  """Disjoint evenly spaced windows of the held-out stream: (test prompts, fit prompts)."""
  held = data.build_corpus().eval
  starts = np.linspace(0, len(held) - length - 1, n_test + n_fit).astype(int)
  windows = [list(map(int, held[s:s + length])) for s in starts]
  return windows[0::2][:n_test] + windows[1::2][n_test:], windows[1::2][:n_fit] + \
      windows[0::2][n_fit:]


def run(pair, spec, prompts, max_len):
  """Per prompt (batch 1): tokens, tokens per step, widths per step (auto), decode seconds
  (compile and a first run excluded by `generate`) and each step's context."""
  args = (pair, spec)
  out = dict(tokens=[], accepted=[], widths=[], seconds=0.0, ctx=[])
  for p in prompts:
    r = generate(*args, [p], max_len=max_len)
    acc = r.accepted_per_step[0]
    out["tokens"].append(r.tokens[0])
    out["accepted"].extend(acc)
    out["widths"].extend(r.widths_per_step[:len(acc)])
    out["seconds"] += r.seconds
    out["ctx"].extend((len(p) + np.cumsum([0] + acc[:-1])).tolist())
  return out


def records(pair, prompts, nodes, gen, max_len):
  """Node-level acceptance records of steps verified at the largest width."""
  spec = SpecConfig(mode="ddtree", budget=nodes[-1], block_size=pair.dcfg.block_size,
                    max_new_tokens=gen)
  return accept_trace.collect(pair, spec, prompts, max_len)


def fit_acceptance(pair, prompts, nodes, gen, max_len, out_dir):
  """AcceptCalibration fitted on `prompts`; saved as JSON with the 'programs' table budget='auto'
  chooses whole programs by (`auto_program.Replay`: per recorded step the tokens each node-count
  prefix committed and the calibrated expectation; chain's tokens per step on the same prompts)."""
  recs = records(pair, prompts, nodes, gen, max_len)
  cal = accept_trace.fit(recs, nodes)
  chain = run(pair, SpecConfig(mode="chain", block_size=pair.dcfg.block_size,
                                 max_new_tokens=gen), prompts, max_len)
  per_step = lambda f: tuple(tuple(map(float, r)) for r in np.stack([f(n) for n in nodes], 1))
  replay = auto_program.Replay(
      tuple(nodes), per_step(lambda n: accept_trace.prefix_accept(recs, n)),
      per_step(lambda n: accept_trace.prefix_expected(recs, n, cal)),
      float(np.mean(chain["accepted"])))
  with open(os.path.join(out_dir, "accept_calibration.json"), "w") as f:
    json.dump(dict(calibration=cal.to_dict(), steps=len(recs["depth"]), prompts=len(prompts),
                   gen=gen, programs=replay.to_dict()), f, indent=1)
  return cal, replay


def calibration_check(pair, cal, prompts, nodes, gen, max_len):
  """Observed vs expected tokens per step on the test prompts, per compiled width: calibrated
  and raw (DDTree's surrogate), with the 3-standard-error band of the mean difference."""
  recs = records(pair, prompts, nodes, gen, max_len)
  out = []
  for n in nodes:
    obs = accept_trace.prefix_accept(recs, n)
    r = dict(kind="calibration", nodes=n, steps=len(obs), observed=float(obs.mean()))
    for name, c in (("calibrated", cal), ("raw", budget.AcceptCalibration())):
      d = obs - accept_trace.prefix_expected(recs, n, c)
      r[f"expected_{name}"] = float(obs.mean() - d.mean())
      r[f"band3se_{name}"] = float(3 * d.std() / np.sqrt(len(d)))
    out.append(r)
    print(f"acceptance, {n} nodes: observed {r['observed']:.3f}, expected calibrated "
          f"{r['expected_calibrated']:.3f} (raw q {r['expected_raw']:.3f}), 3 SE "
          f"{r['band3se_calibrated']:.3f}", flush=True)
  return out


def charge(cost, ctx, mode, budget_nodes, res):
  """Simulated ms of every step of a run, and the tokens it emitted."""
  acc = res["accepted"]
  if mode == "ar":
    ms = [cost.mode_ms("ar", ctx)] * len(acc)
  elif mode == "chain":
    ms = [cost.mode_ms("chain", ctx)] * len(acc)
  elif mode == "auto":
    ms = [cost.ms(w + 1, ctx) for w in res["widths"]]
  else:
    ms = [cost.ms(budget_nodes + 1, ctx)] * len(acc)
  return np.asarray(ms), int(np.sum(acc))


def row(name, cost, ctx, mode, b, res, ar_tokens):
  ms, tokens = charge(cost, ctx, mode, b, res)
  r = dict(label=LABEL, cost_model=name, cost_source=cost.source, ctx=ctx, mode=mode,
           budget=b if mode in ("ddtree", "auto") else None, tokens=tokens, steps=len(ms),
           mean_accept=float(np.mean(res["accepted"])), modelled_ms_per_step=float(ms.mean()),
           simulated_tokens_per_s=1e3 * tokens / float(ms.sum()),
           same_tokens_as_ar=res["tokens"] == ar_tokens)
  if mode == "auto":
    hist = collections.Counter(res["widths"])
    r["width_histogram"] = {int(k): v for k, v in sorted(hist.items())}
  return r


def fixed_runs(pair, budgets, gen, prompts, max_len):
  """{(mode, budget): run} for ar, chain and every fixed budget (cost-model independent)."""
  mk = lambda mode, b=32: SpecConfig(mode=mode, budget=b, block_size=pair.dcfg.block_size,
                                     max_new_tokens=gen)
  runs = {("ar", None): run(pair, mk("ar"), prompts, max_len),
          ("chain", None): run(pair, mk("chain"), prompts, max_len)}
  for b in budgets:
    runs[("ddtree", b)] = run(pair, mk("ddtree", b), prompts, max_len)
  return runs


def auto_run(pair, cost, ctx, nodes, cal, gen, prompts, max_len):
  auto = budget.from_cost_model(cost, nodes, (ctx,), cal)
  spec = SpecConfig(mode="ddtree", budget="auto", auto=auto, block_size=pair.dcfg.block_size,
                    max_new_tokens=gen)
  return run(pair, spec, prompts, max_len)


def program_choice(cost, ctx, replay):
  """The whole program decode.py's budget='auto' runs at ctx under this cost model
  (`auto_program`'s rule on the fitted 'programs' table: chain, DDTree at each fixed node count,
  or the per-step switch; each charged the model's ms per step)."""
  per_n = {n: (cost.ms(n + 1, ctx),) for n in replay.node_counts}
  costs = auto_program.ProgramCosts((ctx,), (cost.mode_ms("chain", ctx),), per_n, dict(per_n))
  return auto_program.best(auto_program.candidates(costs, replay, ctx))


def program_row(choice, rows_here):
  """The row of the program `choice` names, relabelled as decode's budget='auto' (whole program):
  its SIMULATED tok/s is that program's own run in this evaluation."""
  if choice["name"] == auto_program.CHAIN:
    src = next(r for r in rows_here if r["mode"] == "chain")
  elif choice["nodes"] is not None:
    src = next(r for r in rows_here if r["mode"] == "ddtree" and r["budget"] == choice["nodes"])
  else:
    src = next(r for r in rows_here if r["mode"] == "auto")
  return dict(src, mode="auto_program", budget=None, program=choice["name"],
              program_modelled_tokens_per_s=choice["tokens_per_s"])


def measured(pair, cost_json, nodes, cal, runs, gen, prompts, max_len):
  """MEASURED rows: wall-clock tokens/s of every run on this device, auto choosing from the
  pair's own calibrated table; auto's modelled vs measured ms per step."""
  cost = step_cost.load_calibration(cost_json)
  auto = budget.from_cost_model(cost, nodes, cost.contexts, cal)
  spec = SpecConfig(mode="ddtree", budget="auto", auto=auto, block_size=pair.dcfg.block_size,
                    max_new_tokens=gen)
  runs = dict(runs, auto=run(pair, spec, prompts, max_len))
  ar = runs[("ar", None)]
  rows = []
  for key, res in runs.items():
    mode, b = ("auto", nodes[-1]) if key == "auto" else key
    steps = len(res["accepted"])
    r = dict(kind="measured", mode=mode, budget=b if mode in ("ddtree", "auto") else None,
             tokens_per_s=sum(res["accepted"]) / res["seconds"], steps=steps,
             measured_ms_per_step=1e3 * res["seconds"] / steps, same_tokens_as_ar=res["tokens"]
             == ar["tokens"], device=jax.devices()[0].device_kind, cost_source=cost.source)
    if mode == "auto":
      r["modelled_ms_per_step"] = float(np.mean([cost.ms(w + 1, c)
                                                 for w, c in zip(res["widths"], res["ctx"])]))
      r["width_histogram"] = dict(sorted(collections.Counter(res["widths"]).items()))
    rows.append(r)
    print(f"MEASURED {mode:>6} {str(r['budget'] or '-'):>4}: {r['tokens_per_s']:8.1f} tok/s "
          f"{r['measured_ms_per_step']:7.2f} ms/step (prefill included)"
          + (f", modelled {r['modelled_ms_per_step']:.2f}" if mode == "auto" else ""), flush=True)
  return rows


def summarise(rows):
  """Per (cost model, ctx): auto / best fixed budget and auto / budget 32."""
  out = []
  for key in sorted({(r["cost_model"], r["ctx"]) for r in rows}):
    rs = [r for r in rows if (r["cost_model"], r["ctx"]) == key]
    fixed = [r for r in rs if r["mode"] == "ddtree"]
    best = max(fixed, key=lambda r: r["simulated_tokens_per_s"])
    best_any = max((r for r in rs if r["mode"] not in ("auto", "auto_program")),
                   key=lambda r: r["simulated_tokens_per_s"])
    auto = next(r for r in rs if r["mode"] == "auto")
    prog = next((r for r in rs if r["mode"] == "auto_program"), None)
    b32 = next((r for r in fixed if r["budget"] == 32), None)
    out.append(dict(kind="summary", label=LABEL, cost_model=key[0], ctx=key[1],
                    auto_over_best_fixed=auto["simulated_tokens_per_s"] /
                    best["simulated_tokens_per_s"], best_fixed_budget=best["budget"],
                    auto_over_best_of_all=auto["simulated_tokens_per_s"] /
                    best_any["simulated_tokens_per_s"],
                    auto_over_budget32=None if b32 is None else
                    auto["simulated_tokens_per_s"] / b32["simulated_tokens_per_s"],
                    program=None if prog is None else prog["program"],
                    program_over_best_of_all=None if prog is None else
                    prog["simulated_tokens_per_s"] / best_any["simulated_tokens_per_s"]))
  return out


def table(rows, summary):
  lines = [LABEL, f"{'cost':>5} {'ctx':>7} {'mode':>6} {'budget':>6} {'acc/step':>8} "
                  f"{'ms/step':>8} {'tok/s':>8}  widths (auto)"]
  for r in rows:
    lines.append(f"{r['cost_model']:>5} {r['ctx']:>7} {r['mode']:>6} {str(r['budget'] or '-'):>6} "
                 f"{r['mean_accept']:8.2f} {r['modelled_ms_per_step']:8.2f} "
                 f"{r['simulated_tokens_per_s']:8.1f}  {r.get('width_histogram', '')}"
                 + ("" if r["same_tokens_as_ar"] else "  NOT LOSSLESS"))
  for s in summary:
    b32 = "-" if s["auto_over_budget32"] is None else f"{s['auto_over_budget32']:.2f}x"
    lines.append(f"{s['cost_model']:>5} {s['ctx']:>7}: auto / best fixed (budget "
                 f"{s['best_fixed_budget']}) = {s['auto_over_best_fixed']:.3f}, "
                 f"auto / best of all = {s['auto_over_best_of_all']:.3f}, auto / budget 32 = {b32}"
                 + ("" if s["program"] is None else f"; whole-program auto runs {s['program']}: "
                    f"{s['program_over_best_of_all']:.3f} of the best of all"))
  return "\n".join(lines)


def plot(rows, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  models = sorted({r["cost_model"] for r in rows})
  fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
  for ax, m in zip(axes[0], models):
    plots.plot_budget_eval(ax, [r for r in rows if r["cost_model"] == m], title=f"{m} ({LABEL})")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(_):
  t0 = time.perf_counter()
  c = _CONFIG.value
  if c.dtype != "float32":
    raise ValueError(f"--config.dtype={c.dtype}: the lossless check needs float32")
  pair, _ = load_pair(c)
  os.makedirs(_OUT.value, exist_ok=True)
  nodes = tuple(int(n) for n in _NODES.value)
  test, fit = prompt_sets(_PROMPTS.value, _FIT_PROMPTS.value)
  gen, max_len = _GEN.value, c.max_len
  cal, replay = fit_acceptance(pair, fit, nodes, gen, max_len, _OUT.value)
  if _FIT_ONLY.value:
    print(f"wrote {os.path.join(_OUT.value, 'accept_calibration.json')} "
          f"({time.perf_counter() - t0:.0f} s)")
    return
  checks = calibration_check(pair, cal, test, nodes, gen, max_len)
  runs = fixed_runs(pair, [int(b) for b in _BUDGETS.value], gen, test, max_len)
  ar_tokens = runs[("ar", None)]["tokens"]
  rows = []
  for name, cost in step_cost.k26_models(_STEP_COST.value or None).items():
    for ctx in (int(x) for x in _CTX.value):
      for (mode, b), res in runs.items():
        rows.append(row(name, cost, ctx, mode, b, res, ar_tokens))
      res = auto_run(pair, cost, ctx, nodes, cal, gen, test, max_len)
      rows.append(row(name, cost, ctx, "auto", nodes[-1], res, ar_tokens))
      print(f"[{time.perf_counter() - t0:.0f} s] {name} ctx {ctx}: auto widths "
            f"{rows[-1]['width_histogram']}", flush=True)
      here = [r for r in rows if (r["cost_model"], r["ctx"]) == (name, ctx)]
      rows.append(program_row(program_choice(cost, ctx, replay), here))
  if _MEASURE.value:
    rows_measured = measured(pair, _MEASURE.value, nodes, cal, runs, gen, test, max_len)
  summary = summarise(rows)
  with open(os.path.join(_OUT.value, "budget_eval.jsonl"), "w") as f:
    for r in checks + rows + summary + (rows_measured if _MEASURE.value else []):
      f.write(json.dumps(r) + "\n")
  plot(rows, os.path.join(_OUT.value, "budget_eval.png"))
  print(table(rows, summary))


if __name__ == "__main__":
  app.run(main)
