"""Kimi K2.6 (full size). Needs the real checkpoint and 8 x H200:

  python scripts/decode.py --config configs/kimi_k2_6.py --config.target.checkpoint /path/Kimi-K2.6 \
      --config.draft.checkpoint /path/K2.6-DFlash --mesh tensor=8
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(checkpoint="", preset="kimi_k2_6", seed=0))
  c.draft = ml_collections.ConfigDict(dict(checkpoint="", preset="", seed=1))
  c.tokenizer = "tiktoken"
  c.mode = "ddtree"
  c.budget = 64
  c.max_new_tokens = 256
  c.max_len = 65536
  c.temperature = 0.0
  c.top_k = 0
  c.top_p = 1.0
  c.seed = 0
  c.dtype = "bfloat16"
  c.attn_backend = "auto"
  c.prompt = "Write a haiku about speculative decoding."
  c.mesh = "tensor=8"
  return c
