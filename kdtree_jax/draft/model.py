"""DFlash draft forward: pure functions over a params pytree (Qwen3-style layers).

Letters: B batch, T new ctx tokens, C cache rows, S block tokens, A anchors, D hidden,
H query heads, G kv heads, E head_dim, F ffn, V vocab, Y draft layers.

Params (HF Linear [out, in] stored as [in, out]; per-layer tensors stacked on a leading Y):
  fc [n_tap*D, D], hidden_norm [D], norm [D], layers: q_proj [Y, D, H*E], k_proj / v_proj
  [Y, D, G*E], o_proj [Y, H*E, D], q_norm / k_norm [Y, E], input_layernorm /
  post_attention_layernorm [Y, D], gate_proj / up_proj [Y, D, F], down_proj [Y, F, D].

Attention rule (z-lab inference, SpecForge training): a block query at position p sees ctx
keys of committed tokens at positions < the block start, and the block's own keys (all of
them; only earlier ones in causal layers: sliding layers unless config.is_causal says
otherwise). Sliding layers additionally keep only keys with p - key_pos < sliding_window
(left bound only, as SpecForge; z-lab adds a right bound that bites only if window < block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kdtree_jax.draft.config import DraftConfig


@struct.dataclass
class DraftCache:
  """Dense draft ctx K/V: k, v = one [B, C, G, E] buffer per draft layer (k normed + roped),
  pos [B, C], ctx_len [B]. Separate per-layer buffers are written in place (see cache.py)."""

  k: tuple
  v: tuple
  pos: jax.Array
  ctx_len: jax.Array


def init_draft_cache(cfg: DraftConfig, batch: int, max_ctx: int, dtype=jnp.bfloat16) -> DraftCache:
  """Empty cache. Keep max_ctx >= longest context + T (materialize writes T rows at ctx_len)."""
  shape = (batch, max_ctx, cfg.num_key_value_heads, cfg.head_dim)
  layers = range(cfg.num_hidden_layers)
  return DraftCache(k=tuple(jnp.zeros(shape, dtype) for _ in layers),
                    v=tuple(jnp.zeros(shape, dtype) for _ in layers),
                    pos=jnp.zeros((batch, max_ctx), jnp.int32),
                    ctx_len=jnp.zeros((batch,), jnp.int32))


def init_draft_params(rng, cfg: DraftConfig, target_hidden: int, n_taps: int, dtype=jnp.float32):
  """Random init (normal 0.02 linears, unit norms) for training from scratch."""
  _check_target(cfg, target_hidden)
  if n_taps != cfg.n_taps:
    raise ValueError(f"{n_taps=} != len(cfg.target_layer_ids)={cfg.n_taps}")
  D, Y, E, F = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.intermediate_size
  HE, GE = cfg.num_attention_heads * E, cfg.num_key_value_heads * E
  shapes = dict(q_proj=(Y, D, HE), k_proj=(Y, D, GE), v_proj=(Y, D, GE), o_proj=(Y, HE, D),
                gate_proj=(Y, D, F), up_proj=(Y, D, F), down_proj=(Y, F, D))
  keys = jax.random.split(rng, len(shapes) + 1)
  normal = lambda k, s: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(dtype)
  layers = {n: normal(k, s) for (n, s), k in zip(shapes.items(), keys[1:])}
  for n, d in (("q_norm", E), ("k_norm", E), ("input_layernorm", D), ("post_attention_layernorm", D)):
    layers[n] = jnp.ones((Y, d), dtype)
  return dict(fc=normal(keys[0], (n_taps * D, D)), hidden_norm=jnp.ones((D,), dtype),
              norm=jnp.ones((D,), dtype), layers=layers)


def _check_target(cfg: DraftConfig, target_hidden: int):
  """The draft reads target embeddings / taps directly: hidden sizes must match."""
  if target_hidden != cfg.hidden_size:
    raise ValueError(f"draft hidden_size={cfg.hidden_size} != target hidden size {target_hidden}; "
                     "DFlash shares the target's embedding and lm_head, so they must be equal")


def rms_norm(x, w, eps):
  """Qwen3RMSNorm: statistics in f32, cast back, then scale."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return w * y.astype(x.dtype)


def rope(x_bshe, pos_bs, theta):
  """NeoX / rotate_half RoPE at integer positions (f32 math)."""
  E = x_bshe.shape[-1]
  inv = 1.0 / (theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E))
  ang = pos_bs.astype(jnp.float32)[..., None] * inv
  cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[:, :, None]
  sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[:, :, None]
  xf = x_bshe.astype(jnp.float32)
  rot = jnp.concatenate([-xf[..., E // 2:], xf[..., : E // 2]], -1)
  return (xf * cos + rot * sin).astype(x_bshe.dtype)


def context_feature(params, cfg: DraftConfig, taps_btf):
  """c = hidden_norm(fc(concat taps)) [B, T, D]."""
  want = cfg.n_taps * cfg.hidden_size
  if taps_btf.shape[-1] != want:
    raise ValueError(f"taps last dim {taps_btf.shape[-1]} != n_taps*hidden = {want}")
  return rms_norm(taps_btf.astype(params["fc"].dtype) @ params["fc"], params["hidden_norm"],
                  cfg.rms_norm_eps)


def _kv(lp, cfg, x_btd, pos_bt):
  """One layer's K (k_norm + rope) and V [B, T, G, E] from inputs x."""
  B, T, _ = x_btd.shape
  k = (x_btd @ lp["k_proj"]).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
  v = (x_btd @ lp["v_proj"]).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
  k = rope(rms_norm(k, lp["k_norm"], cfg.rms_norm_eps), pos_bt, cfg.rope_theta)
  return k, v


def _layer_params(params, i):
  """Layer i's slice of the stacked layer params."""
  return jax.tree.map(lambda a: a[i], params["layers"])


def materialize_context(params, cfg: DraftConfig, cache: DraftCache, taps_btf, positions_bt,
                        num_valid_b) -> DraftCache:
  """Append ctx K/V of T new committed tokens at rows [ctx_len, ctx_len+T); ctx_len += num_valid."""
  c = context_feature(params, cfg, taps_btf)
  ks, vs = zip(*(_kv(_layer_params(params, i), cfg, c, positions_bt)
                 for i in range(cfg.num_hidden_layers)))

  def put(dst_cge, src_tge, at):
    return jax.lax.dynamic_update_slice(dst_cge, src_tge.astype(dst_cge.dtype), (at, 0, 0))

  put_b = jax.vmap(put)
  pos = jax.vmap(lambda p, s, at: jax.lax.dynamic_update_slice(p, s, (at,)))(
      cache.pos, positions_bt.astype(jnp.int32), cache.ctx_len)
  return DraftCache(k=tuple(put_b(d, s, cache.ctx_len) for d, s in zip(cache.k, ks)),
                    v=tuple(put_b(d, s, cache.ctx_len) for d, s in zip(cache.v, vs)),
                    pos=pos, ctx_len=cache.ctx_len + num_valid_b.astype(jnp.int32))


def _window_ok(q_pos, k_pos, window):
  """Sliding-window visibility |q_pos - k_pos| < window (all True for full attention)."""
  return jnp.ones_like(q_pos - k_pos, bool) if window is None else jnp.abs(q_pos - k_pos) < window


def _attend(q_bshe, k_bkge, v_bkge, mask_bsk):
  """GQA softmax attention in f32 -> [B, S, H*E]."""
  B, S, H, E = q_bshe.shape
  G = k_bkge.shape[2]
  q = q_bshe.reshape(B, S, G, H // G, E).astype(jnp.float32)
  s = jnp.einsum("bsgre,bkge->bgrsk", q, k_bkge.astype(jnp.float32)) * E ** -0.5
  s = jnp.where(mask_bsk[:, None, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("bgrsk,bkge->bsgre", p, v_bkge.astype(jnp.float32))
  return o.reshape(B, S, H * E).astype(q_bshe.dtype)


def _layer(lp, cfg, x_bsd, q_pos_bs, ctx_k, ctx_v, ctx_ok_bsc, blk_ok_bss):
  """One draft decoder layer: block queries over [ctx keys | block keys]."""
  B, S, _ = x_bsd.shape
  h = rms_norm(x_bsd, lp["input_layernorm"], cfg.rms_norm_eps)
  q = (h @ lp["q_proj"]).reshape(B, S, cfg.num_attention_heads, cfg.head_dim)
  q = rope(rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), q_pos_bs, cfg.rope_theta)
  kb, vb = _kv(lp, cfg, h, q_pos_bs)
  k = jnp.concatenate([ctx_k.astype(kb.dtype), kb], axis=1)
  v = jnp.concatenate([ctx_v.astype(vb.dtype), vb], axis=1)
  o = _attend(q, k, v, jnp.concatenate([ctx_ok_bsc, blk_ok_bss], axis=-1))
  x_bsd = x_bsd + o @ lp["o_proj"]
  h = rms_norm(x_bsd, lp["post_attention_layernorm"], cfg.rms_norm_eps)
  return x_bsd + (jax.nn.silu(h @ lp["gate_proj"]) * (h @ lp["up_proj"])) @ lp["down_proj"]


def _logits(params, cfg, x_bsd, head_dv):
  """Final norm, the target lm_head, optional multiplier / softcap; f32."""
  x = rms_norm(x_bsd, params["norm"], cfg.rms_norm_eps)
  logits = jnp.dot(x, head_dv.astype(x.dtype), preferred_element_type=jnp.float32)
  logits = logits * cfg.output_multiplier
  cap = cfg.final_logit_softcapping
  return logits if not cap else jnp.tanh(logits / cap) * cap


def _embed(params, cfg, tokens, embed_vd):
  """Target embedding of block tokens in the draft's dtype."""
  _check_target(cfg, embed_vd.shape[-1])
  return embed_vd[tokens].astype(params["fc"].dtype)


def _block_mask(cfg, i, q_pos_bs, k_pos_bs, same_bss):
  """Block-key visibility for layer i: same block, causal if the layer is, within window."""
  ok = same_bss & _window_ok(q_pos_bs[:, :, None], k_pos_bs[:, None, :], cfg.window(i))
  if cfg.causal(i):
    ok = ok & (k_pos_bs[:, None, :] <= q_pos_bs[:, :, None])
  return ok


def make_block(cfg: DraftConfig, bonus_b):
  """Block tokens [B, block_size] = [bonus, MASK x (block_size-1)]."""
  if cfg.mask_token_id is None:
    raise ValueError("draft config has no mask_token_id (dflash_config.mask_token_id)")
  B = bonus_b.shape[0]
  mask = jnp.full((B, cfg.block_size - 1), cfg.mask_token_id, jnp.int32)
  return jnp.concatenate([bonus_b.astype(jnp.int32)[:, None], mask], axis=1)


def draft_block(params, cfg: DraftConfig, cache: DraftCache, block_tokens_bs, start_b, embed_vd,
                head_dv):
  """One non-causal block [bonus, MASK...] at positions start.. over the ctx cache -> [B, S, V] f32."""
  B, S = block_tokens_bs.shape
  x = _embed(params, cfg, block_tokens_bs, embed_vd)
  q_pos = start_b.astype(jnp.int32)[:, None] + jnp.arange(S, dtype=jnp.int32)
  C = cache.k[0].shape[1]
  live = (jnp.arange(C)[None, None, :] < cache.ctx_len[:, None, None])
  same = jnp.ones((B, S, S), bool)
  for i in range(cfg.num_hidden_layers):
    ctx_ok = live & _window_ok(q_pos[:, :, None], cache.pos[:, None, :], cfg.window(i))
    blk_ok = _block_mask(cfg, i, q_pos, q_pos, same)
    x = _layer(_layer_params(params, i), cfg, x, q_pos, cache.k[i], cache.v[i], ctx_ok, blk_ok)
  return _logits(params, cfg, x, head_dv)


def draft_train_forward(params, cfg: DraftConfig, ctx_taps_bsf, anchors_ba, block_tokens_bak,
                        embed_vd, head_dv):
  """Training forward (DFlash recipe): A blocks per row, one masked attention -> [B, A, K, V] f32.

  Block a sits at positions anchors[a] + 0..K-1; it sees ctx keys at positions < anchors[a]
  (ctx row j = position j) and its own block keys; nothing else.
  """
  B, Sc, _ = ctx_taps_bsf.shape
  _, A, K = block_tokens_bak.shape
  c = context_feature(params, cfg, ctx_taps_bsf)
  ctx_pos = jnp.broadcast_to(jnp.arange(Sc, dtype=jnp.int32), (B, Sc))
  x = _embed(params, cfg, block_tokens_bak.reshape(B, A * K), embed_vd)
  anchor_q = jnp.repeat(anchors_ba.astype(jnp.int32), K, axis=1)  # [B, A*K]
  q_pos = anchor_q + jnp.tile(jnp.arange(K, dtype=jnp.int32), A)
  blk_id = jnp.repeat(jnp.arange(A), K)
  same = jnp.broadcast_to(blk_id[:, None] == blk_id[None, :], (B, A * K, A * K))
  before = ctx_pos[:, None, :] < anchor_q[:, :, None]
  for i in range(cfg.num_hidden_layers):
    lp = _layer_params(params, i)
    ctx_k, ctx_v = _kv(lp, cfg, c, ctx_pos)
    ctx_ok = before & _window_ok(q_pos[:, :, None], ctx_pos[:, None, :], cfg.window(i))
    blk_ok = _block_mask(cfg, i, q_pos, q_pos, same)
    x = _layer(lp, cfg, x, q_pos, ctx_k, ctx_v, ctx_ok, blk_ok)
  return _logits(params, cfg, x, head_dv).reshape(B, A, K, -1)
