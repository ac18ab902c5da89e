"""The decoder: embedding -> layers (MLA + dense MLP / MoE) -> final norm -> untied lm_head.

Two entry points share the layers:
  * `prefill`: a causal prompt from position 0 (naive MLA), writing cache rows [0, S);
  * `decode`: N new tokens at arbitrary positions with an N x N visibility mask, absorbed MLA
    against the dense latent cache (the tree-verify path), writing rows [len, len + N).
Both can return the hidden states after chosen layers (`taps`, the DFlash draft's input).
In `decode` each residual add is made by the next norm (`_add_norm`): at one token per row and
cfg.fused_add_norm both are one kernel launch (`add_norm_kernel`), else XLA's ops as in prefill.
"""

from typing import Sequence

import jax.numpy as jnp

from kdtree_jax.target.cache import LatentCache
from kdtree_jax.target.config import TargetConfig
from kdtree_jax.target import add_norm_kernel, mla
from kdtree_jax.target.mlp import swiglu
from kdtree_jax.target.moe import moe
from kdtree_jax.target.norm import rms_norm


def _ffn(lp, cfg: TargetConfig, x, routes):
  return swiglu(lp["mlp"], x) if "mlp" in lp else moe(lp["moe"], cfg, x, routes)


def _head(params, cfg: TargetConfig, x):
  return _lm_head(params, rms_norm(x, params["final_norm"], cfg.rms_norm_eps))


def _lm_head(params, normed):
  return jnp.dot(normed, params["lm_head"]).astype(jnp.float32)


def _fuses_add_norm(cfg: TargetConfig, x_bnd) -> bool:
  """Whether decode's adds + norms run as `add_norm_kernel` launches: cfg.fused_add_norm, one
  token per row (the ar step; above it XLA already makes each norm one fusion) and a shape the
  kernel takes."""
  b, n, d = x_bnd.shape
  return cfg.fused_add_norm and n == 1 and add_norm_kernel.supports(b, d)


def _add_norm(cfg: TargetConfig, fused: bool, x, h, weight):
  """(x + h, rms_norm(x + h, weight)): the residual add and the norm after it, one kernel
  launch if `fused`, else XLA's ops. h None: no add (the first layer's norm)."""
  if fused:
    return add_norm_kernel.add_rms_norm(x, h, weight, cfg.rms_norm_eps)
  x = x if h is None else x + h
  return x, rms_norm(x, weight, cfg.rms_norm_eps)


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
    h, rows = mla.prefill_attention(lp["attn"], cfg, rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps),
                                    positions)
    x = x + h
    x = x + _ffn(lp, cfg, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), routes)
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
  fused = _fuses_add_norm(cfg, x)
  # The norms between the blocks: each layer's attn_norm, then the final norm; each block's
  # output is added to x by the norm after it.
  norms = [lp["attn_norm"] for lp in params["layers"]] + [params["final_norm"]]
  x, y = _add_norm(cfg, fused, x, None, norms[0])
  taps = {}
  latent = list(cache.latent)
  for i, lp in enumerate(params["layers"]):
    h, latent[i] = mla.absorbed_attention(lp["attn"], cfg, y, positions_bn, latent[i],
                                          cache.lengths, tree_mask_bnn, backend=attn_backend)
    x, y = _add_norm(cfg, fused, x, h, lp["mlp_norm"])
    if moe_inputs is not None and "moe" in lp:
      moe_inputs.append(y)
    x, y = _add_norm(cfg, fused, x, _ffn(lp, cfg, y, routes), norms[i + 1])
    if i in tap_layers:
      taps[i] = x
  return _lm_head(params, y), cache.replace(latent=tuple(latent)), _concat_taps(taps, tap_layers)
