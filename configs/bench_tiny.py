"""The bench harness on the tiny random pair (CPU smoke test of scripts/bench_context_decode.py
and scripts/bench_k26_full.py)."""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(checkpoint="", preset="tiny", seed=0))
  c.draft = ml_collections.ConfigDict(dict(checkpoint="", preset="tiny", seed=1))
  c.dtype = "float32"
  c.attn_backend = "auto"
  c.block_size = 8
  c.budget = 16
  c.mode = "ddtree"
  c.max_len = 512
  c.forced_accept = 3
  c.bench = ml_collections.ConfigDict(dict(
      modes=["ar", "chain", "ddtree"], budget=7, ctxs=[32, 64], gen=2, profile_ctx=64,
      profile_budgets=[7, 3], prompt_len=16, reps=2, compile_box_s=120.0))
  return c
