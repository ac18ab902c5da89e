"""MEASURED tokens/s of the trained pair on this device: ar, chain, ddtree at fixed budgets and
budget='auto' choosing from this device's measured step-cost table.

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
from kdtree_jax.decoding import loop, step_cost
from kdtree_jax.decoding.loop import generate
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.loader import DTYPES, load_pair

runtime.define_flags()
DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "k2tiny.py")
_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Run config (the pair).")
_STEP_COST = flags.DEFINE_string("step_cost", "", "Step-cost JSON of this pair on this device "
                                 "('' = the config's auto_tables, else the analytic floor).")
_ACCEPT = flags.DEFINE_string("accept", "", "Acceptance JSON ('' = the config's auto_tables).")
_BUDGETS = flags.DEFINE_list("budgets", ["7", "15", "31", "63"], "Fixed ddtree budgets.")
_PROMPTS = flags.DEFINE_integer("prompts", 6, "Held-out prompts.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Tokens per held-out prompt.")
_GEN = flags.DEFINE_integer("gen", 0, "Tokens per prompt (0: the config's max_new_tokens).")
_OUT = flags.DEFINE_string("out", "", "JSON lines output ('' = none).")


def heldout_prompts(n: int, length: int) -> list[list[int]]:
  """n evenly spaced windows of the held-out token stream."""
  held = data.build_corpus().eval
  starts = np.linspace(0, len(held) - length - 1, n).astype(int)
  return [list(map(int, held[s:s + length])) for s in starts]


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


def result_row(prompt_set, mode, b, res, ar_tokens, auto, cost):
  """One row: tok/s, tokens per step (prefill's first token included, as decode.py counts),
  ms per step; for auto the width histogram and its modelled ms per step."""
  r = dict(kind="pair_measured", prompts=prompt_set, n_prompts=len(res["tokens"]), mode=mode,
           budget=b, tokens=res["emitted"], steps=res["steps"],
           tokens_per_s=res["emitted"] / res["seconds"],
           tokens_per_step=res["emitted"] / max(res["steps"], 1),
           ms_per_step=1e3 * res["seconds"] / max(res["steps"], 1),
           compile_s=res["compile_s"], same_tokens_as_ar=res["tokens"] == ar_tokens,
           device=jax.devices()[0].device_kind)
  if mode == "auto":
    hist = collections.Counter(res["widths"])
    r["width_histogram"] = {int(k): v for k, v in sorted(hist.items())}
    r["cost_source"] = auto.cost_source
    if hasattr(cost, "widths"):  # a measured table: its prediction of the steps auto ran
      r["modelled_ms_per_step"] = float(np.mean([cost.ms(w + 1, x) for w, x in
                                                 zip(res["widths"], res["ctx"])]))
  return r


def table(rows) -> str:
  lines = [f"{'prompts':>8} {'mode':>6} {'budget':>6} {'tok/s':>9} {'tok/step':>8} "
           f"{'ms/step':>8} {'modelled':>8}  lossless  widths (auto)"]
  for r in rows:
    mod = r.get("modelled_ms_per_step")
    lines.append(f"{r['prompts']:>8} {r['mode']:>6} {str(r['budget'] or '-'):>6} "
                 f"{r['tokens_per_s']:9.1f} {r['tokens_per_step']:8.2f} {r['ms_per_step']:8.3f} "
                 f"{'-' if mod is None else f'{mod:.3f}':>8}  {str(r['same_tokens_as_ar']):>8}  "
                 f"{r.get('width_histogram', '')}")
  return "\n".join(lines)


def verdict(rows) -> str:
  """auto vs the best of chain and every fixed budget, and auto's modelled vs measured ms per
  step, per prompt set."""
  out = []
  for ps in sorted({r["prompts"] for r in rows}):
    rs = [r for r in rows if r["prompts"] == ps]
    auto = next((r for r in rs if r["mode"] == "auto"), None)
    rivals = [r for r in rs if r["mode"] in ("chain", "ddtree")]
    if auto and rivals:
      best = max(rivals, key=lambda r: r["tokens_per_s"])
      out.append(f"{ps}: auto {auto['tokens_per_s']:.1f} tok/s / best of chain and fixed "
                 f"({best['mode']} {best['budget'] or ''}) {best['tokens_per_s']:.1f} = "
                 f"{auto['tokens_per_s'] / best['tokens_per_s']:.3f}")
    if auto and auto.get("modelled_ms_per_step"):
      mod, ms = auto["modelled_ms_per_step"], auto["ms_per_step"]
      out.append(f"{ps}: auto modelled {mod:.3f} ms/step vs measured {ms:.3f} "
                 f"({100 * (mod / ms - 1):+.1f}%; measured includes each prompt's prefill)")
  return "\n".join(out)


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
                      + [("auto", "auto")]),
          "default": ([tokenizer.encode(c.prompt)],
                      [("ar", None), ("chain", None), ("ddtree", c.budget), ("auto", "auto")])}
  spec_of = lambda mode, b: mk("ddtree", "auto", auto) if mode == "auto" else mk(mode, b or 32)
  precompile(pair, list({spec_of(m, b): 0 for _, ms in sets.values() for m, b in ms}),
             sets["default"][0][0], c.max_len, dtype)
  rows = []
  for name, (prompts, modes) in sets.items():
    ar_tokens = None
    for mode, b in modes:
      spec = spec_of(mode, b)
      res = decode_all(pair, spec, prompts, c.max_len, dtype)
      ar_tokens = res["tokens"] if mode == "ar" else ar_tokens
      rows.append(result_row(name, mode, b if mode != "ar" and mode != "chain" else None, res,
                             ar_tokens, auto, cost))
      print(table(rows[-1:]).splitlines()[1], flush=True)
  print(f"\nMEASURED on {jax.devices()[0].device_kind}, {c.dtype}, {gen} tokens per prompt; {what}")
  print(table(rows))
  print(verdict(rows))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      for r in rows:
        f.write(json.dumps(dict(r, auto_tables=what)) + "\n")


if __name__ == "__main__":
  app.run(main)
