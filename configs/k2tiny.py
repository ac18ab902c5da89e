"""The trained pair: k2tiny target (K2.6 architecture, byte level) + its DFlash draft.

Trained here on the Python standard library (scripts/train_pair_gpu.sh) on 512-token sequences;
checkpoints in checkpoints/k2tiny/{target,draft} (HF formats). The target's config.json claims
2048 positions (YaRN x4 over 512), but it never saw a position past 511: this config caps
max_len at 512 and sets trained_positions=512, so decode.py warns if a run goes beyond.
Fields: kdtree_jax/run_config.py.
  python scripts/decode.py --config configs/k2tiny.py --mode ddtree --budget 32
"""

from kdtree_jax import run_config


def get_config():
  return run_config.trained_pair()
