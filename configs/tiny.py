"""Tiny random-weight K2-architecture target + DFlash draft: the CPU smoke-test config.

  python scripts/decode.py --config configs/tiny.py --config.mode=ddtree --config.budget=16
Random weights accept almost nothing; the trained pair (decode.py's default) is configs/k2tiny.py.
"""

from kdtree_jax import run_config


def get_config():
  return run_config.decode_config(run_config.model_ref(preset="tiny"),
                                  run_config.model_ref(preset="tiny", seed=1),
                                  tokenizer="bytes", budget=16, max_new_tokens=48, max_len=512)
