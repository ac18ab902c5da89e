"""Plot training / held-out loss curves from the JSON-lines logs of the training scripts.

  python scripts/plot_losses.py --logs runs/k2tiny/target/log.jsonl,runs/k2tiny/draft/log.jsonl \
      --out losses.png
"""

import json
import os

from absl import flags
import matplotlib

from kdtree_jax import cli

matplotlib.use("Agg")
import matplotlib.pyplot as plt

_LOGS = flags.DEFINE_list("logs", None, "Comma-separated log.jsonl paths (one panel each).",
                          required=True)
_OUT = flags.DEFINE_string("out", "losses.png", "Output PNG.")
_SMOOTH = flags.DEFINE_integer("smooth", 5, "Moving-average window over train-loss records.")


def read(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def moving_average(xs, k):
  out = []
  for i in range(len(xs)):
    window = xs[max(0, i - k + 1):i + 1]
    out.append(sum(window) / len(window))
  return out


def title(path):
  """runs/k2tiny/target/log.jsonl -> "target"; out/draft_log.jsonl -> "draft_log"."""
  name = os.path.basename(path)
  if name == "log.jsonl":
    return os.path.basename(os.path.dirname(os.path.abspath(path)))
  return os.path.splitext(name)[0]


def panel(ax, path, smooth):
  """Train loss (smoothed), held-out loss, and the draft's held-out prefix length if logged."""
  recs = read(path)
  train = [r for r in recs if "loss" in r]
  evals = [r for r in recs if "eval_loss" in r]
  ax.plot([r["step"] for r in train], moving_average([r["loss"] for r in train], smooth),
          label="train loss")
  ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out loss")
  ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title=title(path))
  ax.grid(alpha=0.3)
  if evals and "eval_prefix_len" in evals[0]:
    ax2 = ax.twinx()
    ax2.plot([r["step"] for r in evals], [r["eval_prefix_len"] for r in evals], "s--", color="C2",
             label="held-out prefix len")
    ax2.set_ylabel("1 + leading correct block tokens")
    ax2.legend(loc="center right")
  ax.legend(loc="upper right")


def main(argv):
  del argv
  fig, axes = plt.subplots(1, len(_LOGS.value), figsize=(6 * len(_LOGS.value), 4), squeeze=False)
  for ax, path in zip(axes[0], _LOGS.value):
    panel(ax, path, _SMOOTH.value)
  fig.tight_layout()
  fig.savefig(_OUT.value, dpi=120)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
