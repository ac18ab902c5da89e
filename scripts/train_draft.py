"""Train the k2tiny DFlash draft against the frozen target; write it in the z-lab layout.

  python scripts/train_draft.py --config configs/k2tiny.py        # one H200 (see the config)
  python scripts/train_draft.py --config configs/k2tiny.py:cpu    # reduced CPU run

Reads the config's `train.draft` section (override as --config.train.draft.<field>=value);
the training itself: kdtree_jax/train_draft.py.
"""

from absl import flags

from kdtree_jax import cli
from kdtree_jax import train_draft

_CONFIG = cli.define_config(None, "configs/k2tiny.py (one GPU) or configs/k2tiny.py:cpu")
_WRITE_SHIPPED = flags.DEFINE_bool("write_checkpoints", False, "Allow "
                                   "--config.train.draft.out_dir inside checkpoints/ (replaces "
                                   "the shipped model).")


def main(argv):
  del argv
  c = cli.load_config(_CONFIG, "configs/k2tiny.py:cpu").train.draft
  cli.refuse_shipped_output(c.out_dir, "train.draft.out_dir", "--write_checkpoints",
                            _WRITE_SHIPPED.value)
  train_draft.train(c)


if __name__ == "__main__":
  cli.run(main)
