"""Random-weight models of what ONE GPU holds of Kimi K2.6 + its DFlash draft under S-way
tensor x expert parallelism (benchmarks; configs/bench_k26_full.py).

Per GPU of S: 64/S attention heads; the router scores all 384 experts and this GPU holds the first
384/S (`num_local_experts`), as INT4 stacks (int4 + bf16 group-32 scales); the shared expert, the
dense layer's MLP and the vocabulary (embedding and head) sliced 1/S. The draft has the published
Kimi-K2.5/K2.6 DFlash shape (z-lab/Kimi-K2.5-DFlash: hidden 7168, 6 full-attention layers, 64 query
/ 8 KV heads of 128, FFN 18432, block 16, taps of the default rule over 61 target layers) with its
heads and FFN sliced 1/S; its `fc` and norms stay whole.
"""

import jax

from kdtree_jax.target import config as model_config
from kdtree_jax.draft.config import DraftConfig, build_target_layer_ids
from kdtree_jax.draft.model import init_draft_params
from kdtree_jax.target import params as params_lib

TARGET_PRESETS = ("k26_share",)
DRAFT_PRESETS = ("k26_dflash_share",)


def k26_share(layers: int = 61, shards: int = 8) -> model_config.TargetConfig:
  """One GPU's share of K2.6 under `shards`-way tensor x expert parallelism, `layers` deep."""
  full = model_config.kimi_k2_6()
  for name, n in (("heads", full.num_attention_heads), ("experts", full.n_routed_experts),
                  ("vocab", full.vocab_size), ("dense FFN", full.intermediate_size),
                  ("shared FFN", full.moe_intermediate_size * full.n_shared_experts)):
    if n % shards:
      raise ValueError(f"K2.6's {n} {name} do not split {shards} ways; use shards in 1, 2, 4, 8")
  return full.replace(
      num_hidden_layers=layers, num_attention_heads=full.num_attention_heads // shards,
      num_local_experts=full.n_routed_experts // shards, vocab_size=full.vocab_size // shards,
      intermediate_size=full.intermediate_size // shards,
      shared_intermediate_size=full.moe_intermediate_size * full.n_shared_experts // shards,
      weight_prefix="")


def k26_dflash_share(tcfg, shards: int = 8) -> DraftConfig:
  """The published K2.5/K2.6 DFlash draft shape, heads and FFN sliced 1/shards, for `tcfg`."""
  n = tcfg.num_hidden_layers
  taps = tuple(sorted({min(i, n - 1) for i in build_target_layer_ids(61, 6)}))
  return DraftConfig.tiny(
      hidden_size=tcfg.hidden_size, num_hidden_layers=6, num_attention_heads=64 // shards,
      num_key_value_heads=max(1, 8 // shards), head_dim=128, intermediate_size=18432 // shards,
      rope_theta=tcfg.rope_theta, rms_norm_eps=tcfg.rms_norm_eps, vocab_size=tcfg.vocab_size,
      mask_token_id=tcfg.vocab_size - 1, num_target_layers=n, target_layer_ids=taps,
      block_size=16, layer_types=("full_attention",) * 6)


def load_target(c, dtype, mesh=None):
  """(TargetConfig, params) of a `k26_share` run-config entry (fields: layers, shards,
  int4_experts, seed; int4_k_interleaved: TargetConfig's, the decode pack's expert layout, for
  the GPU A/B `--config.target.int4_k_interleaved=true`)."""
  if mesh is not None:
    raise ValueError(f"preset {c.preset!r} is one GPU's share of K2.6; run it without --mesh")
  cfg = k26_share(c.get("layers", 61), c.get("shards", 8)).replace(
      int4_k_interleaved=bool(c.get("int4_k_interleaved",
                                    model_config.TargetConfig.int4_k_interleaved)))
  return cfg, params_lib.init_params(jax.random.key(c.seed), cfg, dtype,
                                     int4_experts=c.get("int4_experts", True))


def load_draft(c, tcfg, dtype, mesh=None):
  """(DraftConfig, params) of a `k26_dflash_share` run-config entry (fields: shards, seed)."""
  if mesh is not None:
    raise ValueError(f"preset {c.preset!r} is one GPU's share of a draft; run it without --mesh")
  dcfg = k26_dflash_share(tcfg, c.get("shards", 8))
  return dcfg, init_draft_params(jax.random.key(c.seed), dcfg, tcfg.hidden_size, dcfg.n_taps,
                                 dtype)
