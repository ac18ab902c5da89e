"""Split-K matmul of a few rows (the draft block's M = B*S = 16) as a Pallas (Triton) kernel.

The draft's small dots read a weight matrix once per block, so their floor is the weight bytes.
On the H200 XLA's Triton GEMMs ran o_proj ([16, 1024] x [1024, 7168], no split-K) at ~2 TB/s and
q|k|v ([16, 7168] x [7168, 1280], split-K 16) at ~2.4 TB/s of a 4.1 TB/s copy rate
(results/h200/2026-12-01/s5_draft_io.log). Here the grid is chosen for that read: program
(s, n) streams rows [s*K/splits, (s+1)*K/splits) of weight columns [n*block_n, (n+1)*block_n)
in tiles of block_k rows (num_stages of them in flight) and writes its f32 partial
[M, block_n]; the caller sums the `splits` partials where it needs the result (XLA fuses the
sum into the consumer: the residual add, or the cast before the attention kernel).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


@dataclasses.dataclass(frozen=True)
class Gemv:
  """splits: K pieces (programs along K); block_n: weight columns per program; block_k: rows per
  tile of the program's loop; num_warps, num_stages: Triton's."""
  splits: int
  block_n: int = 64
  block_k: int = 128
  num_warps: int = 4
  num_stages: int = 4


def supports(m: int, k: int, n: int, g: Gemv) -> bool:
  """Rows a multiple of 16 (Triton dot tiles), K split into whole tiles, N into whole
  power-of-two column blocks."""
  pow2 = lambda x: x >= 16 and x & (x - 1) == 0
  return (m % 16 == 0 and k % (g.splits * g.block_k) == 0 and n % g.block_n == 0
          and pow2(g.block_n) and pow2(g.block_k))


def _kernel(x_ref, w_ref, o_ref, *, block_k):
  """One (split, column block): o [M, block_n] = x [M, Kp] @ w [Kp, block_n] in f32."""
  m, bn = o_ref.shape

  def tile(i, acc):
    rows = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
    return acc + pltriton.dot(x_ref[:, rows], w_ref[rows, :])

  steps = x_ref.shape[1] // block_k
  o_ref[...] = jax.lax.fori_loop(0, steps, tile, jnp.zeros((m, bn), jnp.float32))


@functools.partial(jax.jit, static_argnames=("g", "interpret"))
def partials(x_mk, w_kn, *, g: Gemv, interpret=False):
  """f32 [splits, M, N] with sum over axis 0 = x @ w (f32 accumulation; x cast to w's dtype)."""
  m, k = x_mk.shape
  n = w_kn.shape[1]
  if not supports(m, k, n, g):
    raise ValueError(f"Gemv {g} does not fit [{m}, {k}] x [{k}, {n}] (see supports)")
  kp = k // g.splits
  return pl.pallas_call(
      functools.partial(_kernel, block_k=g.block_k),
      grid=(g.splits, n // g.block_n),
      in_specs=[pl.BlockSpec((m, kp), lambda s, j: (0, s)),
                pl.BlockSpec((kp, g.block_n), lambda s, j: (s, j))],
      out_specs=pl.BlockSpec((None, m, g.block_n), lambda s, j: (s, 0, j)),
      out_shape=jax.ShapeDtypeStruct((g.splits, m, n), jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=g.num_warps, num_stages=g.num_stages),
      interpret=interpret, name="draft_gemv",
  )(x_mk.astype(w_kn.dtype), w_kn)


def dot(x_bsk, w_kn, g: Gemv, interpret=False):
  """x @ w [B, S, N] in x's dtype through `partials` (the sum and cast fused by XLA into the
  consumer), rounded once as XLA's bf16 dot is."""
  B, S, K = x_bsk.shape
  part = partials(x_bsk.reshape(B * S, K), w_kn, g=g, interpret=interpret)
  return part.sum(0).reshape(B, S, -1).astype(x_bsk.dtype)
