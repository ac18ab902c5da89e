"""Swap-AB variant of the tree-verify kernel for one row tile (M = N*H rows <= 64; meant for M <= 32).

The default kernel (kernel.py) scores a 64-row Q tile whatever M is: at N=1, H=8 only 8 of the 64
wgmma rows are real (8x the tensor work, a 74 KB Q tile in SMEM). Here the keys are the wgmma M
side and the M q rows its N side (a multiple of 8, as kernel_rows pads them):

  S^T = K Q^T    [T keys, M]    A = the KV tile, B = Q^T (the Q tile's transposed view), K = C
  O^T += V^T P^T [R/2, M]       A = V^T (the tile's transposed view), B = P^T (P staged in SMEM)

so a tile costs T x M x (C + R) MACs instead of 64 x T x (C + R). The softmax statistics live along
axis 1 ([M] vectors, layout WGMMA.reduce(0)) and are reduced over the key axis, which spans the
warpgroup's 4 warps (a cross-warp reduction through Mosaic's reduction scratch; only warpgroup 0
reduces). Warpgroup 0 scores, stores P (transposed, [M, T]) and the rescale factor in SMEM for
warpgroup 1 (kernel.py's hand-off); each warpgroup owns R/2 rows of O^T and stores it
transposed into a [M, R/2] SMEM tile, so the outputs, the TMA producer, the mask words, the split
ranges and the merge are the default kernel's (kernel.out_types).

Constraints: 64-key tiles (wgmma's M is a multiple of 64), M <= 64 and a multiple of 8 (one row
tile; wgmma's N), R / 2 a multiple of 64 (V^T's rows are the PV's M), bf16 partials (the
transposed store of an f32 O^T tile finds no layout in this Mosaic: tuning.PARTIALS_DTYPE),
2 stages (SMEM). At M = 64 (N=8, H=8) it does
the default kernel's tensor work (an A/B of the structure only).
"""


import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import pdl
from pallas_kernels.tree_verify import kernel as k
from pallas_kernels.tree_verify import masks
from pallas_kernels.tree_verify.tuning import BLOCK_KV, BLOCK_M, PARTIALS_DTYPE, SMEM_BYTES, Tuning

_COL = plgpu.Layout.WGMMA.reduce(0)  # an [M] statistic of an [T, M] or [R/2, M] tile


def reduction_scratch_bytes(m):
  """Mosaic's cross-warp reduction scratch (the key-axis max and sum): 1 KiB per [M] register of
  8 columns reduced at once (4 warps x 32 lanes x 2 f32); all of them up to M = 32, one at M > 32
  (M = 64's SMEM has no room for more)."""
  return 1024 * (min(m // 8, 4) if m <= 32 else 1)


def _bcast_cols(x, shape):
  """[M] column statistic -> [rows, M] broadcast along rows."""
  return lax.broadcast_in_dim(x, shape, [1])


def _col_full(m, value):
  return plgpu.layout_cast(jnp.full((m,), value, jnp.float32), _COL)


def _scores_t(q_smem, keys):
  """S^T = K Q^T for one KV tile, f32 [T, M]."""
  def body(acc_ref):
    plgpu.wgmma(acc_ref, keys, q_smem.T)
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC((keys.shape[0], q_smem.shape[0]), jnp.float32))


def _tile_words_t(c, tile):
  """kernel._tile_words for the M q rows as [M] column vectors."""
  w0 = lax.div(jnp.maximum(k._tile_start(tile) - c.length, 0), masks.WORD)
  rows = pl.ds(0, c.window)
  return w0, [plgpu.load(c.words_ref.at[c.b, w0 + j, rows], layout=_COL, optimized=False)
              for j in range(3)]


def _visible_t(c, tile, words, shape):
  """[T, M] bool: kernel._visible with the keys along axis 0."""
  w0, vecs = words
  pos = k._tile_start(tile) + plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                                          layout=plgpu.Layout.WGMMA)
  return k.visible_keys(c, pos, w0, [_bcast_cols(v, shape) for v in vecs])


def _softmax_update_t(c, s, tile, carry, words):
  """kernel._softmax_update over the key axis (0): returns (p [T, M], alpha [M], (m, l))."""
  m, l = carry
  if words is not None:
    s = jnp.where(_visible_t(c, tile, words, s.shape), s, -jnp.inf)
  m_new = jnp.maximum(m, s.max(axis=0))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m_use)
  p = jnp.exp2(s - _bcast_cols(m_use, s.shape))
  return p, alpha, (m_new, l * alpha + p.sum(axis=0))


def _v_half_t(c, kv, w):
  """V^T rows [w R/2, (w + 1) R/2) of a KV tile: the transposed view of its value columns."""
  r2 = c.r // 2
  return kv.at[:, pl.ds(w * r2, r2)].T


def _hand_off(c, i, p16, alpha):
  """Warpgroup 0: P^T (stored as P, [M, T]) and alpha to SMEM for both warpgroups' PV."""
  @pl.when(i > 0)
  def _():
    plgpu.barrier_wait(c.p_free)
  c.p_smem.T[...] = p16
  c.stat_smem.at[0][...] = alpha
  plgpu.commit_smem()
  plgpu.barrier_arrive(c.p_ready)


def _step_scorer(c, i, carry, masked):
  """Warpgroup 0: score one KV tile, hand off P and alpha, PV into O^T rows [0, R/2)."""
  acc, m, l = carry
  tile = c.lo + i
  slot = lax.rem(i, c.t.stages)
  words = _tile_words_t(c, tile) if masked else None
  plgpu.barrier_wait(c.kv_bar.at[slot])
  kv = c.kv_smem.at[slot]
  s = _scores_t(c.q_smem, kv) * c.scale_log2
  p, alpha, (m, l) = _softmax_update_t(c, s, tile, (m, l), words)
  _hand_off(c, i, p.astype(c.dtype), alpha)
  acc = k._pv(c, acc * _bcast_cols(alpha, acc.shape), _v_half_t(c, kv, 0), c.p_smem.T)
  plgpu.barrier_arrive(c.free_bar.at[slot])
  return acc, m, l


def _step_follower(c, i, acc):
  """Warpgroup 1: rescale by wg0's alpha, PV with wg0's P into O^T rows [R/2, R)."""
  slot = lax.rem(i, c.t.stages)
  plgpu.barrier_wait(c.kv_bar.at[slot])
  plgpu.barrier_wait(c.p_ready)
  alpha = plgpu.load(c.stat_smem.at[0], layout=_COL, optimized=False)
  acc = k._pv(c, acc * _bcast_cols(alpha, acc.shape), _v_half_t(c, c.kv_smem.at[slot], 1),
              c.p_smem.T)
  plgpu.barrier_arrive(c.p_free)
  plgpu.barrier_arrive(c.free_bar.at[slot])
  return acc


def _loop(c, w, acc):
  """All tiles of the split for warpgroup w; returns (acc, m, l) (m, l meaningful on wg0)."""
  n_full, n_all = c.full_hi - c.lo, c.hi - c.lo
  m, l = _col_full(c.window, -jnp.inf), _col_full(c.window, 0.0)
  if w == 1:
    return lax.fori_loop(0, n_all, lambda i, a: _step_follower(c, i, a), acc), m, l
  carry = lax.fori_loop(0, n_full, lambda i, cr: _step_scorer(c, i, cr, False), (acc, m, l))
  carry = lax.fori_loop(n_full, n_all, lambda i, cr: _step_scorer(c, i, cr, True), carry)

  @pl.when(n_all > 0)
  def _():
    plgpu.barrier_wait(c.p_free)  # observe wg1's last release (balanced barrier phases)
  return carry


def _store(c, w, o_t, lse2):
  """O^T half, normalised, -> transposed into an [M, R/2] SMEM tile -> TMA out (and LSE). One
  split: the output in q dtype and the natural LSE; several: this split's partial."""
  final = c.t.num_splits == 1
  o_smem = c.o_smem.at[w]
  o_smem.T[...] = o_t.astype(o_smem.dtype)
  if w == 0:
    c.lse_smem[...] = lse2 * k.LN2 if final else lse2
  plgpu.commit_smem()
  o_dst, lse_dst = k.out_destinations(c, w)
  plgpu.copy_smem_to_gmem(o_smem, o_dst)
  if w == 0:
    plgpu.copy_smem_to_gmem(c.lse_smem, lse_dst)
  plgpu.wait_smem_to_gmem(0)


def _compute_wg(c, w):
  """Compute warpgroup w: its tiles, then normalise and store its O half (wg0: and the LSE)."""
  plgpu.set_max_registers(232, action="increase")
  plgpu.barrier_wait(c.q_bar)
  acc = plgpu.layout_cast(jnp.zeros((c.r // 2, c.window), jnp.float32), plgpu.Layout.WGMMA)
  acc, m, l = _loop(c, w, acc)
  pdl.release_dependents(c.t.pdl, c.interpret)  # past the last mask-word load: epilogue left
  inv, lse2 = k.final_stats(m, l)
  if w == 0:
    c.stat_smem.at[1][...] = inv
  k._sync(c.wg_bar)  # both warpgroups are past their last read of Q/KV/P: the union may be reused
  if w == 1:
    inv = plgpu.load(c.stat_smem.at[1], layout=_COL, optimized=False)
  _store(c, w, acc * _bcast_cols(inv, acc.shape), lse2)


def _make_body(t: Tuning, n, l, r, window, scale_log2, dtype, interpret):
  """Kernel body for static shapes (kernel._make_body's refs and scalars)."""

  def body(len_ref, q_ref, kv_ref, words_ref, o_ref, lse_ref, union, stats, q_bar, kv_bar,
           free_bar, wg_bar, p_ready, p_free):
    pdl.wait_for_producers(t.pdl, interpret)  # lengths, Q, cache rows, mask words: all below
    (q_smem, kv_smem, p_smem), (o_smem,) = union
    # One buffer for the three [M] statistics (one 1 KiB alignment, not three): LSE in row 0 (a
    # TMA source: at the buffer's aligned start), alpha in row 1, 1 / l in row 2.
    m_idx, s_idx, b = lax.axis_index("m"), lax.axis_index("s"), lax.axis_index("b")
    length = jnp.clip(len_ref[b], 0, l)
    end = jnp.minimum(length + n, l)
    lo, hi, full_hi = k._split_range(length, end, s_idx, t)
    c = k._Ctx(t=t, interpret=interpret, r=r, window=window, scale_log2=scale_log2, dtype=dtype,
               q_ref=q_ref, kv_ref=kv_ref, words_ref=words_ref, o_ref=o_ref, lse_ref=lse_ref,
               q_smem=q_smem, kv_smem=kv_smem, p_smem=p_smem, o_smem=o_smem,
               stat_smem=stats.at[1:], lse_smem=stats.at[0], q_bar=q_bar, kv_bar=kv_bar,
               free_bar=free_bar, wg_bar=wg_bar, p_ready=p_ready, p_free=p_free, m_idx=m_idx,
               s_idx=s_idx, b=b, length=length, end=end, lo=lo, hi=hi, full_hi=full_hi)
    k.run_warpgroups(c, _compute_wg)

  return body


def _operand_bytes(t: Tuning, m, c, itemsize=2):
  """Q [M, C] + KV ring + P [M, T] in SMEM (the union's first member; GPU layout)."""
  kib = lambda x: -(-x // 1024) * 1024
  return (kib(m * c * itemsize) + kib(t.stages * BLOCK_KV * c * itemsize)
          + kib(m * BLOCK_KV * itemsize))


def _scratch(t: Tuning, m, c, r, dtype):
  """SMEM: a union of (Q [M, C], KV ring, P [M, T]) with the [2, M, R/2] output staging, plus
  the [3, M] statistics (LSE, alpha, 1 / l) and kernel._scratch's barriers."""
  q = plgpu.SMEM((m, c), dtype, transforms=k._BF16_TRANSFORMS)
  kv = plgpu.SMEM((t.stages, BLOCK_KV, c), dtype, transforms=k._BF16_TRANSFORMS)
  p = plgpu.SMEM((m, BLOCK_KV), dtype, transforms=k._BF16_TRANSFORMS)
  o_dtype = dtype if t.num_splits == 1 else PARTIALS_DTYPE
  o = plgpu.SMEM((2, m, r // 2), o_dtype, transforms=k._BF16_TRANSFORMS)
  return [
      plgpu.RefUnion((q, kv, p), (o,)),
      plgpu.SMEM((3, m), jnp.float32),
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_barriers=t.stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=t.stages),
      plgpu.Barrier(num_arrivals=2),
      plgpu.Barrier(num_arrivals=1),
      plgpu.Barrier(num_arrivals=1),
  ]


def smem_bytes(t: Tuning, m, c, r, itemsize=2):
  """SMEM of one CTA as Mosaic allocates it (every buffer aligned to 1 KiB): kernel.smem_bytes'
  accounting with M-row Q, P, output and statistics tiles, plus the reduction scratch. Must be <= SMEM_BYTES (3 stages never fit: 2 x 73.7 KB KV tiles + Q)."""
  kib = lambda x: -(-x // 1024) * 1024
  o_item = itemsize if t.num_splits == 1 else jnp.dtype(PARTIALS_DTYPE).itemsize
  union = max(_operand_bytes(t, m, c, itemsize), kib(2 * m * (r // 2) * o_item))
  return union + kib(3 * m * 4) + 8 * (2 * t.stages + 4) + reduction_scratch_bytes(m)


def check_supported(t: Tuning, m, c, r):
  """Trace-time: the shapes and knobs this variant handles (module docstring)."""
  if m > BLOCK_M or m % 8 or (r // 2) % 64:
    raise ValueError(f"swap_ab needs M <= 64 rows, a multiple of 8, and R/2 a multiple of 64; "
                     f"got {m=} {r=}")
  if t.cluster_rows != 1:
    raise ValueError(f"swap_ab is one row tile: {t.cluster_rows=} (row tiles per cluster) "
                     "must be 1")
  if smem_bytes(t, m, c, r) > SMEM_BYTES:
    raise ValueError(f"{t}: {smem_bytes(t, m, c, r)} bytes of SMEM at C={c}, over {SMEM_BYTES}")


def attention_kernel(q_rows, cache, lengths, words, *, n, scale, tuning: Tuning, value_dim,
                     cache_rows=None, interpret=False):
  """kernel.attention_kernel's contract, for M = q_rows.shape[1] <= 64 rows (one row tile)."""
  b, m, c = q_rows.shape
  l = cache.shape[1]
  t, r = tuning, value_dim
  if l % 8 or c % 64:
    raise ValueError(f"unsupported shapes {q_rows.shape=} {cache.shape=}")
  check_supported(t, m, c, r)
  if words.shape[2] != BLOCK_M or words.shape[1] != masks.num_words(n) + masks.EXTRA_WORDS:
    raise ValueError(f"{words.shape=} does not match {n=} and one row tile")
  rows_l = l if cache_rows is None else cache_rows
  body = _make_body(t, n, rows_l, r, m, scale * k.LOG2E, q_rows.dtype, interpret)
  fn = plgpu.kernel(
      body, out_type=k.out_types(b, m, r, t, q_rows.dtype),
      scratch_types=_scratch(t, m, c, r, q_rows.dtype),
      grid=(1, t.num_splits, b), grid_names=("m", "s", "b"), num_threads=3, thread_name="wg",
      kernel_name="tree_verify_swap",  # CUPTI: tree_verify_swap_mosaic_gpu_kernel
      compiler_params=plgpu.CompilerParams(approx_math=True,
                                           reduction_scratch_bytes=reduction_scratch_bytes(m)),
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  return fn(lengths, q_rows, cache, words)
