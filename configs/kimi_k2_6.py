"""Kimi K2.6 (full size). Needs the real checkpoint and 8 x H200:

  python scripts/decode.py --config configs/kimi_k2_6.py --config.target.checkpoint /path/Kimi-K2.6 \
      --config.draft.checkpoint /path/K2.6-DFlash --config.mesh=tensor=8
"""

from kdtree_jax import run_config


def get_config():
  return run_config.decode_config(
      run_config.model_ref(preset="kimi_k2_6"), run_config.model_ref(seed=1),
      tokenizer="auto", budget=64, max_new_tokens=256, max_len=65536, dtype="bfloat16",
      prompt="Write a haiku about speculative decoding.", mesh="tensor=8")
