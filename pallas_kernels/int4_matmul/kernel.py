"""Mosaic GPU (sm90) grouped matmul with INT4 expert weights dequantised in the kernel.

Letters: M rows of x (token, expert) pairs sorted by expert, K input width, N output width, G experts,
S scale group (32 in K2.5/K2.6: one bf16 scale per 32 input rows and output column).

One CTA (one warpgroup) per (work item, N tile); a work item is a 64-row block of x and the expert
whose rows it holds (work.py). A TMA pipeline streams x [64, BK] bf16, the expert's packed int4
tile [BK, BN] and its scales [BK/S, BN] into SMEM; each step loads the int4 tile into registers,
converts it to bf16 (Mosaic's i4 -> bf16 register conversion), multiplies by its scales, writes it
to a bf16 SMEM tile and runs wgmma x @ w into an f32 accumulator. Weights stay 4.5 bits per value in
HBM and are never written back dequantised. The rows of the item's group are stored with a ladder
of power-of-two TMA stores (the group may start and end anywhere inside the block).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.int4_matmul import work

BLOCK_M = 64
BLOCK_K = 64
_BF16_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per output column


def supports(x_mk, q_gkn, scale_gsn, block_n) -> bool:
  """bf16/f16 x, K a multiple of 64, N a multiple of block_n, scale group 32 or a multiple of 64."""
  k, n = q_gkn.shape[1:]
  group = k // scale_gsn.shape[1]
  return (x_mk.dtype in (jnp.bfloat16, jnp.float16) and k % BLOCK_K == 0 and n % block_n == 0
          and (group == 32 or group % BLOCK_K == 0))


def _scales(s_smem, shape, group):
  """The step's per-(row, column) scale in registers: one or two scale rows broadcast over K."""
  def row(j):
    return lax.broadcast_in_dim(plgpu.load(s_smem.at[j], layout=_COL, optimized=False),
                                shape, [1])
  if group >= BLOCK_K:
    return row(0)
  k_idx = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
  return jnp.where(k_idx < group, row(0), row(1))


def _store_rows(o_smem, o_ref, row0, lo, size, col0, block_n):
  """Store rows [lo, lo + size) of the staged tile to o_ref rows row0 + lo.. (power-of-two TMAs)."""
  start = lo
  rows = BLOCK_M
  while rows >= 1:
    @pl.when(size & rows != 0)
    def _(rows=rows, start=start):
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, rows)],
                              o_ref.at[pl.ds(row0 + start, rows), pl.ds(col0, block_n)])
    start = start + (size & rows)
    rows //= 2
  plgpu.wait_smem_to_gmem(0)


def _make_body(k, group, block_n, stages, dtype):
  def body(work_ref, x_ref, q_ref, s_ref, o_ref, wdq_smem, o_smem):
    item, ni = lax.axis_index("w"), lax.axis_index("n")
    grp, blk, lo, size = (work_ref[i, item] for i in range(4))

    def acc_scope(acc_ref):
      def step(_, x_smem, q_smem, s_smem):
        q = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA, optimized=False)
        w = q.astype(dtype) * _scales(s_smem, q.shape, group).astype(dtype)
        wdq_smem[...] = w
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, x_smem, wdq_smem)
        plgpu.wgmma_wait(0)  # wdq_smem is rewritten by the next step

      n_s = max(BLOCK_K // group, 1)
      plgpu.emit_pipeline(
          step, grid=(k // BLOCK_K,),
          in_specs=[
              plgpu.BlockSpec((BLOCK_M, BLOCK_K), lambda kk: (blk, kk), transforms=_BF16_TRANSFORMS),
              plgpu.BlockSpec((BLOCK_K, block_n), lambda kk: (kk, ni)),
              plgpu.BlockSpec((n_s, block_n),
                              lambda kk: ((kk * BLOCK_K) // (n_s * group), ni)),
          ],
          max_concurrent_steps=stages,
      )(x_ref, q_ref.at[grp], s_ref.at[grp])
      return acc_ref[...]

    @pl.when(size > 0)
    def _():
      acc = pl.run_scoped(acc_scope, plgpu.ACC((BLOCK_M, block_n), jnp.float32))
      o_smem[...] = acc.astype(o_smem.dtype)
      plgpu.commit_smem()
      _store_rows(o_smem, o_ref, blk * BLOCK_M, lo, size, ni * block_n, block_n)

  return body


@functools.partial(jax.jit, static_argnames=("block_n", "stages", "interpret"))
def int4_grouped_matmul_mgpu(x_mk, q_gkn, scale_gsn, group_sizes, *, block_n=128, stages=4,
                             interpret=False):
  """out [M, N] in x.dtype; see module doc. q int4 [G, K, N], scale [G, K/S, N]."""
  m, k = x_mk.shape
  n = q_gkn.shape[2]
  group = k // scale_gsn.shape[1]
  if not supports(x_mk, q_gkn, scale_gsn, block_n):
    raise ValueError(f"unsupported: {x_mk.dtype=} {q_gkn.shape=} {scale_gsn.shape=} {block_n=}")
  m_pad = -(-m // BLOCK_M) * BLOCK_M
  x = jnp.pad(x_mk, ((0, m_pad - m), (0, 0)))
  items = work.work_list(group_sizes, m, BLOCK_M)
  fn = plgpu.kernel(
      _make_body(k, group, block_n, stages, x_mk.dtype),
      out_type=jax.ShapeDtypeStruct((m_pad, n), x_mk.dtype),
      scratch_types=[plgpu.SMEM((BLOCK_K, block_n), x_mk.dtype, transforms=_BF16_TRANSFORMS),
                     plgpu.SMEM((BLOCK_M, block_n), x_mk.dtype)],
      grid=(items.shape[1], n // block_n), grid_names=("w", "n"),
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  return fn(items, x, q_gkn, scale_gsn.astype(x_mk.dtype))[:m]
