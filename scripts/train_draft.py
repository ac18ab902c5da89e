"""Train the DFlash draft against a frozen target checkpoint; write it in the z-lab layout.

  python scripts/train_draft.py --config configs/train_draft.py        # GPU (see the config)
  python scripts/train_draft.py --config configs/train_draft.py:cpu    # reduced CPU run

The training itself: kdtree_jax/train_draft.py.
"""

from absl import flags

from kdtree_jax import cli
from kdtree_jax import train_draft as train

_CONFIG = cli.define_config(None, "configs/train_draft.py (GPU) or configs/train_draft.py:cpu")
_WRITE_SHIPPED = flags.DEFINE_bool("write_checkpoints", False, "Allow --config.out_dir inside "
                                   "checkpoints/ (replaces the shipped model).")


def main(argv):
  del argv
  c = cli.load_config(_CONFIG, "configs/train_draft.py:cpu")
  cli.refuse_shipped_output(c.out_dir, "out_dir", "--write_checkpoints", _WRITE_SHIPPED.value)
  train.train(c)


if __name__ == "__main__":
  cli.run(main)
