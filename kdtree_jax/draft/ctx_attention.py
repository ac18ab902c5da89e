"""The draft's ctx attention as one fused Pallas (Triton) kernel: flash-decoding over the cache.

The XLA form (model._chunked_partial_attention) writes the f32 scores of every cache row to HBM
and reads them twice more (max, exp) before the PV dot: about 3x the K/V bytes at U*S = 64 query
rows per kv head, 5x at 128. Here each program keeps one chunk's scores on chip: program
(b, g, j) streams rows [j*chunk, (j+1)*chunk) of kv head g in tiles of block_k rows with an
online softmax, and stops at ctx_len (rows past it are never read, so the cost follows the
context length, not the capacity). It returns per-chunk partials, the chunk's normalised output
in the cache dtype and its f32 log-sum-exp (as flash-decoding and vLLM's paged attention v2 keep
them: the partials' bytes are M/chunk of the chunk's K/V bytes at bf16, half that of f32), which
the caller merges through their log-sum-exps with the block part.

With Tuning.programs the grid is that many programs per kv head sharing the tiles below
ctx_len evenly instead of fixed chunks (one wave on the SMs at any context length). Given the
block's own K/V (draft_block's block_in_kernel), one more program attends to them, so the
caller merges one set of partials and runs no XLA attention for the block.
packed_block_partials takes q and the block's K/V straight from the draft layer's packed arrays
(q heads as an [S, U, Y] block reshaped to S*U rows in the kernel, k and v heads as strided
[S, Y] blocks), and merge_to_heads merges the partials in one more launch, writing the o_proj
input layout, in place of XLA's slices, transposes and multi-kernel merge.

Only the length mask is applied (full-attention layers); sliding-window layers take the XLA
path. Letters: B batch, G kv heads, L cache rows, Y head_dim (the package glossary), and this
kernel's own M = U*S query rows per kv head.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tree_verify.merge_triton import split_pieces  # power-of-two row pieces


NUM_SMS = 132  # H200 SXM
LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * LOG2_E)
LN_2 = 0.6931471805599453  # ln(2^x) = x * LN_2


@dataclasses.dataclass(frozen=True)
class Tuning:
  """chunk: cache rows per program (divides L); block_k: rows per tile of the online softmax;
  programs (replaces chunk when set): that many programs per (batch row, kv head) share the
  tiles below ctx_len evenly (tiles p*T//P .. (p+1)*T//P - 1 of T = cdiv(ctx_len, block_k)),
  so every program streams the same number of rows whatever the context length (P = the SMs:
  one wave, none idle). A/B options (H200 timing pending; bench_draft.py rows): join_halves:
  with the in-kernel q/k norm + rope, the roped halves are joined back into whole heads once per
  program (two selection dots each, exact), so the tile loop runs one full-width score dot as
  without it (not two half-width ones); exp2: the online softmax in base 2 (scale * log2(e)
  folded into the scores, exp2 per element, the lse converted back to base e); merge_pieces:
  merge_to_heads' programs each merge Y / merge_pieces columns of a query row (more, smaller
  programs); head_groups (packed_block_partials only): each kv head's U query heads split into
  that many groups of U / head_groups, one program row per group (the grid's kv-head axis
  becomes G * head_groups "virtual kv heads" of M / head_groups query rows each; groups of one kv
  head read the same K/V tiles, mostly from L2 when they run side by side)."""
  chunk: int = 1024
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 2
  programs: int | None = None
  join_halves: bool = False
  exp2: bool = True  # H200 s5 draft_gap: draft_block 524.5 vs 532.7 us (base e), same rel L2 vs f32
  merge_pieces: int = 1
  head_groups: int = 1


def default_tuning(batch: int, kv_heads: int, rows_m: int, capacity: int,
                   chunk: int | None = None) -> Tuning:
  """With `chunk`: programs of that many cache rows. Else (the decode default) one wave over the
  SMs: NUM_SMS // (batch x kv heads) - 1 programs per (row, kv head) share the tiles below
  ctx_len (the last SM of each group takes the block's own keys under block_in_kernel), 64-row
  tiles, 8 warps, 3 stages: the H200's fastest draft_block of bench_k26_full's draft at 46k
  (1 kv head: 576.7 us with the block in the kernel and packed weights, vs 644.0 us for 512-row
  chunks, 4 warps for M <= 64; results/h200/2026-12-01/s3_draft_share.log)."""
  if chunk is not None:
    return Tuning(chunk=chunk, block_k=min(64, chunk), num_warps=8 if rows_m > 64 else 4)
  del capacity
  programs = max(1, NUM_SMS // (batch * kv_heads) - 1)
  return Tuning(block_k=64, num_warps=8, num_stages=3, programs=programs)


def supports(q_bgmy, k_bgly, tuning: Tuning = Tuning()) -> bool:
  """Shapes the kernel handles: bf16 cache, M and Y multiples of 16 (Triton dot tiles), whole
  power-of-two chunks (Triton blocks) of whole power-of-two tiles of at least 16 rows."""
  M, Y = q_bgmy.shape[2:]
  L, c, bk = k_bgly.shape[2], tuning.chunk, tuning.block_k
  pow2 = lambda x: x & (x - 1) == 0
  rows_ok = (L % bk == 0 and tuning.programs >= 1 if tuning.programs is not None else
             pow2(c) and L % c == 0 and c % bk == 0)
  return (k_bgly.dtype == jnp.bfloat16 and M % 16 == 0 and Y % 16 == 0 and bk >= 16
          and pow2(bk) and rows_ok)


def supports_block(kb_bgsy) -> bool:
  """Block K/V the kernel can take as its extra program: bf16, S a power of two >= 16 rows."""
  S = kb_bgsy.shape[2]
  return kb_bgsy.dtype == jnp.bfloat16 and S >= 16 and S & (S - 1) == 0


def _online_step(q, k, v, live, carry, scale, exp=jnp.exp):
  """One tile of the online softmax: (o, m, l) updated with keys k / values v (live: [rows]
  mask, None = all); m stays finite once any tile had a live key. q, k: arrays, or tuples of
  column pieces of them (the halves of roped heads: scores = the sum of the pieces' dots).
  exp: jnp.exp, or jnp.exp2 with scale carrying log2(e) (m, l then in base 2)."""
  o, m, l = carry
  pieces = zip(q, k) if isinstance(q, tuple) else [(q, k)]
  s = functools.reduce(jnp.add, [pltriton.dot(a, b, trans_b=True) for a, b in pieces]) * scale
  if live is not None:
    s = jnp.where(live[None, :], s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  corr = exp(m - m_new)
  p = exp(s - m_new[:, None])
  o = o * corr[:, None] + pltriton.dot(p.astype(v.dtype), v)
  return o, m_new, l * corr + jnp.sum(p, axis=1)


def _tile_range(ctx_len, j, n_chunks, chunk, block_k, split):
  """(first tile, end tile, rows limit) of program j < n_chunks in its K/V ref: chunk j's rows
  below ctx_len (ref = the chunk), or with split, tiles j*T//n .. (j+1)*T//n - 1 of the
  T = cdiv(ctx_len, block_k) tiles below ctx_len (ref = every row)."""
  if split:
    tiles = pl.cdiv(ctx_len, block_k)
    return j * tiles // n_chunks, (j + 1) * tiles // n_chunks, ctx_len
  valid = jnp.clip(ctx_len - j * chunk, 0, chunk)
  return 0, pl.cdiv(valid, block_k), valid


def _halves(ref, *idx):
  """ref[*idx, :Y/2] and ref[*idx, Y/2:] (the rotate-half pairs of a head)."""
  h = ref.shape[-1] // 2
  return ref[(*idx, pl.ds(0, h))], ref[(*idx, pl.ds(h, h))]


def _norm_rope(x1, x2, w_ref, cos, sin, eps, dtype):
  """model.rms_norm then model.rope of a head given as its halves x1, x2 [..., Y/2] (cos, sin
  [..., Y/2] f32, broadcast): the same f32 statistics and roundings (the normed head in the
  input dtype, the roped one cast to it, then to `dtype`) -> the roped halves in dtype."""
  f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
  Y = 2 * x1.shape[-1]
  ms = (jnp.sum(f1 * f1, axis=-1, keepdims=True) + jnp.sum(f2 * f2, axis=-1, keepdims=True)) / Y
  r = jax.lax.rsqrt(ms + eps)
  w1, w2 = _halves(w_ref)
  n1 = (w1 * (f1 * r).astype(x1.dtype)).astype(jnp.float32)
  n2 = (w2 * (f2 * r).astype(x1.dtype)).astype(jnp.float32)
  out = lambda x: x.astype(x1.dtype).astype(dtype)
  return out(n1 * cos + -n2 * sin), out(n2 * cos + n1 * sin)


def _join(x1, x2):
  """Halves x1, x2 [R, Y/2] -> [R, Y] (x1 | x2) through two selection dots (products by 1 and 0
  accumulated in f32: exact), since the Triton lowering concatenates only [..., 1] pieces."""
  h = x1.shape[-1]
  rows = jax.lax.broadcasted_iota(jnp.int32, (h, 2 * h), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (h, 2 * h), 1)
  pick = lambda off: jnp.where(cols == rows + off, 1.0, 0.0).astype(x1.dtype)
  return (pltriton.dot(x1, pick(0)) + pltriton.dot(x2, pick(h))).astype(x1.dtype)


def _block_inputs(q_ref, rope_refs, rope_eps, dtype, join):
  """The program's queries: q [M, Y] (q_ref [M, Y], or [S, U, Y] as S*U rows), or with
  rope_refs (q_norm, k_norm, cos, sin) q_ref's raw heads normed and roped here, as the halves
  (q1, q2) [S*U, Y/2] in dtype (join: as whole heads [S*U, Y] again)."""
  if rope_refs is None:
    q = q_ref[...]
    return q.reshape(-1, q.shape[-1])  # packed_block: [S, U, Y] -> [S*U, Y] rows
  qn_ref, _, cos_ref, sin_ref = rope_refs
  S, U, h = q_ref.shape[0], q_ref.shape[1], q_ref.shape[2] // 2
  cos, sin = cos_ref[...][:, None, :], sin_ref[...][:, None, :]
  q1, q2 = _norm_rope(*_halves(q_ref, slice(None), slice(None)), qn_ref, cos, sin, rope_eps, dtype)
  q1, q2 = q1.reshape(S * U, h), q2.reshape(S * U, h)
  return _join(q1, q2) if join else (q1, q2)


def _kernel(len_ref, q_ref, k_ref, v_ref, *refs, scale, block_k, n_chunks, split, n_blk,
            rope_eps, join, exp2):
  """One (batch row, kv head, program j): j < n_chunks: online softmax over its tiles of the
  rows below ctx_len (_tile_range); j == n_chunks (only with block K/V refs, n_blk = 2): every
  row of the block's own K/V. With rope_eps (then 4 more refs: q_norm, k_norm [Y], cos, sin
  [S, Y/2]) q and the block's k arrive raw from the q|k|v dot and are normed and roped here,
  and the scores are the sum of the two halves' dots (join: the roped halves joined back into
  whole heads once, one full-width dot per tile). exp2: base-2 softmax (Tuning.exp2)."""
  blk_refs, rope_refs = refs[:n_blk], (refs[n_blk:n_blk + 4] if rope_eps is not None else None)
  o_ref, lse_ref = refs[-2:]
  j = pl.program_id(2)
  first, end, limit = _tile_range(len_ref[0], j, n_chunks, k_ref.shape[0], block_k, split)
  end = jnp.where(j < n_chunks, end, first)  # the block's program reads no cache rows
  join = join and rope_refs is not None
  q = _block_inputs(q_ref, rope_refs, rope_eps, k_ref.dtype, join)
  M, Y = (q[0].shape[0], k_ref.shape[-1]) if isinstance(q, tuple) else q.shape
  halves = rope_refs is not None and not join
  keys = _halves if halves else (lambda ref, rows: ref[rows, :])  # a tile's keys
  exp, scale = (jnp.exp2, scale * LOG2_E) if exp2 else (jnp.exp, scale)

  def tile(t, carry):
    rows = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
    live = (t * block_k + jnp.arange(block_k)) < limit  # every tile has a live row
    return _online_step(q, keys(k_ref, rows), v_ref[rows, :], live, carry, scale, exp)

  init = (jnp.zeros((M, Y), jnp.float32), jnp.full((M,), -jnp.inf, jnp.float32),
          jnp.zeros((M,), jnp.float32))
  o, m, l = jax.lax.fori_loop(first, end, tile, init)
  if blk_refs:
    kb_ref, vb_ref = blk_refs

    def block(c):
      if rope_refs:
        _, kn_ref, cos_ref, sin_ref = rope_refs
        kb = _norm_rope(*_halves(kb_ref, slice(None)), kn_ref, cos_ref[...], sin_ref[...],
                        rope_eps, k_ref.dtype)
        kb = _join(*kb) if join else kb
      else:
        kb = kb_ref[...]
      return _online_step(q, kb, vb_ref[...].astype(k_ref.dtype), None, c, scale, exp)
    o, m, l = jax.lax.cond(j == n_chunks, block, lambda c: c, (o, m, l))
  seen = l > 0  # False only for a chunk wholly past ctx_len (then m = -inf, o = 0)
  o_ref[...] = (o / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  # base 2: sum_k exp(s_k) = 2^m * l, so lse = m ln 2 + ln l
  lse = (m * LN_2 if exp2 else m) + jnp.log(jnp.where(seen, l, 1.0))
  lse_ref[...] = jnp.where(seen, lse, -jnp.inf)


def _call(len_b, q, q_spec, k_bgly, v_bgly, blk, blk_specs, M, *, scale, tuning, interpret,
          rope=(), rope_specs=(), rope_eps=None, groups=1):
  """The pallas_call over grid (B, G * groups, programs): q of (virtual) kv head g by q_spec
  ([M, Y], or [S, U, Y] reshaped to M rows in the kernel), the cache of kv head g // groups by
  tuning's programs or chunks, the block's K/V (blk, by blk_specs: [S, Y] each) as one more
  program if given, with rope_eps the norm weights and rope tables (rope, by rope_specs) for
  _kernel's in-kernel norm + rope -> (o [B, G * groups, P, M, Y] in the cache dtype, lse
  [B, G * groups, P, M] f32)."""
  B, G, L, Y = k_bgly.shape
  split = tuning.programs is not None
  n, c = (tuning.programs, L) if split else (L // tuning.chunk, tuning.chunk)
  rows = lambda x: x[:, :, None] if split else x.reshape(B, G, n, c, Y)  # [B, G, n or 1, c, Y]
  kv_spec = pl.BlockSpec((None, None, None, c, Y), lambda b, g, j: (
      b, g // groups, 0 if split else jnp.minimum(j, n - 1), 0, 0))
  row_spec = pl.BlockSpec((None, None, None, M), lambda b, g, j: (b, g, j, 0))
  programs = n + (1 if blk else 0)
  return pl.pallas_call(
      functools.partial(_kernel, scale=scale, block_k=tuning.block_k, n_chunks=n, split=split,
                        n_blk=len(blk), rope_eps=rope_eps, join=tuning.join_halves,
                        exp2=tuning.exp2),
      grid=(B, G * groups, programs),
      in_specs=[pl.BlockSpec((1,), lambda b, g, j: (b,)), q_spec, kv_spec, kv_spec, *blk_specs,
                *rope_specs],
      out_specs=[pl.BlockSpec((None, None, None, M, Y), lambda b, g, j: (b, g, j, 0, 0)),
                 row_spec],
      out_shape=[jax.ShapeDtypeStruct((B, G * groups, programs, M, Y), k_bgly.dtype),
                 jax.ShapeDtypeStruct((B, G * groups, programs, M), jnp.float32)],
      compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps,
                                              num_stages=tuning.num_stages),
      interpret=interpret, name="draft_ctx_attention",
  )(len_b.astype(jnp.int32), q, rows(k_bgly), rows(v_bgly), *blk, *rope)


@functools.partial(jax.jit, static_argnames=("scale", "tuning", "interpret"))
def ctx_partials(q_bgmy, k_bgly, v_bgly, ctx_len_b, kb_bgsy=None, vb_bgsy=None, *, scale,
                 tuning: Tuning = Tuning(), interpret=False):
  """Per-program partials over cache rows < ctx_len: o [B, G, N, M, Y] = softmax(s) v over the
  program's rows (a chunk, or its share with tuning.programs), in the cache dtype (0 for a
  program with no row below ctx_len), and lse [B, G, N, M] = log sum exp(s) in f32 (-inf for
  such a program). With the block's own K/V kb, vb [B, G, S, Y] (every block key visible to
  every query: non-causal, full attention), one more partial N + 1 over them (a program of its
  own, so the caller merges one set of partials)."""
  M, Y = q_bgmy.shape[2:]
  dt = k_bgly.dtype
  blk = () if kb_bgsy is None else (kb_bgsy.astype(dt), vb_bgsy.astype(dt))
  blk_specs = [pl.BlockSpec((None, None, *x.shape[2:]), lambda b, g, j: (b, g, 0, 0))
               for x in blk]
  q_spec = pl.BlockSpec((None, None, M, Y), lambda b, g, j: (b, g, 0, 0))
  return _call(ctx_len_b, q_bgmy.astype(dt), q_spec, k_bgly, v_bgly, blk, blk_specs, M,
               scale=scale, tuning=tuning, interpret=interpret)


def supports_packed_block(qk_bshy, kv_heads) -> bool:
  """packed_block_partials' shapes: bf16, S >= 16 and U = H/G query heads per kv head powers of
  two (Triton blocks), Y a multiple of 16."""
  S, HG, Y = qk_bshy.shape[1:]
  U = (HG - kv_heads) // kv_heads
  pow2 = lambda x: x >= 1 and x & (x - 1) == 0
  return (qk_bshy.dtype == jnp.bfloat16 and S >= 16 and pow2(S) and pow2(U) and Y % 16 == 0
          and S * U % 16 == 0)


@functools.partial(jax.jit, static_argnames=("kv_heads", "scale", "tuning", "interpret",
                                             "rope_eps"))
def packed_block_partials(qk_bshy, qkv_bshy, k_bgly, v_bgly, ctx_len_b, rope=None, *, kv_heads,
                          scale, tuning: Tuning = Tuning(), interpret=False, rope_eps=None):
  """ctx_partials with the block's keys, reading q and the block's K/V where the projections
  left them (no slice, transpose or copy between): qk [B, S, H+G, Y] = the normed, roped q | k
  heads, qkv [B, S, H+2G, Y] = the q|k|v dot's output (its v heads). With rope = (q_norm,
  k_norm [Y], cos, sin [B, S, Y/2] f32) and rope_eps, qk is None and the kernel norms and ropes
  qkv's raw q and k heads itself (model.rms_norm + model.rope, same roundings). Program rows are
  the S*U queries of kv head g in (s, u) order: o [B, G, P, S*U, Y], lse [B, G, P, S*U]; the
  last program P-1 takes the block's keys (with tuning.head_groups = n: G*n virtual kv heads of
  S*U/n rows each, the layout merge_to_heads reads the same way)."""
  B, S, HG2, Y = qkv_bshy.shape
  G = kv_heads
  H = HG2 - 2 * G
  U = H // G
  dt = k_bgly.dtype
  if rope is None:
    qk, qkv = qk_bshy.astype(dt), qkv_bshy.astype(dt)
  else:  # raw heads, normed and roped in their own dtype in the kernel, then cast to dt there
    qk = qkv = qkv_bshy
  hg = tuning.head_groups
  if U % hg:
    raise ValueError(f"head_groups={hg} must divide the {U} query heads per kv head")
  U //= hg  # program row g = virtual kv head g: query heads g*U .. g*U+U-1 of kv head g // hg
  q_spec = pl.BlockSpec((None, S, U, Y), lambda b, g, j: (b, 0, g, 0))
  head = lambda first: pl.BlockSpec((None, S, None, Y),
                                    lambda b, g, j: (b, 0, first + g // hg, 0))
  rope_specs = ()
  if rope is not None:
    vec = pl.BlockSpec((Y,), lambda b, g, j: (0,))
    table = pl.BlockSpec((None, S, Y // 2), lambda b, g, j: (b, 0, 0))
    rope_specs = (vec, vec, table, table)
  return _call(ctx_len_b, qk, q_spec, k_bgly, v_bgly, (qk, qkv), (head(H), head(H + G)),
               S * U, scale=scale, tuning=tuning, interpret=interpret, rope=tuple(rope or ()),
               rope_specs=rope_specs, rope_eps=rope_eps, groups=hg)


def _merge_kernel(o_ref, lse_ref, out_ref):
  """One query row: o_ref [P, Y] normalised partials, lse_ref [P] their log-sum-exps (-inf: a
  program that saw no key) -> out [Y] = sum_p o_p exp(lse_p - m) / sum_p exp(lse_p - m)."""
  pieces = split_pieces(lse_ref.shape[0])
  lses = [lse_ref[pl.ds(start, size)] for start, size in pieces]
  m = functools.reduce(jnp.maximum, [jnp.max(x) for x in lses])
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  ws = [jnp.exp(x - m_safe) for x in lses]
  den = functools.reduce(jnp.add, [jnp.sum(w) for w in ws])
  acc = functools.reduce(jnp.add, [
      jnp.sum(w[:, None] * o_ref[pl.ds(start, size), :].astype(jnp.float32), axis=0)
      for w, (start, size) in zip(ws, pieces)])
  out_ref[...] = (acc / jnp.where(den > 0, den, 1.0)).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("heads", "dtype", "interpret", "pieces"))
def merge_to_heads(o_bgpmy, lse_bgpm, *, heads, dtype, interpret=False, pieces=1):
  """packed_block_partials' P partials per query row merged through their log-sum-exps, in one
  launch (one program per row and column piece: Y / pieces columns each), written straight into
  the o_proj input layout [B, S, H*Y] in `dtype` (row s*U + u of kv head g = head g*U + u of
  block token s)."""
  B, G, P, M, Y = o_bgpmy.shape
  U = heads // G
  S = M // U
  w = Y // pieces
  return pl.pallas_call(
      _merge_kernel,
      grid=(B, G, M, pieces),
      in_specs=[pl.BlockSpec((None, None, P, None, w), lambda b, g, m, c: (b, g, 0, m, c)),
                pl.BlockSpec((None, None, P, None), lambda b, g, m, c: (b, g, 0, m))],
      out_specs=pl.BlockSpec((None, None, w),
                             lambda b, g, m, c: (b, m // U, (g * U + m % U) * pieces + c)),
      out_shape=jax.ShapeDtypeStruct((B, S, heads * Y), dtype),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="draft_ctx_merge",
  )(o_bgpmy, lse_bgpm)
