"""The bench harness on the tiny random pair (CPU smoke test of scripts/bench_context_decode.py
and scripts/bench_k26_full.py). Fields: kdtree_jax/run_config.py (bench_config)."""

from kdtree_jax import run_config


def get_config():
  return run_config.bench_config(
      run_config.model_ref(preset="tiny", seed=0), run_config.model_ref(preset="tiny", seed=1),
      block_size=8, forced_accept=3, dtype="float32", attn_backend="auto", budget=16,
      mode="ddtree", max_len=512,
      bench=dict(modes=["ar", "chain", "ddtree"], budget=7, ctxs=[32, 64], gen=2, profile_ctx=64,
                 profile_budgets=[7, 3], prompt_len=16, reps=2, compile_box_s=120.0,
                 phase_modes="ar,ddtree"))
