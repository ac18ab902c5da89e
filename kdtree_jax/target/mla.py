"""Multi-head latent attention (MLA): naive causal prefill and absorbed tree/decode attention.

Letters: B batch, S/N tokens, H heads, D hidden, R kv_lora_rank (latent), P rope dim,
Dn qk_nope dim, Dv value dim, C = R + P latent cache width, L cache rows.
Weights: q_a [D, Rq], q_b [Rq, H, Dn+P] (or q [D, H, Dn+P]), kv_a [D, R+P], kv_b [R, H, Dn+Dv],
o [H, Dv, D]; packed (target/pack.py, out-major): qkv_a_t [Rq+R+P, D], q_b_t [H*(Dn+P), Rq],
w_qc_t [H, R+P, Dn+P], w_uv [H, Dv, R], o_t [D, H*Dv] in place of q_a (or q), kv_a, q_b, kv_b, o;
with the norm gains folded (pack.fold_norm_gains) qkv_a_t_folded and q_b_t_folded instead.
"""

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from kdtree_jax import sharding
from kdtree_jax.target.config import TargetConfig
from kdtree_jax.target.norm import inv_rms, rms_norm
from kdtree_jax.target.pack import dot_t, folded_dot_t
from kdtree_jax.target import rope
from kdtree_jax.target.rope import apply_rope, cos_sin
from pallas_kernels.tree_verify.api import resolve_backend


def input_dots(p, cfg: TargetConfig, x_bsd):
  """(q_in, kv_a_out, mean squares): x @ q_a [B, S, Rq] (or the queries [B, S, H, Dn + P]
  without the q LoRA) and x @ kv_a [B, S, R + P]; one dot over p["qkv_a_t"] ((q_a | kv_a)^T,
  target/pack.py) when packed, else two. Mean squares: (of c_q, of c_kv) [B, S, 1] f32 from one
  reduction where packed (lora_mean_squares), else (None, None): each norm reduces its own.
  x_bsd: the attention's input, normalised by the layer's attn_norm, or as it is where that
  norm is folded into "qkv_a_t_folded" (`reads_unnormalised_input`): its scale applied here."""
  if "qkv_a_t" in p or "qkv_a_t_folded" in p:
    if reads_unnormalised_input(p):
      y = folded_dot_t(x_bsd, p["qkv_a_t_folded"], inv_rms(x_bsd, cfg.rms_norm_eps))
    else:
      y = dot_t(x_bsd, p["qkv_a_t"])
    q_in, a = y[..., :-cfg.cache_dim], y[..., -cfg.cache_dim:]
    if cfg.q_lora_rank is None:
      q_in = q_in.reshape(*q_in.shape[:-1], cfg.num_attention_heads, cfg.qk_head_dim)
    return q_in, a, lora_mean_squares(cfg, y)
  if cfg.q_lora_rank is None:
    return jnp.einsum("bsd,dhk->bshk", x_bsd, p["q"]), x_bsd @ p["kv_a"], (None, None)
  return x_bsd @ p["q_a"], x_bsd @ p["kv_a"], (None, None)


def reads_unnormalised_input(p) -> bool:
  """Whether the layer's attention takes the hidden state before its attn_norm (the norm's
  gain folded into the packed q_a | kv_a dot, pack.fold_norm_gains)."""
  return "qkv_a_t_folded" in p


JOINT_NORM_ROWS = 8  # at most this many rows of gcd(Rq, R) (K2: 1536 | 512 -> 4 rows of 512)


def lora_mean_squares(cfg: TargetConfig, y):
  """(mean(c_q^2), mean(c_kv^2)) [..., 1] f32 of y = x @ (q_a | kv_a | k_pe) from ONE reduction
  (one kernel where the two norms took two): y[..., :Rq + R] as rows of g = gcd(Rq, R), each
  row's sum of squares, then the rows of each part added (elementwise: fused into the
  consumers). The same sums in another order (f32 rounding only). (None, None) without the q
  LoRA or where the rows would exceed JOINT_NORM_ROWS."""
  rq, r = cfg.q_lora_rank, cfg.kv_lora_rank
  g = math.gcd(rq or 0, r)
  if rq is None or (rq + r) // g > JOINT_NORM_ROWS:
    return None, None
  yf = y[..., :rq + r].astype(jnp.float32).reshape(*y.shape[:-1], (rq + r) // g, g)
  ss = jnp.sum(yf * yf, axis=-1)
  rows = lambda lo, hi: functools.reduce(operator.add, [ss[..., i:i + 1] for i in range(lo, hi)])
  return rows(0, rq // g) / rq, rows(rq // g, (rq + r) // g) / r


def project_q(p, cfg: TargetConfig, q_in, mean_square=None):
  """Queries [B, S, H, Dn + P] from input_dots' q_in (the q LoRA's up-projection, if any);
  mean_square: input_dots' for c_q, or None."""
  if cfg.q_lora_rank is None:
    return q_in
  if "q_b_t_folded" in p:  # q_a_norm's gain in the weight: the norm's scale on the output
    q = folded_dot_t(q_in, p["q_b_t_folded"], inv_rms(q_in, cfg.lora_norm_eps, mean_square))
    return q.reshape(*q.shape[:-1], cfg.num_attention_heads, cfg.qk_head_dim)
  c_q = rms_norm(q_in, p["q_a_norm"], cfg.lora_norm_eps, mean_square)
  if "q_b_t" in p:  # out-major [H * (Dn + P), Rq]: contracts its minor dim
    q = dot_t(c_q, p["q_b_t"])
    return q.reshape(*q.shape[:-1], cfg.num_attention_heads, cfg.qk_head_dim)
  return jnp.einsum("bsr,rhk->bshk", c_q, p["q_b"])


def latent_rows(cfg: TargetConfig, p, a_bsc, cos, sin, mean_square=None):
  """Cache rows [B, S, C] from a = x @ kv_a: normalized c_kv (R) followed by the rotated shared
  rope key (P); mean_square: input_dots' for c_kv, or None.

  One full-width elementwise expression over a, no concatenate: column j is
  a[i1[j]] * f1[j] + a[i2[j]] * f2[j] with static column indices (`rope.row_columns`): the
  norm's w * (a * rsqrt) for j < R, the rope rotation (norm.rms_norm's and rope.apply_rope's
  own operations in their order, so the same values) for the P rope columns. The two parts
  joined by a concatenate were a separate kernel before the cache write (XLA:GPU, K2.6 share:
  one `input_concatenate_fusion` per layer)."""
  r = cfg.kv_lora_rank
  af = a_bsc.astype(jnp.float32)
  if mean_square is None:
    mean_square = jnp.mean(af[..., :r] * af[..., :r], axis=-1, keepdims=True)
  w = jnp.pad(p["kv_a_norm"].astype(jnp.float32), (0, af.shape[-1] - r))
  norm = w * (af * jax.lax.rsqrt(mean_square + cfg.lora_norm_eps))
  roped = rope.rotate_tail(af, r, cos, sin)
  rope_col = jnp.arange(af.shape[-1]) >= r
  return jnp.where(rope_col, roped.astype(a_bsc.dtype), norm.astype(a_bsc.dtype))


def split_q(cfg: TargetConfig, q_bshy, cos, sin):
  """(q_nope [B,S,H,Dn], rotated q_pe [B,S,H,P])."""
  q_nope = q_bshy[..., :cfg.qk_nope_head_dim]
  q_pe = apply_rope(q_bshy[..., cfg.qk_nope_head_dim:], cos[:, :, None, :], sin[:, :, None, :])
  return q_nope, q_pe


def prefill_attention(p, cfg: TargetConfig, x_bsd, positions_bs):
  """Naive causal MLA over the prompt itself (HF formulation). Returns (out [B,S,D], rows [B,S,C])."""
  cos, sin = cos_sin(cfg, positions_bs)
  q_in, a, (ms_q, ms_kv) = input_dots(p, cfg, x_bsd)
  q_nope, q_pe = split_q(cfg, project_q(p, cfg, q_in, ms_q), cos, sin)
  rows = latent_rows(cfg, p, a, cos, sin, ms_kv)
  c_kv, k_pe = rows[..., :cfg.kv_lora_rank], rows[..., cfg.kv_lora_rank:]
  dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
  if "w_uv" in p:  # w_uk (^T in the fifth session's w_qc) is w_qc_t's top-left block
    k_nope = (jnp.einsum("bsr,hrk->bshk", c_kv, p["w_qc_t"][:, :r, :dn]) if "w_qc_t" in p
              else jnp.einsum("bsr,hkr->bshk", c_kv, p["w_qc"][:, :dn, :r]))
    v = jnp.einsum("bsr,hvr->bshv", c_kv, p["w_uv"])
  else:
    kv = jnp.einsum("bsr,rhk->bshk", c_kv, p["kv_b"])
    k_nope, v = kv[..., :dn], kv[..., dn:]
  s = (jnp.einsum("bqhk,bshk->bhqs", q_nope, k_nope)
       + jnp.einsum("bqhp,bsp->bhqs", q_pe, k_pe)).astype(jnp.float32) * cfg.softmax_scale
  n = x_bsd.shape[1]
  causal = jnp.tril(jnp.ones((n, n), bool))
  s = jnp.where(causal, s, -jnp.inf)
  probs = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  o = jnp.einsum("bhqs,bshv->bqhv", probs, v)
  return out_proj(p, o), rows


def absorbed_attention(p, cfg: TargetConfig, x_bnd, positions_bn, layer_cache_blc, lengths_b,
                       tree_mask_bnn, *, backend="auto"):
  """N new tokens at arbitrary positions against the dense latent cache (absorbed MLA).

  The N tokens' own rows are written at [len, len + N) of the cache; every committed row
  (< len) is visible, the new rows under `tree_mask` (node i sees node j).
  Returns (out [B, N, D], updated layer cache [B, L, C]).
  """
  cos, sin = cos_sin(cfg, positions_bn)
  q_in, a, (ms_q, ms_kv) = input_dots(p, cfg, x_bnd)
  q = kernel_queries(p, cfg, project_q(p, cfg, q_in, ms_q), cos, sin).astype(layer_cache_blc.dtype)
  rows = latent_rows(cfg, p, a, cos, sin, ms_kv).astype(layer_cache_blc.dtype)
  layer_cache_blc = write_rows(layer_cache_blc, rows, lengths_b)
  u = verify_attention(cfg, q, layer_cache_blc, lengths_b, tree_mask_bnn, backend)
  o = unabsorb_u(p, cfg, u.astype(x_bnd.dtype))
  return out_proj(p, o), layer_cache_blc


def out_proj(p, o_bnhv):
  """The heads' values [B, N, H, Dv] through o -> [B, N, D]: over p["o_t"] [D, H * Dv] (packed,
  out-major: the heads flattened, contracting the weight's minor dim), else o [H, Dv, D]."""
  if "o_t" in p:
    return dot_t(o_bnhv.reshape(*o_bnhv.shape[:-2], -1), p["o_t"])
  return jnp.einsum("bnhv,hvd->bnd", o_bnhv, p["o"])


def kernel_queries(p, cfg: TargetConfig, q_bnhy, cos, sin):
  """The tree-verify kernel's queries [B, N, H, R + P]: q_nope through kv_b's key half, then the
  rotated q_pe. Packed (target/pack.py's w_qc_t [H, R + P, Dn + P] = [[w_uk, 0], [0, I]],
  out-major: each head's product contracts the weight's minor dim): at one token
  `_one_token_queries` (the rotation's factors on the weight side of one reduce); else ONE
  product of the rotated queries (`rope.rotate_tail`, no concatenate) gives both parts, the
  rope columns multiplied by exact ones (the same values; the absorbed part's sums gain zero
  terms), so no concatenate joins them (on the H200 one kernel per layer); else absorb_q and
  the rotated q_pe joined. (The fifth session's w_qc [H, Dn + P, R + P], pack_for_decode's
  out_major=False, contracts its major dim: kept for the GPU A/B.)"""
  if "w_uv" in p:
    dn = cfg.qk_nope_head_dim
    if "w_qc_t" in p and q_bnhy.shape[1] == 1:
      return _one_token_queries(p["w_qc_t"], q_bnhy, cos, sin, dn)
    qf = rope.rotate_tail(q_bnhy.astype(jnp.float32), dn, cos[:, :, None, :],
                          sin[:, :, None, :]).astype(q_bnhy.dtype)
    if "w_qc_t" in p:
      return jnp.einsum("bnhk,hck->bnhc", qf, p["w_qc_t"])
    return jnp.einsum("bnhk,hkc->bnhc", qf, p["w_qc"])
  q_nope, q_pe = split_q(cfg, q_bnhy, cos, sin)
  return jnp.concatenate([absorb_q(p, cfg, q_nope), q_pe], axis=-1)


def _one_token_queries(w_qc_t, q_bnhk, cos, sin, dn):
  """kernel_queries at one token over w_qc_t [H, C, K] (C = R + P, K = Dn + P) with the rope
  rotation folded into the product's weight side: output column c sums q[k] * e[c, k] over k
  with e = w_qc_t for the R absorbed columns and, for rope column c = R + j, e[c, k] =
  c1[j] (k == i1[j]) + c2[j] (k == i2[j]) (rope.rotate_tail's factors and column indices,
  made from iota: the [[0], [I_P]] block is not read). The per-column factors multiply the
  weight, not q, so no gather of q rides in each element of the reduce (the H200 listing:
  236 us per ar step at 61 layers for ~26 us of bytes). Written as multiply + sum (a one-row
  dot is one on the GPU anyway) in f32 and cast once: a rope column is q[i1] c1 + q[i2] c2
  plus exact zeros, rotate_tail's value rounded once as before; the absorbed columns are the
  same f32 products summed (bit-identical where the reduce keeps the dot's order)."""
  _, c, k = w_qc_t.shape
  r, p = c - (k - dn), k - dn
  i1, i2 = rope.row_columns(dn, p)
  col_1 = np.concatenate([np.full(r, -1), i1[dn:]])[:, None]  # [C, 1]; -1: no rope term
  col_2 = np.concatenate([np.full(r, -1), i2[dn:]])[:, None]
  zeros = jnp.zeros(cos.shape[:-1] + (r,), cos.dtype)
  f1 = jnp.concatenate([zeros, cos, cos], axis=-1)[..., None, :, None]  # [B, N, 1, C, 1]
  f2 = jnp.concatenate([zeros, -sin, sin], axis=-1)[..., None, :, None]
  k_idx = np.arange(k)[None, :]
  rope_e = jnp.where(k_idx == col_1, f1, 0.0) + jnp.where(k_idx == col_2, f2, 0.0)
  e = jnp.where(np.arange(c)[:, None] >= r, rope_e, w_qc_t.astype(jnp.float32))
  qf = q_bnhk.astype(jnp.float32)[..., None, :]  # [B, N, H, 1, K]
  return jnp.sum(qf * e, axis=-1).astype(q_bnhk.dtype)


def absorb_q(p, cfg: TargetConfig, q_nope_bnhk):
  """q_nope through kv_b's key half -> [B, N, H, R] (per-layer weights: kv_b[..., :Dn]
  [R, H, Dn]; packed weights go through kernel_queries' one product)."""
  return jnp.einsum("bnhk,rhk->bnhr", q_nope_bnhk, p["kv_b"][..., :cfg.qk_nope_head_dim])


def unabsorb_u(p, cfg: TargetConfig, u_bnhr):
  """The attention's latent output through kv_b's value half -> [B, N, H, Dv]: over p["w_uv"]
  [H, Dv, R] when packed, else kv_b[..., Dn:] [R, H, Dv]."""
  if "w_uv" in p:
    return jnp.einsum("bnhr,hvr->bnhv", u_bnhr, p["w_uv"])
  return jnp.einsum("bnhr,rhv->bnhv", u_bnhr, p["kv_b"][..., cfg.qk_nope_head_dim:])


def verify_attention(cfg: TargetConfig, q_bnhc, cache_blc, lengths_b, tree_mask_bnn, backend,
                     shard_heads=None):
  """The tree-verify attention entry point. Under a mesh the kernel backends run per head shard
  (shard_map: heads split like the attention weights, the latent cache replicated over them);
  the XLA backend is partitioned by GSPMD as it is (shard_heads=True forces the shard_map)."""
  call = functools.partial(pallas_kernels.tree_verify_attention, scale=cfg.softmax_scale,
                           backend=backend, value_dim=cfg.kv_lora_rank)
  mesh = sharding.current_mesh()
  if shard_heads is None:
    shard_heads = resolve_backend(backend, q_bnhc, cfg.kv_lora_rank) != "xla"
  if mesh is None or not shard_heads:
    return call(q_bnhc, cache_blc, lengths_b, tree_mask_bnn)
  q_spec = sharding.spec(("batch", "out", "heads", "kv_lora"), q_bnhc.shape, mesh)
  specs = (q_spec, sharding.spec(("batch", "cache_len", "kv_lora"), cache_blc.shape, mesh),
           sharding.spec(("batch",), lengths_b.shape, mesh),
           sharding.spec(("batch", "out", "out"), tree_mask_bnn.shape, mesh))
  # check_vma=False: the kernels' outputs (Pallas ShapeDtypeStructs) carry no varying-axes type,
  # which shard_map's check rejects at trace time ("manual_axis_type ... must not be None": the
  # K2.6-width step on 2 H200s, tensor=2 and expert=2, 2026-12-01). Nothing inside communicates:
  # each head shard's output is its own.
  return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(
      q_bnhc, cache_blc, lengths_b, tree_mask_bnn)


def write_rows(cache_blc, rows_bnc, start_b):
  """Writes rows_bnc at [start, start + N) of each batch row (in place under donation), each
  start clamped to [0, L - N] as dynamic_update_slice does. One batch row (decode): ONE
  dynamic_update_slice. Vmapped (B > 1) it is a scatter, which drops an out-of-bounds window,
  and XLA's scatter -> dynamic-update-slice rewrite keeps that by selecting between the new rows
  and the cache's OLD rows (a dynamic-slice read back per layer: on the H200, 85 us per ar step
  at 61 layers) although the clamped window is always in bounds; B > 1 keeps the vmap all the
  same: a loop of per-row updates on a data-sharded batch made GSPMD move rows between shards
  (2 more collectives per layer at data=2, expert=4: tests/sharding/test_collectives.py)."""
  if cache_blc.shape[0] == 1:
    return jax.lax.dynamic_update_slice(cache_blc, rows_bnc, (0, start_b[0], 0))

  def one(c, r, s):
    return jax.lax.dynamic_update_slice(c, r, (s, 0))
  return jax.vmap(one)(cache_blc, rows_bnc, start_b)
