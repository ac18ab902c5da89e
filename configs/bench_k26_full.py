"""One GPU's share of Kimi K2.6 at FULL depth under 8-way tensor x expert parallelism.

61 layers (1 dense + 60 MoE), 8 of 64 heads, a router over all 384 experts with the first 48 held
here as INT4 stacks, shared expert / dense MLP / vocabulary sliced 1/8, and the published K2.6
DFlash draft shape sliced the same way (kdtree_jax/bench_models.py); random weights, fixed
acceptance (`forced_accept`). Plan the memory first (one device), then run the bench:

  python scripts/plan_memory.py --config configs/bench_k26_full.py --mesh data=1 --max_len 135168
  python scripts/bench_k26_full.py --config configs/bench_k26_full.py --out_dir runs/k26_full
"""

from kdtree_jax import run_config


def get_config():
  return run_config.bench_config(
      run_config.model_ref(preset="k26_share", seed=0, layers=61, shards=8, int4_experts=True,
                           int4_k_interleaved=True),  # False: K-packed experts (the A/B, no kpi)
      run_config.model_ref(preset="k26_dflash_share", seed=1, shards=8),
      tokenizer="none", dtype="bfloat16", attn_backend="auto", block_size=16, budget=15,
      mode="ddtree",  # plan_memory.py: the verify width it plans activations for
      max_len=135168,  # 128k context + rows for the timed steps
      forced_accept=6,  # fixed acceptance pattern for timing (random weights accept nothing)
      bench=dict(
          modes=["ar", "chain", "ddtree"], budget=15,        # compile + throughput
          ctxs=[4096, 16384, 46000, 131072], gen=16,         # throughput vs context
          profile_ctx=46000, profile_budgets=[15, 7, 31, 63],  # phase tables (ar first, always)
          prompt_len=1024, reps=10, compile_box_s=240.0,
          pack_draft=True,  # the draft's decode layout (False: per-layer weights, A/B)
          draft_token_qkv=False,  # True: draft.model.pack_token_qkv's layer-0 table (A/B)
          tree_impl="auto"))  # SpecConfig's: the Triton builder on a GPU to budget 34 ('xla': A/B)
