"""Split-K matmul of a few rows (the draft block's M = B*S = 16) as a Pallas (Triton) kernel.

The draft's small dots read a weight matrix once per block, so their floor is the weight bytes.
On the H200 XLA's Triton GEMMs ran o_proj ([16, 1024] x [1024, 7168], no split-K) at ~2 TB/s and
q|k|v ([16, 7168] x [7168, 1280], split-K 16) at ~2.4 TB/s of a 4.1 TB/s copy rate
(results/h200/2026-12-01/s5_draft_io.log). Here the grid is chosen for that read: program
(s, n) streams rows [s*K/splits, (s+1)*K/splits) of weight columns [n*block_n, (n+1)*block_n)
in tiles of block_k rows (num_stages - 1 of them in flight ahead) and writes its f32 partial
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
  tile of the program's loop; num_warps, num_stages: Triton's. The defaults keep a program's
  shared memory at 3 x (4 + 16) KB, so 3 programs fit on an SM: many small programs (several
  per SM, e.g. 560 of 32 KB for q|k|v at 28 splits) balance the SMs better than one wave of
  ~132 programs, which 132 = 4 x 3 x 11 SMs never divide evenly for these power-of-two x 7
  shapes."""
  splits: int
  block_n: int = 64
  block_k: int = 128
  num_warps: int = 4
  num_stages: int = 3


def supports(m: int, k: int, n: int, g: Gemv) -> bool:
  """Rows a power of two >= 16 (Triton dot tiles and blocks), K split into whole tiles, N into
  whole power-of-two column blocks."""
  pow2 = lambda x: x >= 16 and x & (x - 1) == 0
  return (pow2(m) and k % (g.splits * g.block_k) == 0 and n % g.block_n == 0
          and pow2(g.block_n) and pow2(g.block_k))


def _kernel(x_ref, w_ref, *refs, block_k, scaled, residual, with_ss):
  """One (split, column block): acc [M, block_n] = x [M, Kp] @ w [Kp, block_n] in f32, x's
  columns first multiplied by scale [Kp] (scaled; rounded to w's dtype for the dot); written
  as acc, or (residual, one split) as res + acc rounded as XLA rounds a dot then an add; with_ss
  also the rows' sums of squares of x over Kp (f32)."""
  scale_ref = refs[0] if scaled else None
  res_ref = refs[int(scaled)] if residual else None
  o_ref = refs[int(scaled) + int(residual)]
  m, bn = o_ref.shape

  def tile(i, carry):
    acc, ss = carry
    rows = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
    x = x_ref[:, rows]
    if with_ss:
      xf = x.astype(jnp.float32)
      ss = ss + jnp.sum(xf * xf, axis=1)
    if scaled:
      x = x.astype(jnp.float32) * scale_ref[rows].astype(jnp.float32)[None, :]
    return acc + pltriton.dot(x.astype(w_ref.dtype), w_ref[rows, :]), ss

  steps = x_ref.shape[1] // block_k
  init = (jnp.zeros((m, bn), jnp.float32), jnp.zeros((m,), jnp.float32))
  acc, ss = jax.lax.fori_loop(0, steps, tile, init)
  if residual:
    res = res_ref[...]
    acc = res.astype(jnp.float32) + acc.astype(res.dtype).astype(jnp.float32)
  o_ref[...] = acc.astype(o_ref.dtype)
  if with_ss:
    refs[-1][...] = ss


@functools.partial(jax.jit, static_argnames=("g", "interpret", "with_ss"))
def _gemv(x_mk, w_kn, scale_k, residual_mn, *, g: Gemv, interpret, with_ss):
  """The pallas_call of _kernel: (out, ss or None); out f32 [splits, M, N], or with residual_mn
  (one split) [M, N] in its dtype; ss [splits, M]."""
  m, k = x_mk.shape
  n = w_kn.shape[1]
  if not supports(m, k, n, g) or (residual_mn is not None and g.splits != 1):
    raise ValueError(f"Gemv {g} does not fit [{m}, {k}] x [{k}, {n}] (see supports; a residual "
                     "needs one split)")
  kp, bn = k // g.splits, g.block_n
  ins = [x_mk, w_kn]
  specs = [pl.BlockSpec((m, kp), lambda s, j: (0, s)),
           pl.BlockSpec((kp, bn), lambda s, j: (s, j))]
  if scale_k is not None:
    ins.append(scale_k)
    specs.append(pl.BlockSpec((kp,), lambda s, j: (s,)))
  if residual_mn is not None:
    ins.append(residual_mn)
    specs.append(pl.BlockSpec((m, bn), lambda s, j: (0, j)))
    out = [jax.ShapeDtypeStruct((m, n), residual_mn.dtype)]
    out_specs = [pl.BlockSpec((m, bn), lambda s, j: (0, j))]
  else:
    out = [jax.ShapeDtypeStruct((g.splits, m, n), jnp.float32)]
    out_specs = [pl.BlockSpec((None, m, bn), lambda s, j: (s, 0, j))]
  if with_ss:  # every column block of split s writes the same sums
    out.append(jax.ShapeDtypeStruct((g.splits, m), jnp.float32))
    out_specs.append(pl.BlockSpec((None, m), lambda s, j: (s, 0)))
  res = pl.pallas_call(
      functools.partial(_kernel, block_k=g.block_k, scaled=scale_k is not None,
                        residual=residual_mn is not None, with_ss=with_ss),
      grid=(g.splits, n // bn), in_specs=specs, out_specs=out_specs, out_shape=out,
      compiler_params=pltriton.CompilerParams(num_warps=g.num_warps, num_stages=g.num_stages),
      interpret=interpret, name="draft_gemv",
  )(*ins)
  return res[0], (res[1] if with_ss else None)


def partials(x_mk, w_kn, *, g: Gemv, interpret=False):
  """f32 [splits, M, N] with sum over axis 0 = x @ w (f32 accumulation; x cast to w's dtype)."""
  return _gemv(x_mk.astype(w_kn.dtype), w_kn, None, None, g=g, interpret=interpret,
               with_ss=False)[0]


def dot(x_bsk, w_kn, g: Gemv, interpret=False):
  """x @ w [B, S, N] in x's dtype through `partials` (the sum and cast fused by XLA into the
  consumer), rounded once as XLA's bf16 dot is."""
  B, S, K = x_bsk.shape
  part = partials(x_bsk.reshape(B * S, K), w_kn, g=g, interpret=interpret)
  return part.sum(0).reshape(B, S, -1).astype(x_bsk.dtype)


def add_dot(x_bsn, a_bsk, w_kn, g: Gemv, interpret=False):
  """x + a @ w [B, S, N] in x's dtype, a @ w rounded to it first (as XLA's dot then add): with
  one split the add is the kernel's epilogue (no f32 partials, no XLA add kernel), else the
  partials are summed in XLA's add."""
  if g.splits != 1:
    return x_bsn + dot(a_bsk, w_kn, g, interpret)
  B, S, K = a_bsk.shape
  out, _ = _gemv(a_bsk.reshape(B * S, K).astype(w_kn.dtype), w_kn, None,
                 x_bsn.reshape(B * S, -1), g=g, interpret=interpret, with_ss=False)
  return out.reshape(x_bsn.shape)


def normed_dot(x_bsk, norm_k, w_kn, eps, g: Gemv, interpret=False):
  """rms_norm(x, norm) @ w with the norm folded into the matmul: ((x * norm) @ w) * r, r =
  rsqrt(mean(x^2) + eps) per row; the kernel scales x by norm in its prologue and returns its
  slice's sums of squares, XLA forms r and scales the summed partials (one fusion: no norm
  kernel before the dot). Equal to model.rms_norm then the dot up to rounding (x * norm
  rounded once to w's dtype instead of x * r then * norm) -> f32 [B, S, N]."""
  B, S, K = x_bsk.shape
  part, ss = _gemv(x_bsk.reshape(B * S, K).astype(w_kn.dtype), w_kn, norm_k, None, g=g,
                   interpret=interpret, with_ss=True)
  r = jax.lax.rsqrt(ss.sum(0) / K + eps)  # [M]
  return (part.sum(0) * r[:, None]).reshape(B, S, -1)
