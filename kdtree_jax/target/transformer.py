"""The decoder: embedding -> layers (MLA + dense MLP / MoE) -> final norm -> untied lm_head.

Two entry points share the layers:
  * `prefill`: a causal prompt from position 0 (naive MLA), writing cache rows [0, S);
  * `decode`: N new tokens at arbitrary positions with an N x N visibility mask, absorbed MLA
    against the dense latent cache (the tree-verify path), writing rows [len, len + N).
Both can return the hidden states after chosen layers (`taps`, the DFlash draft's input).
"""

from typing import Sequence

import jax.numpy as jnp

from kdtree_jax.target.cache import LatentCache
from kdtree_jax.target.config import TargetConfig
from kdtree_jax.target import mla
from kdtree_jax.target import mlp
from kdtree_jax.target.moe import moe
from kdtree_jax.target.norm import inv_rms, rms_norm
from pallas_kernels import pdl
from pallas_kernels.grouped_matmul.tuning import variant_overrides


def _ffn(lp, cfg: TargetConfig, x, routes):
  """The layer's MLP or MoE on _ffn_input's output."""
  if "moe" in lp:
    return moe(lp["moe"], cfg, x, routes)
  if mlp.reads_unnormalised_input(lp["mlp"]):
    return mlp.swiglu(lp["mlp"], x, inv_rms(x, cfg.rms_norm_eps))
  return mlp.swiglu(lp["mlp"], x)


def _ffn_input(lp, cfg: TargetConfig, x):
  """The FFN's input: x through mlp_norm, or x itself where the norm's gain is folded into the
  dense layer's packed gate | up dot (pack.fold_norm_gains; mlp.swiglu applies its scale)."""
  if mlp.reads_unnormalised_input(lp.get("mlp", {})):
    return x
  return rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)


def _attn_input(lp, cfg: TargetConfig, x):
  """The attention's input: x through attn_norm, or x itself where the norm's gain is folded
  into the packed q_a | kv_a dot (mla.input_dots applies the norm's scale to its output)."""
  if mla.reads_unnormalised_input(lp["attn"]):
    return x
  return rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)


def _head(params, cfg: TargetConfig, x):
  x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  return jnp.dot(x, params["lm_head"]).astype(jnp.float32)


def _concat_taps(taps: dict, tap_layers: Sequence[int]):
  if not tap_layers:
    return None
  return jnp.concatenate([taps[i] for i in tap_layers], axis=-1)


def prefill(cfg: TargetConfig, params, cache: LatentCache | None, tokens_bs,
            tap_layers: Sequence[int] = (), routes: list | None = None):
  """Causal forward of prompts from position 0. Returns (logits [B,S,V] f32, cache, taps).

  Right-padded prompts are fine: row b's valid tokens only see earlier tokens. Cache rows
  [0, S) are written; `cache.lengths` is left for the caller to set to the prompt lengths.
  taps: [B, S, len(tap_layers) * D], hidden states after each listed layer (0-based).
  routes: a list that receives each MoE layer's expert ids [B*S, K], in layer order (or None).
  """
  b, s = tokens_bs.shape
  positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  x = params["embed"][tokens_bs]
  taps = {}
  latent = None if cache is None else list(cache.latent)
  for i, lp in enumerate(params["layers"]):
    h, rows = mla.prefill_attention(lp["attn"], cfg, _attn_input(lp, cfg, x), positions)
    x = x + h
    x = x + _ffn(lp, cfg, _ffn_input(lp, cfg, x), routes)
    if latent is not None:
      latent[i] = latent[i].at[:, :s].set(rows.astype(latent[i].dtype))
    if i in tap_layers:
      taps[i] = x
  if cache is not None:
    cache = cache.replace(latent=tuple(latent))
  return _head(params, cfg, x), cache, _concat_taps(taps, tap_layers)


def decode(cfg: TargetConfig, params, cache: LatentCache, tokens_bn, positions_bn, tree_mask_bnn,
           tap_layers: Sequence[int] = (), *, attn_backend="auto", routes: list | None = None,
           moe_inputs: list | None = None):
  """N new tokens against the cache (absorbed MLA). Returns (logits [B,N,V] f32, cache, taps).

  The tokens' latent rows are written at [len, len + N); `cache.lengths` is NOT advanced:
  the caller commits (see `cache.compact_rows`) or simply advances lengths for a chain.
  routes: as in `prefill`. moe_inputs: a list receiving each MoE layer's input [B, N, D] (the
  phase profiler times the MoE layers alone on the step's own routing), or None.
  """
  x = params["embed"][tokens_bn]
  taps = {}
  latent = list(cache.latent)
  # The layers' Mosaic kernels: PDL (pallas_kernels/pdl.py) and the expert calls' variants.
  with pdl.model_default(cfg.mosaic_pdl), variant_overrides(cfg.expert_variants):
    for i, lp in enumerate(params["layers"]):
      h, latent[i] = mla.absorbed_attention(
          lp["attn"], cfg, _attn_input(lp, cfg, x), positions_bn, latent[i],
          cache.lengths, tree_mask_bnn, backend=attn_backend)
      x = x + h
      y = _ffn_input(lp, cfg, x)
      if moe_inputs is not None and "moe" in lp:
        moe_inputs.append(y)
      x = x + _ffn(lp, cfg, y, routes)
      if i in tap_layers:
        taps[i] = x
  return _head(params, cfg, x), cache.replace(latent=tuple(latent)), _concat_taps(taps, tap_layers)
