"""Plots measured results: acceptance vs budget, throughput vs context, phases, roofline, sweeps.

Reads JSON lines of eval_acceptance.py, bench_context_decode.py (kinds phases / throughput),
sweep.py and pallas_kernels/tree_verify/bench.py, and the printed text of the first two
(results/*.txt).

  python scripts/plot_results.py --out_dir runs/plots                 # everything in results/
  python scripts/plot_results.py --inputs runs/sweep.jsonl,runs/ctx.jsonl --out_dir runs/plots
"""

import os

from absl import flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kdtree_jax import cli, plots

_INPUTS = flags.DEFINE_list("inputs", None, "Result files (default: .jsonl/.txt in results/).")
_OUT = flags.DEFINE_string("out_dir", "plots", "Directory for the PNGs.")
_METRIC = flags.DEFINE_enum("sweep_metric", "tokens_per_s", ["tokens_per_s", "ms_per_step"],
                            "Heatmap value of sweep rows.")


def _save(fig, name):
  path = os.path.join(_OUT.value, name)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  print(f"wrote {path}")
  return path


def render(res, metric="tokens_per_s"):
  """Every plot the loaded results allow; returns the written paths."""
  out = []
  if res.get("accept"):
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    plots.plot_acceptance(ax, res["accept"])
    fig.tight_layout()
    out.append(_save(fig, "acceptance.png"))
  if res.get("throughput"):
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    plots.plot_throughput(ax, res["throughput"])
    fig.tight_layout()
    out.append(_save(fig, "throughput.png"))
  for i, table in enumerate(t for t in res.get("phases", []) if t["rows"]):
    fig, axs = plt.subplots(1, 3, figsize=(17, 5))
    plots.plot_phases(axs[0], table)
    plots.plot_roofline(axs[1], table, res.get("kernel", []))
    plots.plot_bandwidth(axs[2], table)
    fig.tight_layout()
    out.append(_save(fig, f"phases_{table['source']}_{table['mode']}_{table['ctx']}_{i}.png"))
  if res.get("moe"):
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    plots.plot_moe(ax, res["moe"])
    fig.tight_layout()
    out.append(_save(fig, "moe.png"))
  if res.get("sweep"):
    n = len({(r.get("attn_backend"), r["ctx"]) for r in res["sweep"]})
    fig = plt.figure(figsize=(5.5 * min(n, 3), 4.2 * -(-n // 3)))
    plots.plot_sweep(fig, res["sweep"], metric)
    out.append(_save(fig, f"sweep_{metric}.png"))
  return out


def main(_):
  paths = _INPUTS.value or plots.find_results("results")
  res = plots.load(paths)
  counts = ", ".join(f"{k}: {len(v)}" for k, v in sorted(res.items()))
  print(f"read {counts} from {len(paths)} files")
  os.makedirs(_OUT.value, exist_ok=True)
  if not render(res, _METRIC.value):
    print("nothing to plot")


if __name__ == "__main__":
  cli.run(main)
