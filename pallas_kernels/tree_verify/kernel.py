"""Mosaic GPU (sm90) kernel for absorbed-MLA tree-verify attention over a dense latent cache.

Letters: B batch, N tree nodes, H heads, L cache rows, C = 576 latent width, R = 512 value width,
M rows = (node, head) pairs (node-major, row = node * H + head), S KV splits, T = 64 keys a tile,
W tree-mask words.

Design: each CTA (row tile, split, batch) streams its split of the keys [0, E), E = min(len + N, L)
-- the committed prefix and the N tree rows at [len, len + N) in one pass -- while holding a
64 x C Q tile in SMEM; a TMA warpgroup feeds T x C KV tiles through a ring of SMEM stages (V is the
first R columns of the same tile). Two compute warpgroups each own R/2 output columns; warpgroup
0 alone scores the tile (QK^T, online softmax) and hands P and the rescale factor to warpgroup 1
through SMEM.
Tiles start at multiples of T; rows past L are zero-filled by the TMA (no copy or pad of the cache)
and masked. Only tiles that reach past `len` are masked: prefix end, tree mask (per-row bit words,
`masks.py`), end of the cache. With one split the kernel writes the final output (q dtype) and
natural LSE; with S splits it writes per-split normalised bf16 partials and base-2 LSE,
merged after the kernel by `combine.py` (XLA) or `merge_triton.py` (one Triton kernel).

Clusters (Tuning.cluster_rows = R > 1, default off): the row tiles of one split, which stream the
same KV tiles, run as a cluster of R CTAs; each tile is TMA-multicast (every CTA loads 1/R of it
for all), so it leaves L2 once per cluster instead of once per row tile, and a ring slot is
refilled only when every CTA of the cluster released it (a cluster barrier). One CTA cannot hold
both row tiles of N*H = 128: its O accumulator would be the whole register file
(notes/kernel.md, "Why N=16, H=8 costs 28 us").

Row windows: every TMA copy of Q, O or LSE moves a window of `window` = min(M, 64) rows at row
64 * m_idx, and M is either < 64 (one tile, window = M) or a multiple of 64 (api.py pads q). So a
window never reaches past its ref's rows: Mosaic builds the TMA descriptor over the whole array
(batch and split dims included), so a 64-row window through an 8-row ref would read or write the
next split's rows (the H200 fault of the first v2 at N=1, H=8: interpret mode clips instead).
`_check_windows` asserts this at trace time. With M < 64 the SMEM rows past M of the Q tile are
never loaded: their (garbage) rows stay in their own output rows, which are never stored.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import pdl
from pallas_kernels.tree_verify import masks
from pallas_kernels.tree_verify.tuning import BLOCK_KV, BLOCK_M, PARTIALS_DTYPE, SMEM_BYTES, Tuning

LOG2E = math.log2(math.e)
CLUSTER_AXIS = "c"  # Tuning.cluster_rows > 1: the row tile within its cluster
LN2 = math.log(2.0)
_BF16_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_F32_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
_ROW = plgpu.Layout.WGMMA.reduce(1)


def _bcast_rows(x, shape):
  """[64] row statistic -> [64, n] broadcast along columns."""
  return lax.broadcast_in_dim(x, shape, [0])


def _row_full(value):
  return plgpu.layout_cast(jnp.full((BLOCK_M,), value, jnp.float32), _ROW)


def _split_range(length, end, s_idx, t: Tuning):
  """KV tiles [lo, hi) of this split over the keys [0, end), and the first masked tile.
  Default: ceil(tiles / S) tiles a split, the last splits short or empty; balanced_splits: the
  first tiles % S splits get one tile more than the others (every split streams when tiles >= S)."""
  nt = lax.div(end + (BLOCK_KV - 1), BLOCK_KV)
  if t.balanced_splits:
    base, extra = lax.div(nt, t.num_splits), lax.rem(nt, t.num_splits)
    lo = s_idx * base + jnp.minimum(s_idx, extra)
    hi = lo + base + (s_idx < extra).astype(lo.dtype)
  else:
    chunk = lax.div(nt + (t.num_splits - 1), t.num_splits)
    lo = jnp.minimum(s_idx * chunk, nt)
    hi = jnp.minimum(lo + chunk, nt)
  full_hi = jnp.maximum(jnp.minimum(hi, lax.div(length, BLOCK_KV)), lo)
  return lo, hi, full_hi


def _tile_start(tile):
  """First cache row of KV tile `tile` (rows past L are zero-filled by the TMA, then masked)."""
  return pl.multiple_of(tile * BLOCK_KV, BLOCK_KV)


def _row_tile(m_idx):
  """The 64 rows of row tile m_idx (SMEM-side statistics and the padded mask words)."""
  return pl.ds(pl.multiple_of(m_idx * BLOCK_M, BLOCK_M), BLOCK_M)


def _row_window(c):
  """The GMEM rows a TMA copy of Q / O / LSE moves for this CTA (see _check_windows)."""
  return pl.ds(pl.multiple_of(c.m_idx * c.window, c.window), c.window)


def _smem_rows(ref, window):
  """The first `window` rows of an SMEM tile (the whole tile when window == 64)."""
  return ref if window == BLOCK_M else ref.at[pl.ds(0, window)]


def _check_windows(rows, window, tiles, what):
  """Trace-time: the row windows [window * i, window * (i + 1)), i < tiles, tile `rows` exactly."""
  if window * tiles != rows or window % 8 or window > BLOCK_M:
    raise ValueError(f"{what}: {tiles} windows of {window} rows do not tile its {rows} rows")


def _memory_wg(c):
  """TMA producer: the Q tile once, then the split's KV tiles through the SMEM ring."""
  t = c.t
  n = c.hi - c.lo
  plgpu.copy_gmem_to_smem(c.q_ref.at[c.b, _row_window(c)], _smem_rows(c.q_smem, c.window),
                          c.q_bar)

  @pl.loop(0, n)
  def _load(i):
    slot = lax.rem(i, t.stages)

    @pl.when(i >= t.stages)
    def _():
      plgpu.barrier_wait(c.free_bar.at[slot])

    rows = pl.ds(_tile_start(c.lo + i), BLOCK_KV)
    plgpu.copy_gmem_to_smem(c.kv_ref.at[c.b, rows], c.kv_smem.at[slot], c.kv_bar.at[slot],
                            **_multicast(t))

  pdl.release_dependents(t.pdl, c.interpret)  # the split's last KV load is issued

  @pl.loop(jnp.maximum(c.hi - c.lo - t.stages, 0), c.hi - c.lo)
  def _drain(i):
    plgpu.barrier_wait(c.free_bar.at[lax.rem(i, t.stages)])


def _multicast(t: Tuning):
  """copy_gmem_to_smem's arguments for a KV tile: with cluster_rows > 1 every CTA of the cluster
  (the row tiles of one split, which stream the same tiles) loads its share of the tile and
  multicasts it to all of them (Mosaic splits the copy), so each tile leaves L2 once per cluster."""
  return dict(collective_axes=CLUSTER_AXIS) if t.cluster_rows > 1 else {}


def _scores(q_smem, keys):
  """S = Q K^T for one KV tile, f32 [64, keys]."""
  def body(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, keys.T)
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC((BLOCK_M, keys.shape[0]), jnp.float32))


def _sync(bar):
  plgpu.barrier_arrive(bar)
  plgpu.barrier_wait(bar)


class _Ctx:
  """Per-CTA refs and scalars shared by the warpgroups' steps."""

  def __init__(self, **kw):
    self.__dict__.update(kw)


def _tile_words(c, tile):
  """The 3 mask words (3 x [64] row vectors) a masked tile's tree keys can touch, from GMEM.
  Issued before the tile's barrier wait, so their latency hides behind the KV load."""
  w0 = lax.div(jnp.maximum(_tile_start(tile) - c.length, 0), masks.WORD)
  rows = _row_tile(c.m_idx)
  return w0, [plgpu.load(c.words_ref.at[c.b, w0 + j, rows], layout=_ROW, optimized=False)
              for j in range(3)]


def _visible(c, tile, words, shape):
  """[64, T] bool for a masked tile: key pos < len, or a tree key len + k (pos < E) whose bit k
  is set in this row's mask words (words from `_tile_words`: w0 and 3 row vectors)."""
  w0, vecs = words
  pos = _tile_start(tile) + plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                                        layout=plgpu.Layout.WGMMA)
  return visible_keys(c, pos, w0, [_bcast_rows(v, shape) for v in vecs])


def visible_keys(c, pos, w0, word_tiles):
  """Bool tile of key positions `pos`: pos < len, or a tree key len + k (pos < E) whose bit k is
  set in its row's mask word (word_tiles: the 3 words from word w0 on, broadcast to pos' shape)."""
  k = pos - c.length
  widx = lax.shift_right_arithmetic(k, masks.WORD_BITS) - w0
  word = jnp.where(widx == 0, word_tiles[0],
                   jnp.where(widx == 1, word_tiles[1], word_tiles[2]))
  bit = lax.shift_right_logical(word, k & (masks.WORD - 1)) & 1
  return (pos < c.length) | ((k >= 0) & (pos < c.end) & (bit != 0))


def _softmax_update(c, s, tile, carry, words):
  """Mask (masked tiles: words given), online-softmax update; returns (p, alpha, (m, l))."""
  m, l = carry
  if words is not None:
    s = jnp.where(_visible(c, tile, words, s.shape), s, -jnp.inf)
  m_new = jnp.maximum(m, s.max(axis=1))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing visible yet: p = 0
  alpha = jnp.exp2(m - m_use)
  p = jnp.exp2(s - _bcast_rows(m_use, s.shape))
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


def _v_half(c, kv, w):
  r2 = c.r // 2
  return kv.at[:, pl.ds(w * r2, r2)]


def _step_scorer(c, w, i, carry, masked):
  """wg0: score one KV tile, hand P to wg1, PV into this wg's half."""
  acc, m, l = carry
  tile = c.lo + i
  slot = lax.rem(i, c.t.stages)
  words = _tile_words(c, tile) if masked else None
  plgpu.barrier_wait(c.kv_bar.at[slot])
  kv = c.kv_smem.at[slot]
  s = _scores(c.q_smem, kv) * c.scale_log2
  p, alpha, (m, l) = _softmax_update(c, s, tile, (m, l), words)
  a = _share_p(c, i, p.astype(c.dtype), alpha)
  acc = _pv(c, acc * _bcast_rows(alpha, acc.shape), a, _v_half(c, kv, w))
  plgpu.barrier_arrive(c.free_bar.at[slot])
  return acc, m, l


def _share_p(c, i, p16, alpha):
  """Hands P and alpha to wg1 through SMEM; returns the PV's A operand: P in registers (the GPU
  interpreter's wgmma takes A from SMEM only)."""
  @pl.when(i > 0)
  def _():
    plgpu.barrier_wait(c.p_free)
  c.p_smem[...] = p16
  c.stat_smem.at[0][...] = alpha
  plgpu.commit_smem()
  plgpu.barrier_arrive(c.p_ready)
  return c.p_smem if c.interpret else p16


def _step_follower(c, w, i, acc):
  """wg1: rescale by wg0's alpha and PV with wg0's P from SMEM."""
  slot = lax.rem(i, c.t.stages)
  plgpu.barrier_wait(c.kv_bar.at[slot])
  plgpu.barrier_wait(c.p_ready)
  alpha = plgpu.load(c.stat_smem.at[0], layout=_ROW, optimized=False)
  acc = _pv(c, acc * _bcast_rows(alpha, acc.shape), c.p_smem, _v_half(c, c.kv_smem.at[slot], w))
  plgpu.barrier_arrive(c.p_free)
  plgpu.barrier_arrive(c.free_bar.at[slot])
  return acc


def _loop(c, w, acc):
  """All tiles of the split for warpgroup w; returns (acc, m, l) (m, l only meaningful on wg0)."""
  n_full = c.full_hi - c.lo
  n_all = c.hi - c.lo
  m, l = _row_full(-jnp.inf), _row_full(0.0)
  if w == 1:
    acc = lax.fori_loop(0, n_all, lambda i, a: _step_follower(c, w, i, a), acc)
    return acc, m, l
  carry = lax.fori_loop(0, n_full, lambda i, cr: _step_scorer(c, w, i, cr, False), (acc, m, l))
  carry = lax.fori_loop(n_full, n_all, lambda i, cr: _step_scorer(c, w, i, cr, True), carry)

  @pl.when(n_all > 0)
  def _():
    plgpu.barrier_wait(c.p_free)  # observe wg1's last release (balanced barrier phases)
  return carry


def _store(c, w, o, lse2):
  """Normalised O half (and wg0: LSE) -> SMEM -> TMA out. One split: the output in q dtype and
  the natural LSE; several: this split's partial and base-2 LSE."""
  final = c.t.num_splits == 1
  o_smem = c.o_smem.at[w]
  o_smem[...] = o.astype(o_smem.dtype)
  if w == 0:
    c.lse_smem[...] = lse2 * LN2 if final else lse2
  plgpu.commit_smem()
  o_dst, lse_dst = out_destinations(c, w)
  plgpu.copy_smem_to_gmem(_smem_rows(o_smem, c.window), o_dst)
  if w == 0:
    plgpu.copy_smem_to_gmem(_smem_rows(c.lse_smem, c.window), lse_dst)
  plgpu.wait_smem_to_gmem(0)


def out_destinations(c, w):
  """GMEM windows of warpgroup w's O half and of the LSE: the final output (one split) or this
  split's partials."""
  rows, cols = _row_window(c), pl.ds(w * (c.r // 2), c.r // 2)
  if c.t.num_splits == 1:
    return c.o_ref.at[c.b, rows, cols], c.lse_ref.at[c.b, rows]
  return c.o_ref.at[c.b, c.s_idx, rows, cols], c.lse_ref.at[c.b, c.s_idx, rows]


def final_stats(m, l):
  """1 / l and the base-2 LSE of the online softmax's (m, l); rows that saw no key: 1 and -inf."""
  nonempty = l > 0.0
  inv = 1.0 / jnp.where(nonempty, l, 1.0)
  return inv, jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, l, 1.0)), -jnp.inf)


def _compute_wg(c, w):
  """Compute warpgroup w: loop over the split's tiles, then normalise and store its O half and
  the LSE."""
  plgpu.set_max_registers(232, action="increase")
  plgpu.barrier_wait(c.q_bar)
  acc = plgpu.layout_cast(jnp.zeros((BLOCK_M, c.r // 2), jnp.float32), plgpu.Layout.WGMMA)
  acc, m, l = _loop(c, w, acc)
  pdl.release_dependents(c.t.pdl, c.interpret)  # past the last mask-word load: epilogue left
  inv, lse2 = final_stats(m, l)
  if w == 0:
    c.stat_smem.at[1][...] = inv
  _sync(c.wg_bar)  # both warpgroups are past their last read of Q/KV/P: the union may be reused
  if w == 1:
    inv = plgpu.load(c.stat_smem.at[1], layout=_ROW, optimized=False)
  _store(c, w, acc * _bcast_rows(inv, acc.shape), lse2)


def _make_body(t: Tuning, n, l, r, window, scale_log2, dtype, interpret):
  """Kernel body for static shapes."""

  def body(len_ref, q_ref, kv_ref, words_ref, o_ref, lse_ref, union, stat_smem, lse_smem, q_bar,
           kv_bar, free_bar, wg_bar, p_ready, p_free):
    pdl.wait_for_producers(t.pdl, interpret)  # lengths, Q, cache rows, mask words: all below
    (q_smem, kv_smem, p_smem), (o_smem,) = union
    m_idx, s_idx, b = row_tile_index(t), lax.axis_index("s"), lax.axis_index("b")
    length = jnp.clip(len_ref[b], 0, l)  # l: the cache's rows before any pad (never visible)
    end = jnp.minimum(length + n, l)
    lo, hi, full_hi = _split_range(length, end, s_idx, t)
    c = _Ctx(t=t, interpret=interpret, r=r, window=window, scale_log2=scale_log2, dtype=dtype,
             q_ref=q_ref, kv_ref=kv_ref, words_ref=words_ref, o_ref=o_ref, lse_ref=lse_ref,
             q_smem=q_smem, kv_smem=kv_smem, p_smem=p_smem, o_smem=o_smem, stat_smem=stat_smem,
             lse_smem=lse_smem, q_bar=q_bar, kv_bar=kv_bar, free_bar=free_bar, wg_bar=wg_bar,
             p_ready=p_ready, p_free=p_free, m_idx=m_idx, s_idx=s_idx, b=b, length=length,
             end=end, lo=lo, hi=hi, full_hi=full_hi)
    run_warpgroups(c, _compute_wg)

  return body


def run_warpgroups(c, compute_wg):
  """Warpgroups 0 and 1 compute (compute_wg(c, w)), 2 streams the Q and KV tiles."""
  wg = lax.axis_index("wg")
  for w in range(2):
    pl.when(wg == w)(functools.partial(compute_wg, c, w))

  @pl.when(wg == 2)
  def _():
    plgpu.set_max_registers(40, action="decrease")
    _memory_wg(c)


def row_tile_index(t: Tuning):
  """This CTA's row tile: the grid's "m" index, times the cluster size plus the index within the
  cluster when cluster_rows > 1 (the grid then counts clusters along "m")."""
  if t.cluster_rows == 1:
    return lax.axis_index("m")
  return lax.axis_index("m") * t.cluster_rows + lax.axis_index(CLUSTER_AXIS)


def free_barriers(t: Tuning):
  """The ring's slot-free barriers: both compute warpgroups arrive. With cluster_rows > 1 a slot
  is refilled by a multicast into every CTA of the cluster, so it is free only when all of them
  released it: a cluster barrier (each arrival counts in every CTA's copy)."""
  if t.cluster_rows == 1:
    return plgpu.Barrier(num_arrivals=2, num_barriers=t.stages)
  return plgpu.ClusterBarrier(collective_axes=(CLUSTER_AXIS,), num_arrivals=2,
                              num_barriers=t.stages)


def launch_grid(t: Tuning, tiles, b):
  """plgpu.kernel's grid and cluster arguments: (row tiles, splits, batch), the row tiles grouped
  into clusters of t.cluster_rows when > 1."""
  if t.cluster_rows == 1:
    return dict(grid=(tiles, t.num_splits, b), grid_names=("m", "s", "b"))
  if tiles % t.cluster_rows:
    raise ValueError(f"{t.cluster_rows=} must divide the {tiles} row tiles")
  return dict(grid=(tiles // t.cluster_rows, t.num_splits, b), grid_names=("m", "s", "b"),
              cluster=(t.cluster_rows, 1, 1), cluster_names=(CLUSTER_AXIS, "c_s", "c_b"))


def _operand_bytes(t: Tuning, c, itemsize=2):
  """Q + KV ring + P in SMEM (the union's first member; GPU layout, 1 KiB-aligned buffers)."""
  kib = lambda x: -(-x // 1024) * 1024
  p = BLOCK_M * BLOCK_KV * itemsize
  return kib(BLOCK_M * c * itemsize) + kib(t.stages * BLOCK_KV * c * itemsize) + kib(p)


def _scratch(t: Tuning, c, r, dtype):
  """SMEM: a union of (Q, KV ring, P) with the output staging, plus stats and barriers."""
  q = plgpu.SMEM((BLOCK_M, c), dtype, transforms=_BF16_TRANSFORMS)
  kv = plgpu.SMEM((t.stages, BLOCK_KV, c), dtype, transforms=_BF16_TRANSFORMS)
  p = plgpu.SMEM((BLOCK_M, BLOCK_KV), dtype, transforms=_BF16_TRANSFORMS)
  o_dtype = dtype if t.num_splits == 1 else PARTIALS_DTYPE
  transforms = _F32_TRANSFORMS if o_dtype == jnp.float32 else _BF16_TRANSFORMS
  o = plgpu.SMEM((2, BLOCK_M, r // 2), o_dtype, transforms=transforms)
  return [
      plgpu.RefUnion((q, kv, p), (o,)),
      plgpu.SMEM((2, BLOCK_M), jnp.float32),
      plgpu.SMEM((BLOCK_M,), jnp.float32),
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_barriers=t.stages),
      free_barriers(t),
      plgpu.Barrier(num_arrivals=2),
      plgpu.Barrier(num_arrivals=1),
      plgpu.Barrier(num_arrivals=1),
  ]


def smem_bytes(t: Tuning, c, r, itemsize=2):
  """SMEM of one CTA (GPU layout): the union max(Q + KV ring + P, O staging), each buffer rounded
  up to 1 KiB (swizzle alignment), plus statistics and barriers. Must be <= SMEM_BYTES."""
  kib = lambda x: -(-x // 1024) * 1024
  o_item = itemsize if t.num_splits == 1 else jnp.dtype(PARTIALS_DTYPE).itemsize
  union = max(_operand_bytes(t, c, itemsize), kib(2 * BLOCK_M * (r // 2) * o_item))
  return union + kib(3 * BLOCK_M * 4) + 8 * (2 * t.stages + 4)


def out_types(b, m, r, t: Tuning, dtype):
  """One split: (out [B, M, R] dtype, natural LSE [B, M]); else partials (O [B, S, M, R] in
  PARTIALS_DTYPE, normalised per split; base-2 LSE [B, S, M] f32)."""
  if t.num_splits == 1:
    return (jax.ShapeDtypeStruct((b, m, r), dtype), jax.ShapeDtypeStruct((b, m), jnp.float32))
  return (jax.ShapeDtypeStruct((b, t.num_splits, m, r), PARTIALS_DTYPE),
          jax.ShapeDtypeStruct((b, t.num_splits, m), jnp.float32))


def attention_kernel(q_rows, cache, lengths, words, *, n, scale, tuning: Tuning, value_dim,
                     cache_rows=None, interpret=False):
  """q_rows [B, M, C] (M rows: < 64 and a multiple of 8, or a multiple of 64), cache [B, L, C]
  (L a multiple of 8), lengths [B] in [0, L], words [B, W + 2, tiles * 64] from
  masks.tree_mask_words -> out_types (M rows). cache_rows: the rows before a pad to 8 (default L);
  lengths are clipped to [0, cache_rows] in the kernel, and rows past it are never visible."""
  b, m, c = q_rows.shape
  l = cache.shape[1]
  t, r = tuning, value_dim
  if l % 8 or c % 64 or r % 128 or r // 2 > 256:
    raise ValueError(f"unsupported shapes {q_rows.shape=} {cache.shape=} {value_dim=}")
  if smem_bytes(t, c, r) > SMEM_BYTES:
    raise ValueError(f"{t}: {smem_bytes(t, c, r)} bytes of SMEM at C={c}, over {SMEM_BYTES}")
  tiles = -(-m // BLOCK_M)
  window = min(m, BLOCK_M)
  _check_windows(m, window, tiles, f"q rows {q_rows.shape}")
  for what, shape in zip(("out", "lse"), out_types(b, m, r, t, q_rows.dtype)):
    _check_windows(shape.shape[-2 if what == "out" else -1], window, tiles, f"{what} {shape}")
  if words.shape[2] != tiles * BLOCK_M or words.shape[1] != masks.num_words(n) + masks.EXTRA_WORDS:
    raise ValueError(f"{words.shape=} does not match {n=} and {tiles} row tiles")
  rows_l = l if cache_rows is None else cache_rows
  body = _make_body(t, n, rows_l, r, window, scale * LOG2E, q_rows.dtype, interpret)
  fn = plgpu.kernel(
      body, out_type=out_types(b, m, r, t, q_rows.dtype),
      scratch_types=_scratch(t, c, r, q_rows.dtype),
      **launch_grid(t, tiles, b), num_threads=3, thread_name="wg",
      kernel_name="tree_verify",  # CUPTI: tree_verify_mosaic_gpu_kernel
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  return fn(lengths, q_rows, cache, words)
