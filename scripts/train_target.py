"""Train the small K2.6-architecture target on the stdlib corpus; write it in HF format.

  python scripts/train_target.py --config configs/train_target.py        # GPU (see the config)
  python scripts/train_target.py --config configs/train_target.py:cpu    # reduced CPU run

The training itself: kdtree_jax/train_target.py.
"""

from absl import flags

from kdtree_jax import cli
from kdtree_jax import train_target as train

_CONFIG = cli.define_config(None, "configs/train_target.py (GPU) or configs/train_target.py:cpu")
_WRITE_SHIPPED = flags.DEFINE_bool("write_checkpoints", False, "Allow --config.out_dir inside "
                                   "checkpoints/ (replaces the shipped model).")


def main(argv):
  del argv
  c = cli.load_config(_CONFIG, "configs/train_target.py:cpu")
  cli.refuse_shipped_output(c.out_dir, "out_dir", "--write_checkpoints", _WRITE_SHIPPED.value)
  train.train(c)


if __name__ == "__main__":
  cli.run(main)
