"""Writes notebooks/*.ipynb from the cell sources below, executed (outputs and plots stored, so
the repository shows them): edit here, then run from the repo root

  .venv/bin/python notebooks/make_notebooks.py            # execute at full size (~minutes, CPU)
  .venv/bin/python notebooks/make_notebooks.py --no_execute   # sources only, outputs cleared

CI (tests/scripts/test_notebooks.py) checks the committed sources equal these, then re-executes
them at small size (KDTREE_NB_SMALL=1).
"""

import os
import sys

import nbformat
from nbformat import v4

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SETUP = '''\
import os
if os.path.basename(os.getcwd()) == "notebooks":  # run from the repo root either way
  os.chdir("..")
SMALL = os.environ.get("KDTREE_NB_SMALL") == "1"  # CI: few tokens, small budget
%matplotlib inline
import matplotlib.pyplot as plt
import numpy as np
from kdtree_jax import plots'''

DECODE = [
    ("md", """\
# Decoding with the trained pair, and one speculative step by hand

The shipped `k2tiny` pair (configs/k2tiny.py): a 4-layer K2.6-architecture byte-level target and
its DFlash draft, trained on the Python standard library. We decode a held-out prompt with
`ar`, `chain` and `ddtree`, then run one DDTree step phase by phase
(draft -> tree -> verify -> accept -> commit) and draw its tree."""),
    ("code", SETUP + '''
import importlib.util
import jax
import jax.numpy as jnp
from kdtree_jax import data
from kdtree_jax.decoding import step
from kdtree_jax.decoding.loop import generate, init_state
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.loader import load_pair

GEN = 32 if SMALL else 128          # tokens generated per mode
BUDGET = 8 if SMALL else 32         # DDTree node budget
PROMPT_LEN = 128 if SMALL else 192  # prompt bytes
MAX_LEN = 256 if SMALL else 1024    # cache length'''),
    ("code", '''\
spec_file = importlib.util.spec_from_file_location("k2tiny", "configs/k2tiny.py")
k2tiny = importlib.util.module_from_spec(spec_file)
spec_file.loader.exec_module(k2tiny)
config = k2tiny.get_config()
pair, tok = load_pair(config)
tcfg, tparams, dcfg, dparams = pair.tcfg, pair.tparams, pair.dcfg, pair.dparams
print(f"target: {tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}, "
      f"vocab {tcfg.vocab_size}")
print(f"draft: {dcfg.num_hidden_layers} layers, block {dcfg.block_size}, "
      f"taps {dcfg.target_layer_ids}")'''),
    ("md", "A held-out prompt: the bytes up to the end of a `def` line from a file the pair never "
           "trained on."),
    ("code", '''\
raw = bytes(data.build_corpus().eval.astype(np.uint8))
i = raw.find(b"\\ndef ", len(raw) // 3)
end = raw.find(b"\\n", i + 1) + 1
prompt = list(raw[end - PROMPT_LEN:end])
print(tok.decode(prompt))'''),
    ("code", '''\
results = {}
for mode in ("ar", "chain", "ddtree"):
  spec = SpecConfig(mode=mode, budget=BUDGET, block_size=dcfg.block_size, max_new_tokens=GEN)
  res = generate(pair, spec, [prompt], max_len=MAX_LEN)
  results[mode] = res
  print(f"--- {mode}: {len(res.tokens[0])} tokens in {res.steps} steps, "
        f"mean accepted tokens / step {res.mean_accept_len:.2f}")
print(tok.decode(results["ddtree"].tokens[0]))
print("lossless (every mode emits the ar tokens):",
      all(r.tokens == results["ar"].tokens for r in results.values()))'''),
    ("md", """\
## One step, phase by phase

`init_state` prefills the target (and the draft's context from the target's tapped hidden
states) and picks the first token, the *bonus*: the root of the first tree."""),
    ("code", '''\
spec = SpecConfig(mode="ddtree", budget=BUDGET, block_size=dcfg.block_size, max_new_tokens=GEN)
taps = tuple(dcfg.target_layer_ids)
state = jax.jit(lambda pr, p, n, k: init_state(pr, spec, p, n, k, MAX_LEN))(
    pair, jnp.asarray([prompt]), jnp.asarray([len(prompt)]), jax.random.key(0))
print("cache length", int(state.cache.lengths[0]),
      "bonus", repr(tok.decode([int(state.bonus[0])])))'''),
    ("code", '''\
# draft: one block forward of [bonus, MASK x (block - 1)] -> logits for positions 1..depth
draft_cache, draft_logits = jax.jit(lambda dp, tp, st: step.draft_phase(dcfg, dp, tp, spec, st))(
    dparams, tparams, state)
top = np.asarray(jnp.argmax(draft_logits[0], -1))
print("draft logits", draft_logits.shape, "greedy block:", repr(tok.decode(top)))

# tree: the best BUDGET prefixes of the draft's per-position marginals
tree = jax.jit(lambda x: step.tree_phase(spec, x, 1))(draft_logits)
print("tree nodes", tree.node_tokens.shape[1], "max depth", int(tree.depths.max()))

# verify: one target forward over [bonus, nodes] under the tree mask
logits, cache, tapped = jax.jit(lambda tp, st, tr: step.verify_phase(tcfg, tp, spec, st, tr, taps))(
    tparams, state, tree)
print("verify logits", logits.shape)

# accept: the target's choice at every node, walked from the root
key, sub = jax.random.split(state.key)
room = jnp.asarray([spec.depth])
accept = jax.jit(lambda tr, lg, k: step.accept_phase(spec, tr, lg, k, room))
path, a, nxt = accept(tree, logits, sub)
n_acc = int(a[0])
print(f"accepted {n_acc} draft nodes, path {np.asarray(path[0, :n_acc + 1]).tolist()}, "
      f"next bonus {tok.decode([int(nxt[0])])!r}")

# commit: compact the accepted rows into the cache, emit the tokens
new = step.commit_phase(spec, tcfg.eos_token_id, state, cache, draft_cache, tree, tapped, path, a,
                        nxt, key)
emitted = np.asarray(new.out[0, 1:int(new.n_out[0])]).tolist()
print("emitted", repr(tok.decode(emitted)), "cache length", int(new.cache.lengths[0]))
print("same as generate:", emitted == results["ddtree"].tokens[0][1:1 + len(emitted)])'''),
    ("code", '''\
parents = np.asarray(tree.parents[0])
leaves = len(set(range(len(parents))) - set(parents.tolist()))
fig, ax = plt.subplots(figsize=(min(2 + 0.9 * spec.depth, 16), max(3, 0.28 * leaves)))
plots.plot_tree(ax, np.asarray(tree.node_tokens[0]), parents, np.asarray(path[0, :n_acc + 1]),
                root_token=int(state.bonus[0]))
plt.show()'''),
    ("md", "Tokens committed per step over the whole decode (root included: `ar` is always 1)."),
    ("code", '''\
fig, ax = plt.subplots(figsize=(6, 3.5))
plots.plot_accept_hist(ax, {m: results[m].accepted_per_step[0] for m in ("chain", "ddtree")})
plt.show()'''),
]

BENCH = [
    ("md", """\
# Benchmarks: acceptance, throughput, phases and roofline

Reads the committed results (results/*.jsonl, results/h200/*.txt) and any extra files named in
`EXTRA` (or the env var `KDTREE_RESULTS`, comma-separated): JSON lines of
scripts/eval_acceptance.py, bench_context_decode.py, sweep.py and pallas_kernels/tree_verify/bench.py.
The plotting functions live in `kdtree_jax/plots.py` (shared with scripts/plot_results.py)."""),
    ("code", SETUP + '''
EXTRA = []  # e.g. ["runs/sweep.jsonl", "runs/ctx.jsonl"]
EXTRA += [p for p in os.environ.get("KDTREE_RESULTS", "").split(",") if p]
paths = plots.find_results("results") + EXTRA
res = plots.load(paths)
for p in paths:
  print(p)
print({k: len(v) for k, v in res.items()})'''),
    ("md", "## Acceptance vs budget (held-out, greedy; dashed: the chain)"),
    ("code", '''\
fig, ax = plt.subplots(figsize=(7, 4.5))
plots.plot_acceptance(ax, res.get("accept", []))
plt.show()
for r in res.get("accept", []):
  print(f"{r['source']:>12} {r['mode']:>6} {r['budget'] or '-':>4}: {r['mean_accept_len']:.2f} "
        f"tok/step {r['tokens_per_s']:8.1f} tok/s x{r['speedup_vs_ar']:.2f}")'''),
    ("md", "## Phase breakdown and roofline\n\nEach phase compiled alone at one context "
           "(bench_context_decode.py `--profile_ctx`), next to its roofline floor, the achieved "
           "rate against the measured ceilings, and the attention-kernel measurements."),
    ("code", '''\
for table in res.get("phases", []):
  fig, axs = plt.subplots(1, 3, figsize=(17, 5))
  plots.plot_phases(axs[0], table)
  plots.plot_roofline(axs[1], table, res.get("kernel", []))
  plots.plot_bandwidth(axs[2], table)
  fig.tight_layout()
  plt.show()'''),
    ("code", '''\
for table in res.get("phases", [])[:1]:
  print(f"{table['source']}: ceilings {table['ceil']}")
  for r in table["rows"]:
    tbps, tflops = plots.achieved(r)
    print(f"{r['phase']:>12} {r['ms']:8.3f} ms  floor {r['floor_ms']:7.3f} ms  "
          f"{tbps:5.2f} TB/s {tflops:7.1f} TFLOP/s  {r['pct_roofline']:5.1f}% roof")'''),
    ("md", "## Throughput vs context, and sweeps (if any results have them)"),
    ("code", '''\
if res.get("throughput"):
  fig, ax = plt.subplots(figsize=(7, 4.5))
  plots.plot_throughput(ax, res["throughput"])
  plt.show()
if res.get("sweep"):
  n = len({(r.get("attn_backend"), r["ctx"]) for r in res["sweep"]})
  fig = plt.figure(figsize=(5.5 * min(n, 3), 4.2 * -(-n // 3)))
  plots.plot_sweep(fig, res["sweep"])
  plt.show()
else:
  print("no sweep results: run scripts/sweep.py --json_out X.jsonl and add X.jsonl to EXTRA")'''),
]


def build(cells):
  nb = v4.new_notebook()
  nb.cells = [v4.new_markdown_cell(src, id=f"c{i:02d}") if kind == "md"
              else v4.new_code_cell(src, id=f"c{i:02d}") for i, (kind, src) in enumerate(cells)]
  nb.metadata["kernelspec"] = dict(name="python3", display_name="Python 3", language="python")
  nb.metadata["language_info"] = dict(name="python")
  return nb


def execute(nb, timeout_s=1800):
  """Runs every cell at full size on one CPU device; keeps outputs, drops run timestamps."""
  import nbclient  # pylint: disable=import-outside-toplevel
  os.environ.pop("KDTREE_NB_SMALL", None)
  os.environ.pop("XLA_FLAGS", None)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  nbclient.NotebookClient(nb, kernel_name="python3", timeout=timeout_s,
                          resources={"metadata": {"path": ROOT}}).execute()
  for cell in nb.cells:
    cell.metadata.pop("execution", None)
  return nb


def main():
  run = "--no_execute" not in sys.argv[1:]
  for name, cells in (("01_decode_and_tree.ipynb", DECODE), ("02_benchmarks.ipynb", BENCH)):
    path = os.path.join(HERE, name)
    nb = execute(build(cells)) if run else build(cells)
    nbformat.write(nb, path)
    print(f"wrote {path} ({'executed' if run else 'outputs cleared'})")


if __name__ == "__main__":
  main()
