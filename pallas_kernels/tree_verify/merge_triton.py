"""Split merge as one Pallas Triton kernel (opt-in: Tuning(merge="triton"); not yet timed on a GPU).

Letters: B batch, S splits (any count: loaded as power-of-2 pieces, Triton's blocks are), M rows,
R value width, BC columns per program.

The XLA merge (`combine.merge_splits`) is 3 kernels (LSE reduction, weights, weighted sum; ~5.5 us
at N=1, H=8, S=132 on the H200, mostly launches). Here one program per (batch row, row, BC
columns) loads the row's S LSEs, forms the weights 2^(lse_s - LSE) itself and sums its
[S, BC] block of partials: one launch, the partials read once.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

LN2 = math.log(2.0)
BLOCK_COLS = 64


def supports(num_splits, value_dim, cols=BLOCK_COLS):
  """Whether this merge handles the split count (any) and value width at `cols` per program."""
  return num_splits >= 1 and cols & (cols - 1) == 0 and value_dim % cols == 0


def split_pieces(s):
  """[(start, size)]: the S splits as power-of-2 pieces, largest first (Triton's loads are
  power-of-2 blocks): 132 -> [(0, 128), (128, 4)]."""
  pieces, start = [], 0
  for bit in reversed(range(s.bit_length())):
    if s >> bit & 1:
      pieces.append((start, 1 << bit))
      start += 1 << bit
  return pieces


def _merge_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, loads_first=False):
  """o_ref [S, BC] partials of one row, lse_ref [S] their base-2 LSEs -> out [BC], natural LSE.
  loads_first (Tuning.merge_loads_first): the partial blocks are loaded before the LSEs, so their
  GMEM round trip overlaps the LSEs' and the weights' reductions instead of following them (the
  loads do not depend on the weights; a compiler does not move a load above the reductions'
  barriers). Same arithmetic either way."""
  pieces = split_pieces(lse_ref.shape[0])
  early = [o_ref[pl.ds(start, size), :] for start, size in pieces] if loads_first else None
  lses = [lse_ref[pl.ds(start, size)] for start, size in pieces]
  m = functools.reduce(jnp.maximum, [jnp.max(x) for x in lses])
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  es = [jnp.exp2(x - m_safe) for x in lses]                 # empty splits (-inf): 0
  den = functools.reduce(jnp.add, [jnp.sum(e) for e in es])
  block = (lambda k: early[k]) if loads_first else (
      lambda k: o_ref[pl.ds(pieces[k][0], pieces[k][1]), :])  # default: each load at its use
  acc = functools.reduce(jnp.add, [jnp.sum(e[:, None] * block(k).astype(jnp.float32), axis=0)
                                   for k, e in enumerate(es)])
  out_ref[...] = (acc / jnp.where(den > 0, den, 1.0)).astype(out_ref.dtype)

  @pl.when(pl.program_id(2) == 0)
  def _():
    lse2 = jnp.where(den > 0, m_safe + jnp.log2(jnp.where(den > 0, den, 1.0)), -jnp.inf)
    lse_out_ref[...] = jnp.broadcast_to(lse2 * LN2, lse_out_ref.shape)


def _merge_kernel_loads_first(o_ref, lse_ref, out_ref, lse_out_ref):
  """_merge_kernel with loads_first (a kernel of its own name in profiles; the default's
  program is unchanged)."""
  _merge_kernel(o_ref, lse_ref, out_ref, lse_out_ref, loads_first=True)


def merge_splits_triton(o_p, lse_p, rows, dtype, interpret=False, cols=BLOCK_COLS,
                        loads_first=False):
  """Same contract as combine.merge_splits: O [B, S, M, R], base-2 LSE [B, S, M] -> (out
  [B, rows, R] in dtype, natural LSE [B, rows]); reads only the first `rows` rows. cols
  (Tuning.merge_cols): value columns per program; fewer, larger programs recompute the row's
  weights less often and issue longer loads (B x rows x R / cols programs). loads_first
  (Tuning.merge_loads_first): see _merge_kernel."""
  b, s, _, r = o_p.shape
  if not supports(s, r, cols):
    raise ValueError(f"triton merge needs R % {cols} == 0 (cols a power of 2): {o_p.shape=}")
  return pl.pallas_call(
      _merge_kernel_loads_first if loads_first else _merge_kernel,
      grid=(b, rows, r // cols),
      in_specs=[pl.BlockSpec((None, s, None, cols), lambda i, m, j: (i, 0, m, j)),
                pl.BlockSpec((None, s, None), lambda i, m, j: (i, 0, m))],
      out_specs=[pl.BlockSpec((None, None, cols), lambda i, m, j: (i, m, j)),
                 pl.BlockSpec((None, 1), lambda i, m, j: (i, m))],
      out_shape=[jax.ShapeDtypeStruct((b, rows, r), dtype),
                 jax.ShapeDtypeStruct((b, rows), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
  )(o_p, lse_p)
