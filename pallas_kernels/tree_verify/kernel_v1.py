"""v1 of the Mosaic GPU (sm90) tree-verify kernel (kept for A/B runs: Tuning(kernel="v1")).

Letters: B batch, N tree nodes, H heads, L cache rows, C = 576 latent width, R = 512 value width,
M padded (node, head) rows (node-major, row = node * H + head), S KV splits, T block_kv.

Design: the committed prefix [0, len) is streamed by a Mosaic GPU kernel; grid (M/64, S, B); each CTA
holds a 64 x C Q tile in SMEM while a TMA warpgroup streams T x C KV tiles through a ring of SMEM
stages (V is the first R columns of the same tile). Two compute warpgroups each own R/2 output
columns. With shared_p, warpgroup 0 alone scores the tile (QK^T, online softmax) and hands P and the
rescale factor to warpgroup 1 through SMEM (no redundant QK^T; wg0's next QK^T overlaps wg1's PV);
otherwise both score the whole tile. Only the split's last tile is
masked (prefix end, ragged L). The N x N tree block is tiny and done in XLA; the kernel's fp32
partials (O, base-2 LSE per split) and the tree block are merged by LSE in XLA (`merge`).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.tree_verify.tuning import BLOCK_M, Tuning, default_tuning

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_BF16_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_F32_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
_ROW = plgpu.Layout.WGMMA.reduce(1)


def _bcast_rows(x, shape):
  """[64] row statistic -> [64, n] broadcast along columns."""
  return lax.broadcast_in_dim(x, shape, [0])


def _row_full(value):
  return plgpu.layout_cast(jnp.full((BLOCK_M,), value, jnp.float32), _ROW)


def _split_range(length, s_idx, t: Tuning):
  """KV tiles [lo, hi) of this split, and the first tile that needs the length mask."""
  nt = lax.div(length + (t.block_kv - 1), t.block_kv)
  chunk = lax.div(nt + (t.num_splits - 1), t.num_splits)
  lo = jnp.minimum(s_idx * chunk, nt)
  hi = jnp.minimum(lo + chunk, nt)
  full_hi = jnp.maximum(jnp.minimum(hi, lax.div(length, t.block_kv)), lo)
  return lo, hi, full_hi


def _tile_start(tile, t: Tuning, l):
  """First cache row of KV tile `tile`, clamped so the TMA box stays inside [0, L)."""
  return pl.multiple_of(jnp.minimum(tile * t.block_kv, l - t.block_kv), 8)


def _memory_wg(q_ref, kv_ref, q_smem, kv_smem, q_bar, kv_bar, free_bar, *, b, m_idx, lo, hi, t, l):
  """TMA producer: the Q tile once, then the split's KV tiles through the SMEM ring."""
  rows = pl.ds(pl.multiple_of(m_idx * BLOCK_M, BLOCK_M), BLOCK_M)
  plgpu.copy_gmem_to_smem(q_ref.at[b, rows], q_smem, q_bar)

  @pl.loop(0, hi - lo)
  def _load(i):
    slot = lax.rem(i, t.stages)

    @pl.when(i >= t.stages)
    def _():
      plgpu.barrier_wait(free_bar.at[slot])

    start = _tile_start(lo + i, t, l)
    plgpu.copy_gmem_to_smem(kv_ref.at[b, pl.ds(start, t.block_kv)], kv_smem.at[slot],
                            kv_bar.at[slot])

  @pl.loop(jnp.maximum(hi - lo - t.stages, 0), hi - lo)
  def _drain(i):
    plgpu.barrier_wait(free_bar.at[lax.rem(i, t.stages)])


def _scores(q_smem, keys):
  """S = Q K^T for one KV (sub)tile, f32 [64, keys]."""
  def body(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, keys.T)
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC((BLOCK_M, keys.shape[0]), jnp.float32))


def _sync(bar):
  plgpu.barrier_arrive(bar)
  plgpu.barrier_wait(bar)


class _Ctx:
  """Per-CTA refs and scalars shared by the compute steps."""

  def __init__(self, **kw):
    self.__dict__.update(kw)


def _softmax_update(c, s, tile, carry, masked):
  """Mask (tail tile only), online-softmax update; returns (p, alpha, carry without acc)."""
  m, l = carry
  if masked:
    pos = _tile_start(tile, c.t, c.l) + plgpu.broadcasted_iota(
        jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
    vis = (pos >= tile * c.t.block_kv) & (pos < c.length)
    s = jnp.where(vis, s, -jnp.inf)
  m_new = jnp.maximum(m, s.max(axis=1))
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(s - _bcast_rows(m_new, s.shape))
  return p, alpha, (m_new, l * alpha + p.sum(axis=1))


def _pv(c, acc, a, v):
  """acc += a @ v (a: registers or SMEM; v: SMEM view), waited."""
  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, v)

  def body_out(acc_ref):
    body(acc_ref)
    return acc_ref[...]
  if c.interpret:  # the GPU interpreter has no run_state; same math, one more accumulator
    return acc + pl.run_scoped(body_out, plgpu.ACC(acc.shape, jnp.float32))
  return pl.run_state(body)(plgpu.ACC.init(acc))


def _p_ref(c, j):
  """P staging buffer j (2-D on the GPU, where only the shared one exists)."""
  return c.p_smem.at[j] if len(c.p_smem.shape) == 3 else c.p_smem


def _v_half(c, kv, w):
  r2 = c.r // 2
  return kv.at[:, pl.ds(w * r2, r2)]


def _step_scorer(c, w, i, carry, masked):
  """Score one KV tile (wg0 when shared_p, both wgs otherwise), PV into this wg's half."""
  acc, m, l = carry
  tile = c.lo + i
  slot = lax.rem(i, c.t.stages)
  plgpu.barrier_wait(c.kv_bar.at[slot])
  kv = c.kv_smem.at[slot]
  s = _scores(c.q_smem, kv) * c.scale_log2
  p, alpha, (m, l) = _softmax_update(c, s, tile, (m, l), masked)
  p16 = p.astype(c.dtype)
  a = p16
  if c.t.shared_p:
    @pl.when(i > 0)
    def _():
      plgpu.barrier_wait(c.p_free)
    _p_ref(c, 0)[...] = p16
    c.stat_smem.at[0][...] = alpha
    plgpu.commit_smem()
    plgpu.barrier_arrive(c.p_ready)
    a = _p_ref(c, 0) if c.interpret else p16
  elif c.interpret:  # the GPU interpreter's wgmma takes A from SMEM only
    _p_ref(c, w)[...] = p16
    a = _p_ref(c, w)
  acc = _pv(c, acc * _bcast_rows(alpha, acc.shape), a, _v_half(c, kv, w))
  plgpu.barrier_arrive(c.free_bar.at[slot])
  return acc, m, l


def _step_follower(c, w, i, acc):
  """shared_p, wg1: rescale by wg0's alpha and PV with wg0's P from SMEM."""
  slot = lax.rem(i, c.t.stages)
  plgpu.barrier_wait(c.kv_bar.at[slot])
  plgpu.barrier_wait(c.p_ready)
  alpha = plgpu.load(c.stat_smem.at[0], layout=_ROW, optimized=False)
  acc = _pv(c, acc * _bcast_rows(alpha, acc.shape), _p_ref(c, 0), _v_half(c, c.kv_smem.at[slot], w))
  plgpu.barrier_arrive(c.p_free)
  plgpu.barrier_arrive(c.free_bar.at[slot])
  return acc


def _loop(c, w, acc):
  """All tiles of the split for warpgroup w; returns (acc, m, l) (m, l only meaningful on scorers)."""
  n_full = c.full_hi - c.lo
  n_all = c.hi - c.lo
  m, l = _row_full(-jnp.inf), _row_full(0.0)
  if c.t.shared_p and w == 1:
    acc = lax.fori_loop(0, n_all, lambda i, a: _step_follower(c, w, i, a), acc)
    return acc, m, l
  carry = lax.fori_loop(0, n_full, lambda i, cr: _step_scorer(c, w, i, cr, False), (acc, m, l))
  carry = lax.fori_loop(n_full, n_all, lambda i, cr: _step_scorer(c, w, i, cr, True), carry)
  if c.t.shared_p:
    @pl.when(n_all > 0)
    def _():
      plgpu.barrier_wait(c.p_free)  # observe wg1's last release (balanced barrier phases)
  return carry


def _compute_wg(c, w):
  """Compute warpgroup w: loop over the split's tiles, then normalise and store O half and LSE."""
  plgpu.set_max_registers(232, action="increase")
  plgpu.barrier_wait(c.q_bar)
  r2 = c.r // 2
  acc = plgpu.layout_cast(jnp.zeros((BLOCK_M, r2), jnp.float32), plgpu.Layout.WGMMA)
  acc, m, l = _loop(c, w, acc)
  nonempty = l > 0.0
  inv = 1.0 / jnp.where(nonempty, l, 1.0)
  lse2 = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, l, 1.0)), -jnp.inf)
  if c.t.shared_p and w == 0:
    c.stat_smem.at[1][...] = inv
  _sync(c.wg_bar)  # both warpgroups are past their last read of Q/KV/P: the union may be reused
  if c.t.shared_p and w == 1:
    inv = plgpu.load(c.stat_smem.at[1], layout=_ROW, optimized=False)
  o_smem = c.o_smem.at[w]
  o_smem[...] = acc * _bcast_rows(inv, acc.shape)
  if w == 0:
    c.lse_smem[...] = lse2
  plgpu.commit_smem()
  rows = pl.ds(pl.multiple_of(c.m_idx * BLOCK_M, BLOCK_M), BLOCK_M)
  plgpu.copy_smem_to_gmem(o_smem, c.o_ref.at[c.b, c.s_idx, rows, pl.ds(w * r2, r2)])
  if w == 0:
    plgpu.copy_smem_to_gmem(c.lse_smem, c.lse_ref.at[c.b, c.s_idx, rows])
  plgpu.wait_smem_to_gmem(0)


def _make_body(t: Tuning, l, r, scale_log2, dtype, interpret):
  """Kernel body for static shapes."""

  def body(len_ref, q_ref, kv_ref, o_ref, lse_ref, union, stat_smem, lse_smem, q_bar, kv_bar,
           free_bar, wg_bar, p_ready, p_free):
    (q_smem, kv_smem, p_smem), (o_smem,) = union
    m_idx, s_idx, b = lax.axis_index("m"), lax.axis_index("s"), lax.axis_index("b")
    wg = lax.axis_index("wg")
    length = len_ref[b]
    lo, hi, full_hi = _split_range(length, s_idx, t)
    c = _Ctx(t=t, l=l, interpret=interpret, r=r, scale_log2=scale_log2, dtype=dtype, q_smem=q_smem, kv_smem=kv_smem,
             p_smem=p_smem, o_smem=o_smem, stat_smem=stat_smem, lse_smem=lse_smem, q_bar=q_bar,
             kv_bar=kv_bar, free_bar=free_bar, wg_bar=wg_bar, p_ready=p_ready,
             p_free=p_free, o_ref=o_ref, lse_ref=lse_ref,
             m_idx=m_idx, s_idx=s_idx, b=b, length=length, lo=lo, hi=hi, full_hi=full_hi)
    for w in range(2):
      pl.when(wg == w)(functools.partial(_compute_wg, c, w))

    @pl.when(wg == 2)
    def _():
      plgpu.set_max_registers(40, action="decrease")
      _memory_wg(q_ref, kv_ref, q_smem, kv_smem, q_bar, kv_bar, free_bar, b=b, m_idx=m_idx,
                 lo=lo, hi=hi, t=t, l=l)

  return body


def _scratch(t: Tuning, c, r, dtype, interpret):
  """SMEM: a union of (Q, KV ring, P) with the fp32 output staging, plus stats and barriers."""
  q = plgpu.SMEM((BLOCK_M, c), dtype, transforms=_BF16_TRANSFORMS)
  kv = plgpu.SMEM((t.stages, t.block_kv, c), dtype, transforms=_BF16_TRANSFORMS)
  n_p = 2 if interpret else int(t.shared_p)
  p_shape = (n_p, BLOCK_M, t.block_kv) if interpret else (BLOCK_M, t.block_kv)
  p = plgpu.SMEM(p_shape, dtype, transforms=_BF16_TRANSFORMS) if n_p else None
  o = plgpu.SMEM((2, BLOCK_M, r // 2), jnp.float32, transforms=_F32_TRANSFORMS)
  return [
      plgpu.RefUnion((q, kv, p), (o,)),
      plgpu.SMEM((2, BLOCK_M), jnp.float32),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_barriers=t.stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=t.stages),
      plgpu.Barrier(num_arrivals=2),
      plgpu.Barrier(num_arrivals=1),
      plgpu.Barrier(num_arrivals=1),
  ]


def prefix_partials(q_rows, cache, lengths, *, scale, tuning: Tuning, value_dim, interpret=False):
  """Kernel over the committed prefix: (O [B, S, M, R] f32 normalised per split, LSE2 [B, S, M])."""
  b, mp, c = q_rows.shape
  l = cache.shape[1]
  t, r = tuning, value_dim
  if mp % BLOCK_M or c % 64 or r % 128 or r // 2 > 256 or l < t.block_kv:
    raise ValueError(f"unsupported shapes {q_rows.shape=} {cache.shape=} {value_dim=} {t=}")
  body = _make_body(t, l, r, scale * LOG2E, q_rows.dtype, interpret)
  out_type = (jax.ShapeDtypeStruct((b, t.num_splits, mp, r), jnp.float32),
              jax.ShapeDtypeStruct((b, t.num_splits, mp), jnp.float32))
  fn = plgpu.kernel(
      body, out_type=out_type, scratch_types=_scratch(t, c, r, q_rows.dtype, interpret),
      grid=(mp // BLOCK_M, t.num_splits, b), grid_names=("m", "s", "b"), num_threads=3,
      thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  return fn(lengths, q_rows, cache)


def tree_partial(q, cache, lengths, tree_mask, *, scale, value_dim):
  """The N x N tree block in XLA: (O [B, N, H, R] f32 unnormalised, row max M2 and sum D [B, N, H]).

  O = sum_j 2^(s_j - M2) v_j over the visible tree nodes, D = sum_j 2^(s_j - M2) (0: none
  visible); `merge` divides, so the normalisation fuses into the merge.
  """
  n = q.shape[1]
  l = cache.shape[1]
  pos = lengths[:, None] + jnp.arange(n)[None, :]                               # [B, N]
  keys = jnp.take_along_axis(cache, jnp.clip(pos, 0, l - 1)[..., None], axis=1)
  vis = tree_mask & (pos < l)[:, None, :]                                     # [B, N(i), N(j)]
  # q and keys hold bf16 values: bf16 products are exact in f32, so a bf16 matmul with f32
  # accumulation equals the f32 HIGHEST one (which ran as slow f32 GEMMs on the H200).
  s = jnp.einsum("bnhc,bjc->bnhj", q, keys.astype(q.dtype), preferred_element_type=jnp.float32,
                 precision=lax.Precision.HIGHEST) * (scale * LOG2E)
  s = jnp.where(vis[:, :, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp2(s - m_safe[..., None])
  den = jnp.sum(p, axis=-1)
  # P in the value dtype (as the kernel's PV wgmma), f32 accumulation.
  o = jnp.einsum("bnhj,bjr->bnhr", p.astype(q.dtype), keys[..., :value_dim].astype(q.dtype),
                 preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
  return o, m_safe, den


def _rows(q, mp):
  """[B, N, H, C] -> [B, M, C] node-major rows, zero padded to M."""
  b, n, h, c = q.shape
  return jnp.pad(q.reshape(b, n * h, c), ((0, 0), (0, mp - n * h), (0, 0)))


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "value_dim", "tuning"))
def tree_verify_attention_mgpu(q, cache, lengths, tree_mask, *, scale, interpret=False,
                               value_dim=None, tuning=None):
  """out [B, N, H, R] in q.dtype and lse [B, N, H] f32 (natural log)."""
  b, n, h, c = q.shape
  l = cache.shape[1]
  r = value_dim if value_dim is not None else c - 64
  t = tuning if tuning is not None else default_tuning(b, n, h, l, kernel="v1")
  mp = -(-(n * h) // BLOCK_M) * BLOCK_M
  l_pad = max(t.block_kv, -(-l // 8) * 8)  # TMA row starts must be multiples of 8 (SMEM tiling)
  kv = cache if l == l_pad else jnp.pad(cache, ((0, 0), (0, l_pad - l), (0, 0)))
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, l)
  o_p, lse_p = prefix_partials(_rows(q, mp), kv, lengths, scale=scale, tuning=t, value_dim=r,
                               interpret=interpret)
  return finish(o_p, lse_p, q, cache, lengths, tree_mask, scale=scale, value_dim=r)


def finish(o_p, lse_p, q, cache, lengths, tree_mask, *, scale, value_dim):
  """The XLA work after the kernel: the tree block, merged with the kernel's split partials."""
  o_t, m_t, den_t = tree_partial(q, cache, lengths, tree_mask, scale=scale, value_dim=value_dim)
  return merge(o_p, lse_p, o_t, m_t, den_t, q.dtype)


def merge(o_p, lse_p, o_t, m_t, den_t, dtype):
  """Kernel partials (O [B, S, M, R] normalised, LSE2 [B, S, M]) + the tree block (unnormalised O,
  M2, D [B, N, H] from `tree_partial`) -> (out [B, N, H, R] in dtype, natural lse [B, N, H]).

  Reads every partial once in the kernel's own layout (no transposes or concatenations):
  weights 2^(lse - max), a sum over the splits, plus the tree block's term.
  """
  b, n, h, r = o_t.shape
  s = o_p.shape[1]
  o_p = o_p[:, :, :n * h].reshape(b, s, n, h, r)
  lse_p = lse_p[:, :, :n * h].reshape(b, s, n, h)
  has_tree = den_t > 0
  lse_t = jnp.where(has_tree, m_t + jnp.log2(jnp.where(has_tree, den_t, 1.0)), -jnp.inf)
  m = jnp.maximum(jnp.max(lse_p, axis=1), lse_t)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w_p = jnp.exp2(lse_p - m[:, None])
  w_t = jnp.where(has_tree, jnp.exp2(m_t - m), 0.0)  # scales the unnormalised tree O and D
  den = jnp.sum(w_p, axis=1) + w_t * den_t
  num = jnp.sum(w_p[..., None] * o_p, axis=1) + w_t[..., None] * o_t
  out = num / jnp.where(den > 0, den, 1.0)[..., None]
  return out.astype(dtype), (m + jnp.log2(den)) * LN2
