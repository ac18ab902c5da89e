"""The trained pair: k2tiny target (K2.6 architecture, byte level) + its DFlash draft.

Trained here on the Python standard library on 512-token sequences (one H200:
`bash scripts/gpu_measure.sh OUT train_pair`); checkpoints in checkpoints/k2tiny/{target,draft}
(HF formats). The target's config.json claims 2048 positions (YaRN x4 over 512), but it never saw
a position past 511: this config caps max_len at 512 and sets trained_positions=512, so decode.py
warns if a run goes beyond. scripts/decode.py's default config. Fields: kdtree_jax/run_config.py.
  python scripts/decode.py --config configs/k2tiny.py --config.mode=ddtree --config.budget=32
"""

from kdtree_jax import run_config


def get_config():
  return run_config.trained_pair()
