"""The trained pair: k2tiny target (K2.6 architecture, byte level) + its DFlash draft.

Trained here on the Python standard library (scripts/train_pair_gpu.sh); checkpoints in
checkpoints/k2tiny/{target,draft} (HF formats). Fields: kdtree_jax/run_config.py.
  python scripts/decode.py --config configs/k2tiny.py --mode ddtree --budget 32
"""

from kdtree_jax import run_config


def get_config():
  return run_config.trained_pair()
