"""MEASURED tokens/s of the trained pair on this device: ar, chain, ddtree at fixed budgets, the
per-step width switch ('switch', widths chosen from this device's measured step-cost table) and
budget='auto' (`auto_program.py`: the one of chain / each fixed width / the switch of most
modelled tok/s, from the same table's per-program loop ms and the acceptance JSON's recorded
steps; it prints which and why).

Two prompt sets, batch 1, greedy, the config's dtype (float32: every mode must emit exactly the
`ar` tokens): `heldout` = --prompts evenly spaced --prompt_len-token windows of the held-out
stdlib text (data.build_corpus().eval), and `default` = the config's own prompt (what
`python scripts/decode.py` decodes: the tok/s a user of the defaults sees). Both prompt sets
fall in one prompt bucket (<= 64 tokens), so each mode compiles once. Seconds per run are
`generate`'s (compile and one warm-up run excluded; prefill included).

  python scripts/calibrate_step_cost.py --config configs/k2tiny.py --ctx 64,128,256 \
      --steps 4,32 --out_dir runs/pair
  python scripts/bench_pair.py --step_cost runs/pair/step_cost.json --out runs/pair/pair.jsonl

Copy the step-cost JSON to configs/k2tiny.step_cost.json to make it decode.py's table for
--config.budget=auto (it is this device's: another device needs its own).
"""

import collections
import json
import os
import time

from absl import app, flags
import jax
import numpy as np
from ml_collections import config_flags

from kdtree_jax import data, runtime, timing
from kdtree_jax.decoding import auto_program, loop, step_cost
from kdtree_jax.decoding.loop import generate
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.loader import DTYPES, load_pair

runtime.define_flags()
DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "k2tiny.py")
_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Run config (the pair).")
_STEP_COST = flags.DEFINE_string("step_cost", "", "Step-cost JSON of this pair on this device "
                                 "('' = the config's auto_tables, else the analytic floor).")
_ACCEPT = flags.DEFINE_string("accept", "", "Acceptance JSON ('' = the config's auto_tables).")
_BUDGETS = flags.DEFINE_list("budgets", ["1", "3", "7", "15", "31", "63"],
                            "Fixed ddtree budgets (auto's candidates: the table's node counts).")
_PROMPTS = flags.DEFINE_integer("prompts", 6, "Held-out prompts.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Tokens per held-out prompt.")
_GEN = flags.DEFINE_integer("gen", 0, "Tokens per prompt (0: the config's max_new_tokens).")
_OUT = flags.DEFINE_string("out", "", "JSON lines output ('' = none).")


def _fixed(budget):
  """The config's fixed DDTree budget for the default-prompt row; 32 when it is 'auto' (auto has
  its own rows)."""
  return 32 if budget == "auto" else int(budget)


def heldout_prompts(n: int, length: int) -> list[list[int]]:
  """n evenly spaced windows of the held-out token stream."""
  held = data.build_corpus().eval
  starts = np.linspace(0, len(held) - length - 1, n).astype(int)
  return [list(map(int, held[s:s + length])) for s in starts]


def choose_program(switch, cost_json, accept_json, prompts, gen):
  """(spec, line, candidate or None) budget='auto' runs for these prompts
  (`auto_program.choose_for_tables` at their mean context: prompt + half the new tokens)."""
  ctx = int(np.mean([len(p) for p in prompts])) + gen // 2
  out = auto_program.choose_for_tables(switch, cost_json, accept_json, ctx)
  print(out[1], flush=True)
  return out


def precompile(pair, specs, prompt, max_len, dtype):
  """Every spec's decode program for `prompt`'s bucket, traced one after another and compiled
  at once (one thread each; XLA compiles in parallel): `generate` then finds them compiled."""
  lowered = []
  for spec in specs:
    prepare = loop._prepare  # pylint: disable=protected-access  (generate's own padding)
    prompts_bs, lengths_b, placed = prepare(pair, spec, [prompt], max_len, None)
    statics = dict(spec=spec, max_len=max_len, cache_dtype=dtype)
    args = (placed, prompts_bs, lengths_b, jax.random.key(0))
    lowered.append(loop.generate_device.trace(*args, **statics).lower())
  t0 = time.perf_counter()
  out = timing.Deadline(float("inf")).box_all([lw.compile for lw in lowered])
  print(f"compiled {len(specs)} decode programs in parallel: {time.perf_counter() - t0:.1f} s "
        f"({', '.join(status for _, _, status in out)})", flush=True)


def decode_all(pair, spec, prompts, max_len, dtype) -> dict:
  """Per prompt (batch 1): tokens; summed over prompts: tokens, steps, seconds; per step: width
  (auto) and context."""
  out = dict(tokens=[], emitted=0, steps=0, seconds=0.0, widths=[], ctx=[], compile_s=0.0)
  for p in prompts:
    r = generate(pair, spec, [p], max_len=max_len, cache_dtype=dtype, warmup=True)
    out["tokens"].append(r.tokens[0])
    out["emitted"] += len(r.tokens[0])
    out["steps"] += r.steps
    out["seconds"] += r.seconds
    acc = r.accepted_per_step[0]
    out["widths"] += r.widths_per_step[:len(acc)]
    out["ctx"] += (len(p) + np.cumsum([0] + acc[:-1])).tolist()
    out["compile_s"] += r.compile_seconds
  return out


def result_row(prompt_set, mode, b, res, ar_tokens, auto, cost, choice=None):
  """One row: tok/s, tokens per step (prefill's first token included, as decode.py counts),
  ms per step; for the switch (and auto running it) the width histogram and its modelled ms per
  step; for auto the program it ran and that program's modelled tok/s."""
  r = dict(kind="pair_measured", prompts=prompt_set, n_prompts=len(res["tokens"]), mode=mode,
           budget=b, tokens=res["emitted"], steps=res["steps"],
           tokens_per_s=res["emitted"] / res["seconds"],
           tokens_per_step=res["emitted"] / max(res["steps"], 1),
           ms_per_step=1e3 * res["seconds"] / max(res["steps"], 1),
           compile_s=res["compile_s"], same_tokens_as_ar=res["tokens"] == ar_tokens,
           device=jax.devices()[0].device_kind)
  if choice is not None:
    r.update(program=choice["name"], modelled_tokens_per_s=choice["tokens_per_s"],
             modelled_tokens_per_step=choice["tokens_per_step"])
  if res["widths"]:
    hist = collections.Counter(res["widths"])
    r["width_histogram"] = {int(k): v for k, v in sorted(hist.items())}
    r["cost_source"] = auto.cost_source
    if hasattr(cost, "widths"):  # a measured table: its prediction of the steps the switch ran
      r["modelled_ms_per_step"] = float(np.mean([cost.ms(w + 1, x) for w, x in
                                                 zip(res["widths"], res["ctx"])]))
  elif choice is not None:
    r["modelled_ms_per_step"] = choice["ms_per_step"]
  return r


def table(rows) -> str:
  lines = [f"{'prompts':>8} {'mode':>6} {'budget':>6} {'tok/s':>9} {'tok/step':>8} "
           f"{'ms/step':>8} {'modelled':>8}  lossless  widths (switch)"]
  for r in rows:
    mod = r.get("modelled_ms_per_step")
    budget = r.get("program", r["budget"]) or "-"
    lines.append(f"{r['prompts']:>8} {r['mode']:>6} {str(budget):>6} "
                 f"{r['tokens_per_s']:9.1f} {r['tokens_per_step']:8.2f} {r['ms_per_step']:8.3f} "
                 f"{'-' if mod is None else f'{mod:.3f}':>8}  {str(r['same_tokens_as_ar']):>8}  "
                 f"{r.get('width_histogram', '')}")
  return "\n".join(lines)


def verdict(rows) -> str:
  """Per prompt set: auto (the program it ran) vs the best of chain, every fixed budget and the
  switch, and vs each of them; auto's modelled vs measured tok/s; the switch's modelled vs
  measured ms per step."""
  out = []
  for ps in sorted({r["prompts"] for r in rows}):
    rs = [r for r in rows if r["prompts"] == ps]
    auto = next((r for r in rs if r["mode"] == "auto"), None)
    rivals = [r for r in rs if r["mode"] in ("chain", "ddtree", "switch")]
    name = lambda r: r["mode"] + (f" {r['budget']}" if r["mode"] == "ddtree" else "")
    if auto and rivals:
      best = max(rivals, key=lambda r: r["tokens_per_s"])
      each = ", ".join(f"{name(r)} {auto['tokens_per_s'] / r['tokens_per_s']:.2f}x"
                       for r in rivals)
      out.append(f"{ps}: auto (runs {auto.get('program', '?')}) {auto['tokens_per_s']:.1f} tok/s"
                 f" / best of chain, fixed and switch ({name(best)}) {best['tokens_per_s']:.1f} "
                 f"= {auto['tokens_per_s'] / best['tokens_per_s']:.3f}; auto vs {each}")
      if auto.get("modelled_tokens_per_s"):
        out.append(f"{ps}: auto modelled {auto['modelled_tokens_per_s']:.0f} tok/s vs measured "
                   f"{auto['tokens_per_s']:.0f} (measured includes each prompt's prefill)")
    sw = next((r for r in rs if r["mode"] == "switch"), None)
    if sw and sw.get("modelled_ms_per_step"):
      mod, ms = sw["modelled_ms_per_step"], sw["ms_per_step"]
      out.append(f"{ps}: switch modelled {mod:.3f} ms/step vs measured {ms:.3f} "
                 f"({100 * (mod / ms - 1):+.1f}%; measured includes each prompt's prefill)")
  return "\n".join(out + step_cost.step_cliffs(rows))


def main(_):
  c = _CONFIG.value
  dtype = DTYPES[c.dtype]
  pair, tokenizer = load_pair(c)
  config_path = config_flags.get_config_filename(flags.FLAGS["config"])
  cost_json, accept_json = step_cost.table_paths(config_path, c)
  auto, what = step_cost.auto_budget(_STEP_COST.value or cost_json, _ACCEPT.value or accept_json,
                                     pair.tcfg, pair.dcfg)
  print(what, flush=True)
  cost = step_cost.load_calibration(_STEP_COST.value or cost_json) if auto.cost_source.startswith(
      "calibrated") else None
  gen = _GEN.value or c.max_new_tokens
  mk = lambda mode, b=32, a=None: SpecConfig(mode=mode, budget=b, block_size=pair.dcfg.block_size,
                                             max_new_tokens=gen, attn_backend=c.attn_backend,
                                             auto=a)
  sets = {"heldout": (heldout_prompts(_PROMPTS.value, _PROMPT_LEN.value),
                      [("ar", None), ("chain", None)] + [("ddtree", int(b)) for b in _BUDGETS.value]
                      + [("switch", "auto"), ("auto", "auto")]),
          "default": ([tokenizer.encode(c.prompt)],
                      [("ar", None), ("chain", None), ("ddtree", _fixed(c.budget)), ("switch", "auto"),
                       ("auto", "auto")])}
  switch = mk("ddtree", "auto", auto)
  choices = {name: choose_program(switch, _STEP_COST.value or cost_json,
                                  _ACCEPT.value or accept_json, prompts, gen)
             for name, (prompts, _) in sets.items()}
  spec_of = lambda mode, b, name: (switch if mode == "switch" else choices[name][0]
                                   if mode == "auto" else mk(mode, b or 32))
  precompile(pair, list({spec_of(m, b, n): 0 for n, (_, ms) in sets.items() for m, b in ms}),
             sets["default"][0][0], c.max_len, dtype)
  rows = []
  for name, (prompts, modes) in sets.items():
    ar_tokens = None
    for mode, b in modes:
      res = decode_all(pair, spec_of(mode, b, name), prompts, c.max_len, dtype)
      ar_tokens = res["tokens"] if mode == "ar" else ar_tokens
      rows.append(result_row(name, mode, b if mode != "ar" and mode != "chain" else None, res,
                             ar_tokens, auto, cost, choices[name][2] if mode == "auto" else None))
      print(table(rows[-1:]).splitlines()[1], flush=True)
  print(f"\nMEASURED on {jax.devices()[0].device_kind}, {c.dtype}, {gen} tokens per prompt; {what}"
        + "".join(f"\n{n}: {line}" for n, (_, line, _) in choices.items()))
  print(table(rows))
  print(verdict(rows))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      for r in rows:
        f.write(json.dumps(dict(r, auto_tables=what)) + "\n")


if __name__ == "__main__":
  app.run(main)
