"""Acceptance and speed of the trained pair on held-out stdlib files, for every mode.

For each held-out prompt (evenly spaced windows of the held-out stream, never trained on),
greedy decoding with `ar`, `chain` and `ddtree` at several budgets: mean accepted tokens per
step (bonus included), tokens/s (after compile, batch 1), speedup over `ar`; and the check
that every mode emitted exactly the `ar` tokens. JSON lines + a plot of acceptance vs budget.

  python scripts/eval_acceptance.py --budgets 8,16,32,64,128 --prompts 8 --gen 128 \
      --json_out runs/accept.jsonl --plot_out runs/accept.png
"""

import json
import os
import time

from absl import flags
import jax
import numpy as np

from kdtree_jax import cli, data, plots
from kdtree_jax.decoding.loop import generate
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.loader import DTYPES, load_pair

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "k2tiny.py")
_CONFIG = cli.define_config(DEFAULT_CONFIG, "Run config (the pair).")
_BUDGETS = flags.DEFINE_list("budgets", ["8", "16", "32", "64", "128"], "DDTree budgets.")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "Held-out prompts.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 192, "Prompt bytes.")
_GEN = flags.DEFINE_integer("gen", 128, "Tokens generated per prompt.")
_JSON = flags.DEFINE_string("json_out", None, "JSON lines output.")
_PLOT = flags.DEFINE_string("plot_out", None, "Acceptance vs budget plot (PNG).")


def held_out_prompts(n, length):
  """n evenly spaced windows of the held-out stream."""
  corpus = data.build_corpus()
  starts = np.linspace(0, len(corpus.eval) - length - 1, n).astype(int)
  return [list(map(int, corpus.eval[s:s + length])) for s in starts]


def run_mode(pair, spec, prompts, c):
  """Per-prompt generate (batch 1, compile excluded); returns tokens, accepted, seconds."""
  args = (pair, spec)
  dt = DTYPES[c.dtype]
  generate(*args, prompts[:1], max_len=c.max_len, cache_dtype=dt, progress=cli.progress,
           memory_limit_gb=c.memory_limit_gb)  # compile (memory bound checked first)
  toks, acc, secs = [], [], 0.0
  for p in prompts:
    t0 = time.perf_counter()
    r = generate(*args, [p], max_len=c.max_len, cache_dtype=dt)
    secs += time.perf_counter() - t0
    toks.append(r.tokens[0])
    acc.extend(r.accepted_per_step[0])
  return toks, acc, secs


def plot(rows, path):
  """Acceptance vs budget with the chain line (kdtree_jax.plots)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(6, 4))
  plots.plot_acceptance(ax, [dict(r, source=r["device"]) for r in rows])
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(_):
  c = cli.load_config(_CONFIG, "configs/k2tiny.py")
  with cli.progress("loading the target and draft"):
    pair, _ = load_pair(c)
  prompts = held_out_prompts(_PROMPTS.value, _PROMPT_LEN.value)
  runs = [("ar", 1), ("chain", 1)] + [("ddtree", int(b)) for b in _BUDGETS.value]
  rows, ar_tokens, ar_tps = [], None, None
  for mode, budget in runs:
    spec = SpecConfig(mode=mode, budget=budget, block_size=pair.dcfg.block_size,
                      max_new_tokens=_GEN.value, attn_backend=c.attn_backend)
    toks, acc, secs = run_mode(pair, spec, prompts, c)
    ntok = sum(len(t) for t in toks)
    row = dict(mode=mode, budget=budget if mode == "ddtree" else None, device=jax.devices()[0].device_kind,
               prompts=len(prompts), gen=_GEN.value, mean_accept_len=float(np.mean(acc)),
               steps=len(acc), tokens_per_s=ntok / secs)
    if mode == "ar":
      ar_tokens, ar_tps = toks, row["tokens_per_s"]
    row["speedup_vs_ar"] = row["tokens_per_s"] / ar_tps
    row["same_tokens_as_ar"] = toks == ar_tokens
    rows.append(row)
    print(f"{mode:>6} {row['budget'] or '-':>5}: accept/step {row['mean_accept_len']:.2f}  "
          f"{row['tokens_per_s']:8.1f} tok/s  x{row['speedup_vs_ar']:.2f}  "
          f"lossless={row['same_tokens_as_ar']}", flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
  if _PLOT.value:
    plot(rows, _PLOT.value)


if __name__ == "__main__":
  cli.run(main)
