"""Train the k2tiny target (K2.6 architecture, byte level) on the stdlib corpus, in HF format.

  python scripts/train_target.py --config configs/k2tiny.py        # one H200 (see the config)
  python scripts/train_target.py --config configs/k2tiny.py:cpu    # reduced CPU run

Reads the config's `train.target` section (override as --config.train.target.<field>=value);
the training itself: kdtree_jax/train_target.py.
"""

from absl import flags

from kdtree_jax import cli
from kdtree_jax import train_target

_CONFIG = cli.define_config(None, "configs/k2tiny.py (one GPU) or configs/k2tiny.py:cpu")
_WRITE_SHIPPED = flags.DEFINE_bool("write_checkpoints", False, "Allow "
                                   "--config.train.target.out_dir inside checkpoints/ (replaces "
                                   "the shipped model).")


def main(argv):
  del argv
  c = cli.load_config(_CONFIG, "configs/k2tiny.py:cpu").train.target
  cli.refuse_shipped_output(c.out_dir, "train.target.out_dir", "--write_checkpoints",
                            _WRITE_SHIPPED.value)
  train_target.train(c)


if __name__ == "__main__":
  cli.run(main)
