"""y[M, N] = x[M, K] @ w_t[N, K]^T for few rows (M <= 16) as one Pallas Triton kernel: the
weight-streaming dots of a decode step (target/pack.py's out-major `_t` weights, `dot_t`).

Letters: M rows of x, N rows of w_t (the outputs), K the contracted size; BN, BK, S: the
Tuning's rows per program, K per loop step and K splits.

Program (j, s) owns rows [j BN, (j + 1) BN) of w_t and streams them over its K / S share in BK
steps, f32 accumulation: at M = 1 a [BN, BK] multiply-accumulate reduced over K once at the end
(no MMA: one row), at M > 1 tl.dot of x's [16, BK] tile (rows >= M masked to 0) and the weights'
[BN, BK]^T. With S = 1 it writes y in the output dtype; with S > 1 f32 partials [S, M, N] that
one XLA reduction sums. On a CUDA GPU it lowers through Triton, elsewhere it runs in Pallas
interpret mode (`jax.lax.platform_dependent`), as target/route_kernel.py.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.skinny_dot.tuning import MAX_ROWS, Tuning, default_tuning, rows_block_min


def out_dtype(x, w_t, preferred_element_type=None):
  """The dtype XLA's dot_general(x, w_t) gives (pack.dot_t's)."""
  return jax.eval_shape(
      functools.partial(jax.lax.dot_general, dimension_numbers=(((x.ndim - 1,), (1,)), ((), ())),
                        preferred_element_type=preferred_element_type), x, w_t).dtype


def supports(m: int, n: int, k: int, x_dtype, w_dtype, tuning: Tuning | None = None) -> bool:
  """Whether the kernel takes this dot: 1 <= M <= MAX_ROWS, x and w_t of one dtype, and a
  tuning whose blocks divide N and K / S (the default's where tuning is None)."""
  if not 1 <= m <= MAX_ROWS or x_dtype != w_dtype:
    return False
  try:
    t = tuning or default_tuning(m, n, k)
  except ValueError:
    return False
  return (t.bn >= rows_block_min(m) and n % t.bn == 0 and k % t.splits == 0
          and (k // t.splits) % (t.bk * t.unroll) == 0 and (t.unroll == 1 or m == 1))


def skinny_dot(x_mk, w_nk, preferred_element_type=None, tuning: Tuning | None = None):
  """x [M, K] @ w_t [N, K]^T -> [M, N] in XLA's dot dtype (preferred_element_type if given,
  else the inputs'), f32 accumulation. Raises ValueError where `supports` is False."""
  (m, k), (n, k2) = x_mk.shape, w_nk.shape
  tuning = tuning or (default_tuning(m, n, k) if k == k2 else None)
  if k != k2 or not supports(m, n, k, x_mk.dtype, w_nk.dtype, tuning):
    raise ValueError(f"skinny dot: {x_mk.shape=} {x_mk.dtype} {w_nk.shape=} {w_nk.dtype} "
                     f"{tuning=}")
  dtype = out_dtype(x_mk, w_nk, preferred_element_type)
  call = functools.partial(_pallas_dot, dtype=dtype, tuning=tuning)
  return jax.lax.platform_dependent(x_mk, w_nk, cuda=call,
                                    default=functools.partial(call, interpret=True))


def _pallas_dot(x_mk, w_nk, *, dtype, tuning, interpret=False):
  (m, k), (n, _) = x_mk.shape, w_nk.shape
  s = tuning.splits
  part = jnp.float32 if s > 1 else dtype
  out = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=jax.typeof(x_mk).mat)
  kernel = functools.partial(_skinny_dot_kernel, m=m, bn=tuning.bn, bk=tuning.bk, k_split=k // s,
                             unroll=tuning.unroll)
  y = pl.pallas_call(
      kernel,
      grid=(n // tuning.bn, s),
      out_shape=out((s, m, n), part),
      compiler_params=plt.CompilerParams(num_warps=tuning.num_warps,
                                         num_stages=tuning.num_stages),
      interpret=interpret,
  )(x_mk, w_nk)
  return y[0] if s == 1 else jnp.sum(y, axis=0).astype(dtype)


def _skinny_dot_kernel(x_ref, w_ref, y_ref, *, m, bn, bk, k_split, unroll):
  """Program (j, s): y_ref[s, :, j BN:(j + 1) BN] = x[:, K share s] @ w_t[rows j, K share s]^T
  (M = 1: `unroll` BK chunks loaded per loop step, then multiplied and added)."""
  j, s = pl.program_id(0), pl.program_id(1)
  rows = pl.ds(pl.multiple_of(j * bn, bn), bn)
  k0 = s * k_split
  cols = lambda i: pl.ds(pl.multiple_of(k0 + i * bk, bk), bk)
  steps = k_split // bk
  if m == 1:
    def step(i, acc):
      chunks = [(w_ref[rows, cols(i * unroll + u)], x_ref[pl.ds(0, 1), cols(i * unroll + u)])
                for u in range(unroll)]  # every load issued before the first multiply-add
      for w, x in chunks:
        acc = acc + w.astype(jnp.float32) * x.astype(jnp.float32)
      return acc
    acc = jax.lax.fori_loop(0, steps // unroll, step, jnp.zeros((bn, bk), jnp.float32))
    y_ref[s, 0, rows] = jnp.sum(acc, axis=1).astype(y_ref.dtype)
    return
  live = jnp.broadcast_to((jnp.arange(MAX_ROWS) < m)[:, None], (MAX_ROWS, bk))

  def step(i, acc):
    x = plt.load(x_ref.at[pl.ds(0, MAX_ROWS), cols(i)], mask=live, other=0)
    w = w_ref[rows, cols(i)]
    return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
  acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((MAX_ROWS, bn), jnp.float32))
  out_live = jnp.broadcast_to((jnp.arange(MAX_ROWS) < m)[:, None], (MAX_ROWS, bn))
  plt.store(y_ref.at[s, pl.ds(0, MAX_ROWS), rows], acc.astype(y_ref.dtype), mask=out_live)
