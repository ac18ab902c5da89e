"""Split merge as one Pallas Triton kernel (opt-in: Tuning(merge="triton"); not yet timed on a GPU).

Letters: B batch, S splits (a power of 2: Triton blocks are), M rows, R value width, BC columns
per program.

The XLA merge (`combine.merge_splits`) is 3 kernels (LSE reduction, weights, weighted sum; ~5.5 us
at N=1, H=8, S=132 on the H200, mostly launches). Here one program per (batch row, row, BC
columns) loads the row's S LSEs, forms the weights 2^(lse_s - LSE) itself and sums its
[S, BC] block of partials: one launch, the partials read once.
"""

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

LN2 = math.log(2.0)
BLOCK_COLS = 64


def supports(num_splits, value_dim):
  """Whether this merge handles the split count and value width."""
  return num_splits & (num_splits - 1) == 0 and value_dim % BLOCK_COLS == 0


def _merge_kernel(o_ref, lse_ref, out_ref, lse_out_ref):
  """o_ref [S, BC] partials of one row, lse_ref [S] their base-2 LSEs -> out [BC], natural LSE."""
  lse = lse_ref[...]
  m = jnp.max(lse)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  e = jnp.exp2(lse - m_safe)                                # empty splits (-inf): 0
  den = jnp.sum(e)
  w = e / jnp.where(den > 0, den, 1.0)
  out_ref[...] = jnp.sum(w[:, None] * o_ref[...].astype(jnp.float32), axis=0).astype(out_ref.dtype)

  @pl.when(pl.program_id(2) == 0)
  def _():
    lse2 = jnp.where(den > 0, m_safe + jnp.log2(jnp.where(den > 0, den, 1.0)), -jnp.inf)
    lse_out_ref[...] = jnp.broadcast_to(lse2 * LN2, lse_out_ref.shape)


def merge_splits_triton(o_p, lse_p, rows, dtype, interpret=False):
  """Same contract as combine.merge_splits: O [B, S, M, R], base-2 LSE [B, S, M] -> (out
  [B, rows, R] in dtype, natural LSE [B, rows]); reads only the first `rows` rows."""
  b, s, _, r = o_p.shape
  if not supports(s, r):
    raise ValueError(f"triton merge needs a power-of-2 split count and R % {BLOCK_COLS} == 0: "
                     f"{o_p.shape=}")
  return pl.pallas_call(
      _merge_kernel,
      grid=(b, rows, r // BLOCK_COLS),
      in_specs=[pl.BlockSpec((None, s, None, BLOCK_COLS), lambda i, m, j: (i, 0, m, j)),
                pl.BlockSpec((None, s, None), lambda i, m, j: (i, 0, m))],
      out_specs=[pl.BlockSpec((None, None, BLOCK_COLS), lambda i, m, j: (i, m, j)),
                 pl.BlockSpec((None, 1), lambda i, m, j: (i, m))],
      out_shape=[jax.ShapeDtypeStruct((b, rows, r), dtype),
                 jax.ShapeDtypeStruct((b, rows), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
  )(o_p, lse_p)
