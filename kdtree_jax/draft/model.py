"""DFlash draft forward: pure functions over a params pytree (Qwen3-style layers).

Letters: B batch, T new ctx tokens, L cache rows, S block tokens, A anchors, D hidden,
H query heads, G kv heads, U = H/G heads per kv head, Y head_dim, F ffn, V vocab, X key
positions of one attention call, W block size, Z tapped features (the package glossary).

Params (HF Linear [out, in] stored as [in, out]): fc [n_tap*D, D], hidden_norm [D], norm [D],
layers: a list of dicts (one per layer, so no step slices a stacked weight): q_proj
[D, H*Y], k_proj / v_proj [D, G*Y], o_proj [H*Y, D], q_norm / k_norm [Y], input_layernorm /
post_attention_layernorm [D], gate_proj / up_proj [D, F], down_proj [F, D]. Inference-only
layouts, built once at load: pack_ctx_kv adds ctx_kv [D, layers*2*G*Y] (every layer's k_proj /
v_proj side by side: the context write runs one dot for all layers); pack_for_decode also
replaces each layer's q/k/v by qkv_proj [D, (H+2G)*Y] and gate/up by gate_up_proj [D, 2F];
pack_token_qkv (opt-in) adds token_qkv [V, (H+2G)*Y], layer 0's q|k|v dot output per
vocabulary token (draft_block then gathers its rows instead of running that dot).

Attention rule: z-lab's reference (github.com/z-lab/dflash dflash/model.py, run by its
dflash_generate on transformers 4.57.1's flash-attention path; notes/dflash_reference.md). A
block query at position p sees the ctx keys of committed tokens (positions < the block start)
and every key of its own block, in every layer (non-causal; causal only if config.is_causal).
Sliding layers keep only keys with |p - key_pos| < window, on ctx and block keys alike.

Inference attention: the ctx part reads the cache in place (bf16 when the cache is bf16, f32
scores and softmax statistics) and the block part attends to the block's own K/V; the two are
merged through their log-sum-exps, so no step copies or concatenates the ctx K/V. The ctx part
runs as N independent chunks of CTX_CHUNK rows (a batch axis of both dots, the chunks merged
through their log-sum-exps): a PV dot contracting over all L rows lets XLA:GPU's split-K rewrite
pad both operands (p and the V cache) to a multiple of split_k * 8 rows, a cache-sized copy per
layer per step (the H200 showed one ~57 us `loop_pad_fusion` per layer at L = 46016 = 64 * 719).
init_draft_cache rounds the capacity up to whole chunks. ctx_impl='pallas' runs the ctx part as
one fused kernel instead (ctx_attention.py: no f32 scores in HBM, rows < ctx_len only), and
with block_in_kernel the block's own keys as one more program of it; 'auto' (the default, so
the decode's) is the kernel on a single GPU and the XLA form elsewhere (resolve_ctx_impl). On
pack_for_decode'd layers with the block in the kernel, packed_io (the default) lets the kernel
read q and the block's K/V where the q|k|v dot and the q/k norm + rope fusion left them, and a
second small kernel merge its partials straight into the o_proj input, so no slice, transpose
or XLA merge runs between the two dots (attend_packed_kernel); with qk_in_kernel (the default)
the kernel also applies the q / k norms and rope to the dot's raw heads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kdtree_jax.draft import ctx_attention
from kdtree_jax.draft.config import DraftConfig

# Ctx rows per attention chunk: XLA:GPU pads a split-K dot's contraction to split_k * 16 bytes
# (8 bf16 rows), so 1024 rows need no pad for any split_k <= 128.
CTX_CHUNK = 1024


@struct.dataclass
class DraftCache:
  """Dense draft ctx K/V: k, v = one [B, G, L, Y] buffer per draft layer (k normed + roped;
  kv heads before rows so attention reads each head's rows as one contiguous matrix), pos [B, L],
  ctx_len [B]. Separate per-layer buffers are written in place (see cache.py)."""

  k: tuple
  v: tuple
  pos: jax.Array
  ctx_len: jax.Array


def cache_rows(max_ctx: int) -> int:
  """Cache capacity for max_ctx rows: whole CTX_CHUNKs above one chunk, else whole 64-row tiles
  (the fused ctx kernel's tile)."""
  unit = CTX_CHUNK if max_ctx > CTX_CHUNK else 64
  return -(-max_ctx // unit) * unit


def init_draft_cache(cfg: DraftConfig, batch: int, max_ctx: int, dtype=jnp.bfloat16) -> DraftCache:
  """Empty cache of cache_rows(max_ctx) rows. Keep max_ctx >= longest context + T (materialize
  writes T rows at ctx_len)."""
  max_ctx = cache_rows(max_ctx)
  shape = (batch, cfg.num_key_value_heads, max_ctx, cfg.head_dim)
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
  D, Y, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
  HE, GE = cfg.num_attention_heads * Y, cfg.num_key_value_heads * Y
  shapes = dict(q_proj=(D, HE), k_proj=(D, GE), v_proj=(D, GE), o_proj=(HE, D),
                gate_proj=(D, F), up_proj=(D, F), down_proj=(F, D))
  norms = dict(q_norm=Y, k_norm=Y, input_layernorm=D, post_attention_layernorm=D)
  fc_key, *layer_keys = jax.random.split(rng, cfg.num_hidden_layers + 1)
  normal = lambda k, s: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(dtype)

  def layer(key):
    lp = {n: normal(k, s) for (n, s), k in zip(shapes.items(), jax.random.split(key, len(shapes)))}
    return lp | {n: jnp.ones((d,), dtype) for n, d in norms.items()}

  return dict(fc=normal(fc_key, (n_taps * D, D)), hidden_norm=jnp.ones((D,), dtype),
              norm=jnp.ones((D,), dtype), layers=[layer(k) for k in layer_keys])


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


def rope_tables(pos_bs, head_dim, theta):
  """(cos, sin) [B, S, Y/2] f32 of the rotate_half pairs (i, i + Y/2) at integer positions."""
  inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  ang = pos_bs.astype(jnp.float32)[..., None] * inv
  return jnp.cos(ang), jnp.sin(ang)


def rope(x_bshy, pos_bs, theta):
  """NeoX / rotate_half RoPE at integer positions (f32 math)."""
  Y = x_bshy.shape[-1]
  cos_h, sin_h = rope_tables(pos_bs, Y, theta)
  cos = jnp.concatenate([cos_h] * 2, -1)[:, :, None]
  sin = jnp.concatenate([sin_h] * 2, -1)[:, :, None]
  xf = x_bshy.astype(jnp.float32)
  rot = jnp.concatenate([-xf[..., Y // 2:], xf[..., : Y // 2]], -1)
  return (xf * cos + rot * sin).astype(x_bshy.dtype)


def context_feature(params, cfg: DraftConfig, taps_btz):
  """c = hidden_norm(fc(concat taps)) [B, T, D]."""
  want = cfg.n_taps * cfg.hidden_size
  if taps_btz.shape[-1] != want:
    raise ValueError(f"taps last dim {taps_btz.shape[-1]} != n_taps*hidden = {want}")
  return rms_norm(taps_btz.astype(params["fc"].dtype) @ params["fc"], params["hidden_norm"],
                  cfg.rms_norm_eps)


def _kv(lp, cfg, x_btd, pos_bt):
  """One layer's K (k_norm + rope) and V [B, T, G, Y] from inputs x."""
  B, T, _ = x_btd.shape
  k = (x_btd @ lp["k_proj"]).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
  v = (x_btd @ lp["v_proj"]).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
  k = rope(rms_norm(k, lp["k_norm"], cfg.rms_norm_eps), pos_bt, cfg.rope_theta)
  return k, v


def pack_ctx_kv(params):
  """params + "ctx_kv" [D, layers * 2 * G*Y]: every layer's k_proj and v_proj side by side (k0 v0
  k1 v1 ...), built once (at load) so materialize_context runs ONE dot for all layers' ctx K/V.
  Without it XLA:GPU's DotMerger builds the same concatenation of the weights itself, inside the
  decode loop, on every commit (the H200 showed a 53 us `wrapped_concatenate` per commit for
  bench_k26_full's draft). The per-layer k_proj / v_proj stay (the block forward reads them)."""
  kv = [w for lp in params["layers"] for w in (lp["k_proj"], lp["v_proj"])]
  return params | {"ctx_kv": jnp.concatenate(kv, axis=1)}


def pack_for_decode(params):
  """Inference layout (not for training, checkpoints or tensor-parallel sharding): pack_ctx_kv,
  and in every layer qkv_proj [D, (H + 2G)*Y] (q | k | v) replacing q_proj / k_proj / v_proj and
  gate_up_proj [D, 2F] (gate | up) replacing gate_proj / up_proj, so the block forward reads each
  layer's attention input weights in one dot and its gate and up weights in another, with no
  concatenation at run time."""
  packed = pack_ctx_kv(params)
  cat = lambda lp, names: jnp.concatenate([lp[n] for n in names], axis=1)
  drop = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
  layers = [{k: w for k, w in lp.items() if k not in drop}
            | dict(qkv_proj=cat(lp, drop[:3]), gate_up_proj=cat(lp, drop[3:]))
            for lp in params["layers"]]
  return packed | {"layers": layers}


TOKEN_QKV_CHUNK = 8192  # vocabulary rows per dot while pack_token_qkv builds its table


def pack_token_qkv(params, cfg: DraftConfig, embed_vd):
  """pack_for_decode'd params + "token_qkv" [V, (H + 2G)*Y]: layer 0's q|k|v dot output for
  every vocabulary token, rms_norm(embed[v], input_layernorm) @ qkv_proj, built once (at load).

  Why: layer 0's q|k|v input is the block tokens' target embedding, a function of the token
  alone (q_norm, k_norm and rope come after the dot), so draft_block looks its B*S rows up
  (token_qkv_rows) instead of reading the whole qkv_proj weight ([D, (H+2G)*Y]: 18.4 MB for
  bench_k26_full's draft) and running layer 0's input norm, dot and split-K reduce. Costs
  V*(H+2G)*Y weights of memory (52 MB at bench_k26_full's V/8 vocabulary). Opt-in (the GPU A/B
  decides): decode uses it when the key is there. `embed_vd` must be the embedding draft_block
  is then given (the target's). Values: the same expression as the block forward, on
  TOKEN_QKV_CHUNK rows at a time (only the dot's f32 summation order differs)."""
  lp = params["layers"][0]
  if "qkv_proj" not in lp:
    raise ValueError("pack_token_qkv needs pack_for_decode'd params (layer 0's qkv_proj)")
  _check_target(cfg, embed_vd.shape[-1])
  dtype = params["fc"].dtype

  rows = jax.jit(lambda e_nd, gain, w: rms_norm(e_nd.astype(dtype), gain, cfg.rms_norm_eps) @ w)
  V = embed_vd.shape[0]
  table = jnp.concatenate([rows(embed_vd[i:i + TOKEN_QKV_CHUNK], lp["input_layernorm"],
                                lp["qkv_proj"]) for i in range(0, V, TOKEN_QKV_CHUNK)])
  return params | {"token_qkv": table}


def token_qkv_rows(params, tokens_bs):
  """Layer 0's q|k|v dot output [B, S, (H+2G)*Y] of the block tokens from pack_token_qkv's
  table, or None where params have no table."""
  table = params.get("token_qkv")
  return None if table is None else table[tokens_bs]


def _ctx_kv_all(params, cfg, c_btd, positions_bt):
  """[(k (k_norm + rope), v) [B, T, G, Y]] of every layer from the ctx feature c: one dot over
  params["ctx_kv"] if packed (k_norm and rope then applied to every layer's k at once), else
  two dots per layer."""
  B, T, _ = c_btd.shape
  n, G, Y, eps = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
  if "ctx_kv" in params:
    kv = (c_btd @ params["ctx_kv"]).reshape(B, T, n, 2, G, Y)
    k_norm = jnp.stack([lp["k_norm"] for lp in params["layers"]])[:, None]  # [n, 1, Y]
    k = rms_norm(kv[:, :, :, 0], k_norm, eps).reshape(B, T, n * G, Y)
    k = rope(k, positions_bt, cfg.rope_theta).reshape(B, T, n, G, Y)
    return [(k[:, :, i], kv[:, :, i, 1]) for i in range(n)]
  dot = lambda w: (c_btd @ w).reshape(B, T, G, Y)
  out = []
  for lp in params["layers"]:
    k = rope(rms_norm(dot(lp["k_proj"]), lp["k_norm"], eps), positions_bt, cfg.rope_theta)
    out.append((k, dot(lp["v_proj"])))
  return out


def materialize_context(params, cfg: DraftConfig, cache: DraftCache, taps_btz, positions_bt,
                        num_valid_b) -> DraftCache:
  """Append ctx K/V of T new committed tokens at rows [ctx_len, ctx_len+T); ctx_len += num_valid.
  K/V projections: see _ctx_kv_all (pack_ctx_kv'd params: one dot for every layer)."""
  c = context_feature(params, cfg, taps_btz)

  def put(dst_gly, src_tgy, at):
    src_gty = jnp.swapaxes(src_tgy, 0, 1).astype(dst_gly.dtype)
    return jax.lax.dynamic_update_slice(dst_gly, src_gty, (0, at, 0))

  put_b = jax.vmap(put)
  ks, vs = [], []
  kv_all = _ctx_kv_all(params, cfg, c, positions_bt)
  for (k, v), k_cache, v_cache in zip(kv_all, cache.k, cache.v):
    ks.append(put_b(k_cache, k, cache.ctx_len))
    vs.append(put_b(v_cache, v, cache.ctx_len))
  pos = jax.vmap(lambda p, s, at: jax.lax.dynamic_update_slice(p, s, (at,)))(
      cache.pos, positions_bt.astype(jnp.int32), cache.ctx_len)
  return DraftCache(k=tuple(ks), v=tuple(vs), pos=pos,
                    ctx_len=cache.ctx_len + num_valid_b.astype(jnp.int32))


def _window_ok(q_pos, k_pos, window):
  """Sliding-window visibility |q_pos - k_pos| < window (None: full attention, all visible)."""
  return None if window is None else jnp.abs(q_pos - k_pos) < window


def _both(a, b):
  """a & b where None means all True."""
  return b if a is None else a if b is None else a & b


def _partial_attention(q_bgusy, k_bgxy, v_bgxy, ok_bsx, scale):
  """Unnormalised softmax attention over one key set; inputs in the K/V dtype, f32 statistics.

  Returns o [B, G, U, S, Y] = sum_k exp(s - m) v, m [B, G, U, S] (row max, -inf if no key is
  visible) and l [B, G, U, S] = sum_k exp(s - m). ok_bsx (None: all visible) broadcasts over S.
  """
  s = jnp.einsum("bgrse,bgke->bgrsk", q_bgusy.astype(k_bgxy.dtype), k_bgxy,
                 preferred_element_type=jnp.float32) * scale
  if ok_bsx is not None:
    s = jnp.where(ok_bsx[:, None, None], s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m)[..., None])
  o = jnp.einsum("bgrsk,bgke->bgrse", p.astype(v_bgxy.dtype), v_bgxy,
                 preferred_element_type=jnp.float32)
  return o, m, jnp.sum(p, axis=-1)


def _merge_partials(o_n, m_n, l_n):
  """Merge N partials stacked on axis 0 (o [N, ..., Y], m / l [N, ...]) into one (o, m, l);
  m stays -inf (and o, l 0) where no partial saw a key."""
  m = jnp.max(m_n, axis=0)
  w = jnp.exp(m_n - jnp.where(jnp.isneginf(m), 0.0, m))
  return jnp.sum(o_n * w[..., None], axis=0), m, jnp.sum(l_n * w, axis=0)


def _chunked_partial_attention(q_bgusy, k_bgly, v_bgly, ok_bsl, scale, chunk):
  """_partial_attention over L = N * chunk rows as N chunks: the chunk index is a batch axis of
  both dots (q broadcast over it, M*Y*N elements, small), so the PV dot contracts over `chunk`
  rows, never all L, and scores, p and the mask share one chunk-major layout [B, G, N, U, S, k]
  (no transposes); the N partials merged through their log-sum-exps. Same (o, m, l) as
  _partial_attention up to f32 summation order."""
  B, G, L, Y = k_bgly.shape
  U, S = q_bgusy.shape[2:4]
  n = L // chunk
  k = k_bgly.reshape(B, G, n, chunk, Y)
  v = v_bgly.reshape(B, G, n, chunk, Y)
  q = jnp.broadcast_to(q_bgusy.astype(k.dtype)[:, :, None], (B, G, n, U, S, Y))
  batch = ((0, 1, 2), (0, 1, 2))
  s = jax.lax.dot_general(q, k, (((5,), (4,)), batch),
                          preferred_element_type=jnp.float32) * scale  # [B, G, N, U, S, k]
  if ok_bsl is not None:
    ok = ok_bsl.reshape(ok_bsl.shape[0], ok_bsl.shape[1], n, chunk).transpose(0, 2, 1, 3)
    s = jnp.where(ok[:, None, :, None], s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m)[..., None])
  o = jax.lax.dot_general(p.astype(v.dtype), v, (((5,), (3,)), batch),
                          preferred_element_type=jnp.float32)  # [B, G, N, U, S, Y]
  front = lambda x: jnp.moveaxis(x, 2, 0)
  return _merge_partials(front(o), front(m), front(jnp.sum(p, axis=-1)))


def xla_part(k_bgxy, v_bgxy, ok_bsx, chunk=None):
  """A key set for _merged_attention: q_bgusy, scale -> (o, m, l) by XLA, in chunks of `chunk`
  rows (a divisor of the rows) when there are more rows than that."""
  def part(q_bgusy, scale):
    if chunk is not None and k_bgxy.shape[2] > chunk:
      return _chunked_partial_attention(q_bgusy, k_bgxy, v_bgxy, ok_bsx, scale, chunk)
    return _partial_attention(q_bgusy, k_bgxy, v_bgxy, ok_bsx, scale)
  return part


def kernel_part(k_bgly, v_bgly, ctx_len_b, tuning, interpret, kb_bgsy=None, vb_bgsy=None):
  """The ctx rows < ctx_len as a key set through the fused kernel (ctx_attention.py); with the
  block's own K/V kb, vb [B, G, S, Y] (all visible), those keys too, in the same kernel."""
  def part(q_bgusy, scale):
    B, G, U, S, Y = q_bgusy.shape
    o, lse = ctx_attention.ctx_partials(q_bgusy.reshape(B, G, U * S, Y), k_bgly, v_bgly,
                                        ctx_len_b, kb_bgsy, vb_bgsy, scale=scale,
                                        tuning=tuning, interpret=interpret)
    # a normalised partial is (o, m, l) = (o, lse, 1); a chunk past ctx_len has lse = -inf
    l = jnp.where(jnp.isneginf(lse), 0.0, 1.0)
    o, m, l = _merge_partials(*(jnp.moveaxis(x, 2, 0) for x in (o.astype(jnp.float32), lse, l)))
    return o.reshape(B, G, U, S, Y), m.reshape(B, G, U, S), l.reshape(B, G, U, S)
  return part


def _merged_attention(q_bshy, parts, scale, kv_heads):
  """Softmax attention over the union of key sets (callables q_bgusy, scale -> (o, m, l), see
  xla_part), merged through their log-sum-exps (every query must see at least one key) ->
  [B, S, H*Y] in q's dtype."""
  B, S, H, Y = q_bshy.shape
  G = kv_heads
  q = q_bshy.reshape(B, S, G, H // G, Y).transpose(0, 2, 3, 1, 4)
  outs = [part(q, scale) for part in parts]
  o, _, l = _merge_partials(*(jnp.stack(x) for x in zip(*outs)))
  o = (o / l[..., None]).transpose(0, 3, 1, 2, 4).reshape(B, S, H * Y)
  return o.astype(q_bshy.dtype)


def _qkv_dot(lp, h_bsd, qkv_rows=None):
  """A packed layer's q|k|v dot output [B, S, (H+2G)*Y]: h @ lp["qkv_proj"], or qkv_rows when
  given (layer 0's rows looked up in pack_token_qkv's table: no dot, h unused)."""
  return h_bsd @ lp["qkv_proj"] if qkv_rows is None else qkv_rows


def _qk_packed(lp, cfg, h_bsd, pos_bs, qkv_rows=None):
  """A packed layer's (qk, qkv): qkv [B, S, H+2G, Y] = the one dot over lp["qkv_proj"] (or
  qkv_rows, see _qkv_dot), qk [B, S, H+G, Y] = its q and k heads normed and roped together (one
  fusion, not two)."""
  B, S, _ = h_bsd.shape
  H, G, Y = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  qkv = _qkv_dot(lp, h_bsd, qkv_rows).reshape(B, S, H + 2 * G, Y)
  norm = jnp.concatenate([jnp.broadcast_to(lp["q_norm"], (H, Y)),
                          jnp.broadcast_to(lp["k_norm"], (G, Y))])
  return rope(rms_norm(qkv[:, :, :H + G], norm, cfg.rms_norm_eps), pos_bs, cfg.rope_theta), qkv


def _qkv(lp, cfg, h_bsd, pos_bs, qkv_rows=None):
  """q (q_norm + rope) [B, S, H, Y] and the block's k (k_norm + rope), v [B, S, G, Y]: one dot
  over lp["qkv_proj"] when the layer is packed (pack_for_decode; or its output qkv_rows, see
  _qkv_dot), else three."""
  B, S, _ = h_bsd.shape
  H, Y = cfg.num_attention_heads, cfg.head_dim
  if "qkv_proj" in lp:
    qk, qkv = _qk_packed(lp, cfg, h_bsd, pos_bs, qkv_rows)
    return qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + cfg.num_key_value_heads:]
  if qkv_rows is not None:
    raise ValueError("qkv_rows (pack_token_qkv) needs a packed layer (pack_for_decode)")
  q = (h_bsd @ lp["q_proj"]).reshape(B, S, H, Y)
  k, v = _kv(lp, cfg, h_bsd, pos_bs)
  return rope(rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), pos_bs, cfg.rope_theta), k, v


def _mlp(lp, h_bsd):
  """SwiGLU: one dot over lp["gate_up_proj"] for gate and up when packed, else two."""
  if "gate_up_proj" in lp:
    gate, up = jnp.split(h_bsd @ lp["gate_up_proj"], 2, axis=-1)
  else:
    gate, up = h_bsd @ lp["gate_proj"], h_bsd @ lp["up_proj"]
  return (jax.nn.silu(gate) * up) @ lp["down_proj"]


def attend_key_sets(key_sets, qkv_rows=None):
  """An attention for _layer: block queries over key_sets(kb, vb), the key sets (see xla_part)
  of the ctx and of the block's own K/V kb, vb [B, G, S, Y], merged by _merged_attention
  (qkv_rows: the q|k|v dot's output given, see _qkv_dot)."""
  def attend(lp, cfg, h_bsd, q_pos_bs):
    q, kb, vb = _qkv(lp, cfg, h_bsd, q_pos_bs, qkv_rows)
    parts = key_sets(jnp.swapaxes(kb, 1, 2), jnp.swapaxes(vb, 1, 2))
    return _merged_attention(q, parts, cfg.head_dim ** -0.5, cfg.num_key_value_heads)
  return attend


def attend_packed_kernel(k_bgly, v_bgly, ctx_len_b, tuning, interpret, qk_in_kernel=False,
                         qkv_rows=None):
  """An attention for _layer (packed layers, every block key visible): the ctx kernel reads q
  and the block's K/V straight from _qk_packed's arrays (ctx_attention.packed_block_partials)
  and a second kernel merges its partials into the o_proj input (merge_to_heads): no slice,
  transpose or XLA merge between the q|k|v dot and the o_proj dot. qk_in_kernel: the kernel
  reads the q|k|v dot's raw output and applies q_norm / k_norm and rope itself (no XLA norm or
  rope launch either; the scores as two half-width dots). qkv_rows: the q|k|v dot's output
  given (see _qkv_dot)."""
  def attend(lp, cfg, h_bsd, q_pos_bs):
    G = cfg.num_key_value_heads
    if qk_in_kernel:
      B, S, _ = h_bsd.shape
      qk, rope_eps = None, cfg.rms_norm_eps
      qkv = _qkv_dot(lp, h_bsd, qkv_rows).reshape(B, S, -1, cfg.head_dim)
      rope_in = (lp["q_norm"], lp["k_norm"], *rope_tables(q_pos_bs, cfg.head_dim, cfg.rope_theta))
    else:
      (qk, qkv), rope_eps, rope_in = _qk_packed(lp, cfg, h_bsd, q_pos_bs, qkv_rows), None, None
    o, lse = ctx_attention.packed_block_partials(
        qk, qkv, k_bgly, v_bgly, ctx_len_b, rope_in, kv_heads=G, scale=cfg.head_dim ** -0.5,
        tuning=tuning, interpret=interpret, rope_eps=rope_eps)
    return ctx_attention.merge_to_heads(o, lse, heads=cfg.num_attention_heads,
                                        dtype=qkv.dtype, interpret=interpret,
                                        pieces=tuning.merge_pieces)
  return attend


def _layer(lp, cfg, x_bsd, q_pos_bs, attend):
  """One draft decoder layer; attend(lp, cfg, h, q_pos) -> o [B, S, H*Y] is its attention
  (attend_key_sets or attend_packed_kernel)."""
  h = rms_norm(x_bsd, lp["input_layernorm"], cfg.rms_norm_eps)
  o = attend(lp, cfg, h, q_pos_bs)
  x_bsd = x_bsd + o @ lp["o_proj"]
  h = rms_norm(x_bsd, lp["post_attention_layernorm"], cfg.rms_norm_eps)
  return x_bsd + _mlp(lp, h)


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


def _block_mask(cfg, i, q_pos_bs, same_bss=None):
  """Block-key visibility for layer i (None: all visible): same block, |q - k| < window,
  earlier-or-equal keys only if the config asks for causal blocks."""
  q, k = q_pos_bs[:, :, None], q_pos_bs[:, None, :]
  ok = _both(same_bss, _window_ok(q, k, cfg.window(i)))
  return _both(ok, k <= q) if cfg.causal(i) else ok


def make_block(cfg: DraftConfig, bonus_b):
  """Block tokens [B, block_size] = [bonus, MASK x (block_size-1)]."""
  if cfg.mask_token_id is None:
    raise ValueError("draft config has no mask_token_id (dflash_config.mask_token_id)")
  B = bonus_b.shape[0]
  mask = jnp.full((B, cfg.block_size - 1), cfg.mask_token_id, jnp.int32)
  return jnp.concatenate([bonus_b.astype(jnp.int32)[:, None], mask], axis=1)


CTX_IMPLS = ("auto", "xla", "pallas", "interpret")


def resolve_ctx_impl(ctx_impl: str) -> str:
  """'auto': the fused kernel ('pallas') on a single GPU, else 'xla' (the Triton kernel has no
  CPU lowering; under a multi-device mesh the kernel's operands would be gathered, so sharded
  decodes keep the XLA form). Other names are returned as given."""
  if ctx_impl not in CTX_IMPLS:
    raise ValueError(f"{ctx_impl=} must be one of {CTX_IMPLS}")
  if ctx_impl != "auto":
    return ctx_impl
  return "pallas" if jax.default_backend() == "gpu" and jax.device_count() == 1 else "xla"


def _attention(cfg, cache, i, lp, q_pos_bs, live_b1c, ctx_impl, chunk, kernel_chunk,
               kernel_tuning, block_in_kernel, packed_io, qk_in_kernel, qkv_rows=None):
  """Layer i's attend for _layer: the ctx part through the fused kernel (ctx_impl 'pallas', or
  'interpret' = its CPU interpret mode) for full-attention layers whose shapes it supports,
  else XLA in chunks; the block part by XLA, or as one more program of the kernel
  (block_in_kernel, where every block key is visible: non-causal, no window, and the kernel
  takes the block's rows); with packed_io too and a packed layer, attend_packed_kernel
  (qk_in_kernel: q/k norm and rope inside the kernel).
  kernel_tuning: (field, value) pairs replacing default_tuning's. qkv_rows: the layer's q|k|v
  dot output given (pack_token_qkv's rows; see _qkv_dot)."""
  k, v, window = cache.k[i], cache.v[i], cfg.window(i)
  B, G, L, Y = k.shape
  S = q_pos_bs.shape[1]
  M = cfg.num_attention_heads // G * S
  tuning = ctx_attention.default_tuning(B, G, M, L, kernel_chunk)
  tuning = dataclasses.replace(tuning, **dict(kernel_tuning))
  blk_ok = _block_mask(cfg, i, q_pos_bs)
  q_like = jax.ShapeDtypeStruct((B, G, M, Y), k.dtype)
  if ctx_impl != "xla" and window is None and (
      ctx_impl == "interpret" or ctx_attention.supports(q_like, k, tuning)):
    interpret = ctx_impl == "interpret"
    kb_like = jax.ShapeDtypeStruct((B, G, S, Y), k.dtype)
    if block_in_kernel and blk_ok is None and (interpret or ctx_attention.supports_block(kb_like)):
      qk_like = jax.ShapeDtypeStruct((B, S, cfg.num_attention_heads + G, Y), k.dtype)
      if packed_io and "qkv_proj" in lp and (
          interpret or ctx_attention.supports_packed_block(qk_like, G)):
        return attend_packed_kernel(k, v, cache.ctx_len, tuning, interpret, qk_in_kernel,
                                    qkv_rows)
      return attend_key_sets(
          lambda kb, vb: [kernel_part(k, v, cache.ctx_len, tuning, interpret, kb, vb)], qkv_rows)
    ctx = kernel_part(k, v, cache.ctx_len, tuning, interpret)
  else:
    ok = _both(live_b1c, _window_ok(q_pos_bs[:, :, None], cache.pos[:, None, :], window))
    ctx = xla_part(k, v, ok, chunk)
  return attend_key_sets(lambda kb, vb: [ctx, xla_part(kb, vb, blk_ok)], qkv_rows)


def draft_block(params, cfg: DraftConfig, cache: DraftCache, block_tokens_bs, start_b, embed_vd,
                head_dv, ctx_chunk=CTX_CHUNK, ctx_impl="auto", kernel_chunk=None,
                kernel_tuning=(), block_in_kernel=True, packed_io=True, qk_in_kernel=True):
  """One non-causal block [bonus, MASK...] at positions start.. over the ctx cache -> [B, S, V] f32.

  Ctx keys are the cache rows < ctx_len, in chunks of ctx_chunk rows when that divides the
  capacity (init_draft_cache makes it so). ctx_impl 'xla' reads every row of the capacity
  (masked); 'pallas' (the fused kernel, full-attention layers) reads only rows < ctx_len, in
  programs of kernel_chunk rows (None: ctx_attention.default_tuning's choice; kernel_tuning:
  (field, value) pairs overriding its other fields); 'auto' (the decode default): see
  resolve_ctx_impl. block_in_kernel: the block's own keys as one more program of the kernel
  (where every block key is visible) instead of an XLA part merged after it. packed_io (with
  block_in_kernel, pack_for_decode'd params): the kernel reads q and the block's K/V from the
  q|k|v dot's packed output and a second kernel merges its partials into the o_proj input
  (attend_packed_kernel); False: the older form (q, k, v sliced and transposed for the kernel,
  its partials merged by XLA). qk_in_kernel (with packed_io; the default): the kernel also
  applies q_norm / k_norm and rope to the dot's raw q and k heads, so no XLA norm / rope launch
  runs between the q|k|v dot and the kernel (H200, bench_k26_full's draft at 46k: 530.6 us vs
  547.9 us with the XLA norm + rope fusion, same logits; results/h200/2026-12-01/s5_draft_io.log).
  Params with pack_token_qkv's table: layer 0's q|k|v rows are looked up, not computed.
  """
  ctx_impl = resolve_ctx_impl(ctx_impl)
  B, S = block_tokens_bs.shape
  x = _embed(params, cfg, block_tokens_bs, embed_vd)
  q_pos = start_b.astype(jnp.int32)[:, None] + jnp.arange(S, dtype=jnp.int32)
  L = cache.pos.shape[1]
  chunk = ctx_chunk if L % ctx_chunk == 0 else None
  live = (jnp.arange(L)[None, :] < cache.ctx_len[:, None])[:, None, :]  # [B, 1, L]
  qkv0 = token_qkv_rows(params, block_tokens_bs)
  for i, lp in enumerate(params["layers"]):
    attend = _attention(cfg, cache, i, lp, q_pos, live, ctx_impl, chunk, kernel_chunk,
                        kernel_tuning, block_in_kernel, packed_io, qk_in_kernel,
                        qkv0 if i == 0 else None)
    x = _layer(lp, cfg, x, q_pos, attend)
  return _logits(params, cfg, x, head_dv)


def draft_train_forward(params, cfg: DraftConfig, ctx_taps_bsz, anchors_ba, block_tokens_baw,
                        embed_vd, head_dv):
  """Training forward (DFlash recipe): A blocks per row, one forward -> [B, A, W, V] f32.

  Block a sits at positions anchors[a] + 0..W-1; it sees ctx keys at positions < anchors[a]
  (ctx row j = position j) and its own block keys; nothing else. Same layers and attention
  rule as draft_block.
  """
  B, Sc, _ = ctx_taps_bsz.shape
  _, A, W = block_tokens_baw.shape
  c = context_feature(params, cfg, ctx_taps_bsz)
  ctx_pos = jnp.broadcast_to(jnp.arange(Sc, dtype=jnp.int32), (B, Sc))
  x = _embed(params, cfg, block_tokens_baw.reshape(B, A * W), embed_vd)
  anchor_q = jnp.repeat(anchors_ba.astype(jnp.int32), W, axis=1)  # [B, A*W]
  q_pos = anchor_q + jnp.tile(jnp.arange(W, dtype=jnp.int32), A)
  blk_id = jnp.repeat(jnp.arange(A), W)
  same = jnp.broadcast_to(blk_id[:, None] == blk_id[None, :], (B, A * W, A * W))
  before = ctx_pos[:, None, :] < anchor_q[:, :, None]
  for i, lp in enumerate(params["layers"]):
    ctx_k, ctx_v = _kv(lp, cfg, c, ctx_pos)
    ctx_ok = _both(before, _window_ok(q_pos[:, :, None], ctx_pos[:, None, :], cfg.window(i)))
    ctx = xla_part(jnp.swapaxes(ctx_k, 1, 2), jnp.swapaxes(ctx_v, 1, 2), ctx_ok)
    blk_ok = _block_mask(cfg, i, q_pos, same)
    x = _layer(lp, cfg, x, q_pos,
               attend_key_sets(lambda kb, vb, ctx=ctx, ok=blk_ok: [ctx, xla_part(kb, vb, ok)]))
  return _logits(params, cfg, x, head_dv).reshape(B, A, W, -1)
