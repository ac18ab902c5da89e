"""K2.6 dimensions as ONE GPU holds them under 8-way sharding, random weights, few layers.

Per GPU under tensor=8 / expert=8: 8 of 64 heads, 48 of 384 routed experts (top-8 among them:
the same expert weights read per step as the real EP shard for verify-sized batches; 8x the
expert FLOPs, which are tiny), 1/8 of the vocabulary and of the dense layer's FFN. Layers are
cut to `layers` (1 dense + MoE) to fit and compile fast; per-layer numbers scale to 61 layers.

  python scripts/bench_context_decode.py --config configs/bench_k26.py --ctx 4096,16384,46000
"""

from kdtree_jax import run_config


def get_config():
  return run_config.bench_config(
      run_config.model_ref(preset="bench_k26", seed=0, layers=4),
      run_config.model_ref(preset="bench_k26", seed=1),
      block_size=16, budget=64, tokenizer="none", dtype="bfloat16", attn_backend="auto",
      forced_accept=6)  # fixed acceptance pattern for timing (random weights accept nothing)
