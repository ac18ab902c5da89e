"""The bench harness on the tiny random pair (CPU smoke test of scripts/bench_context_decode.py)."""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(checkpoint="", preset="tiny", seed=0))
  c.draft = ml_collections.ConfigDict(dict(checkpoint="", preset="tiny", seed=1))
  c.dtype = "float32"
  c.attn_backend = "auto"
  c.block_size = 8
  c.budget = 16
  c.forced_accept = 3
  return c
