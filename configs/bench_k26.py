"""K2.6 dimensions as ONE GPU holds them under 8-way sharding, random weights, few layers.

Per GPU under tensor=8 / expert=8: 8 of 64 heads, 48 of 384 routed experts (top-8 among them:
the same expert weights read per step as the real EP shard for verify-sized batches; 8x the
expert FLOPs, which are tiny), 1/8 of the vocabulary and of the dense layer's FFN. Layers are
cut to `layers` (1 dense + MoE) to fit and compile fast; per-layer numbers scale to 61 layers.

  python scripts/bench_context_decode.py --config configs/bench_k26.py --ctx 4096,16384,46000
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(checkpoint="", preset="bench_k26", seed=0, layers=4))
  c.draft = ml_collections.ConfigDict(dict(checkpoint="", preset="bench_k26", seed=1))
  c.tokenizer = "none"
  c.dtype = "bfloat16"
  c.attn_backend = "auto"
  c.block_size = 16
  c.budget = 64
  c.forced_accept = 6  # fixed acceptance pattern for timing (random weights accept nothing)
  return c
