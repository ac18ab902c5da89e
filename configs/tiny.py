"""Tiny random-weight K2-architecture target + DFlash draft: the CPU smoke-test config.

  python scripts/decode.py --config configs/tiny.py --mode ddtree --budget 16
Random weights accept almost nothing; the trained pair is configs/default.py.
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(checkpoint="", preset="tiny", seed=0))
  c.draft = ml_collections.ConfigDict(dict(checkpoint="", preset="tiny", seed=1))
  c.tokenizer = "bytes"
  c.mode = "ddtree"
  c.budget = 16
  c.max_new_tokens = 48
  c.max_len = 512
  c.temperature = 0.0
  c.top_k = 0
  c.top_p = 1.0
  c.seed = 0
  c.dtype = "float32"
  c.attn_backend = "auto"
  c.prompt = "def fibonacci(n):\n"
  c.mesh = ""
  return c
