"""The residual add and the RMSNorm after it as ONE Pallas kernel launch, for a few rows
(TargetConfig.fused_add_norm: the one-token decode step).

Letters: M rows (tokens), D hidden.

At one token XLA makes each RMSNorm of the hidden vector [1, 1, D] two launches: a reduce fusion
(the mean square, the residual add recomputed in it) and an elementwise fusion (the scale, the
add recomputed again): ~2.6-2.9 us per norm on the H200, 2 norms per layer (WORKSPACE.md, eighth
session, s8_k26_core.log). Here one program per row loads its row (D padded to a power of two,
the padded lanes masked) once and writes both the sum and its norm. On a CUDA GPU it lowers
through Triton, elsewhere it runs in Pallas interpret mode (`jax.lax.platform_dependent`).

Numerics as `x + h` then `norm.rms_norm`: the sum rounded to x's dtype, the statistics and the
scale in f32, the norm cast back to x's dtype.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# Up to this many rows the kernel runs (one program each; the decode step's one token per row).
MAX_ROWS = 16
# Up to this hidden width (one row in one block: 16384 f32 lanes are 64 per thread at 8 warps).
MAX_DIM = 16384


def supports(rows: int, d: int) -> bool:
  """Whether the kernel takes `rows` rows of width d."""
  return 1 <= rows <= MAX_ROWS and 1 <= d <= MAX_DIM


def num_warps(d: int) -> int:
  """Warps per row: 8 from D = 4096 (K2.6's 7168: 8192 lanes, 32 per thread; the row's three
  loads are latency-bound, so more loads in flight), fewer below. Not yet timed on a GPU."""
  return max(1, min(8, pl.next_power_of_2(d) // 1024))


def add_rms_norm(x, h, weight, eps: float):
  """(s, y): s = x + h in x's dtype, y = rms_norm(s, weight, eps) as `norm.rms_norm`; x, h
  [..., D] of one dtype, weight [D]. h None: (x, rms_norm(x)), the plain norm in one launch."""
  d = x.shape[-1]
  rows = x.size // d if d else 0
  if h is not None and (h.shape != x.shape or h.dtype != x.dtype):
    raise ValueError(f"add_rms_norm: {x.shape=} {x.dtype=} vs {h.shape=} {h.dtype=}")
  if weight.shape != (d,) or not supports(rows, d):
    raise ValueError(f"add_rms_norm: {x.shape=} {weight.shape=} (rows <= {MAX_ROWS}, "
                     f"D <= {MAX_DIM})")
  call = functools.partial(_pallas_add_norm, eps=float(eps))
  x_md = x.reshape(rows, d)
  h_md = None if h is None else h.reshape(rows, d)
  s, y = jax.lax.platform_dependent(x_md, h_md, weight, cuda=call,
                                    default=functools.partial(call, interpret=True))
  return s.reshape(x.shape), y.reshape(x.shape)


def _pallas_add_norm(x_md, h_md, weight, *, eps, interpret=False):
  m, d = x_md.shape
  # The outputs vary over a shard_map's axes as the rows do (its varying-axes check).
  out = jax.ShapeDtypeStruct((m, d), x_md.dtype, manual_axis_type=jax.typeof(x_md).mat)
  params = plt.CompilerParams(num_warps=num_warps(d), num_stages=1)
  if h_md is None:
    y = pl.pallas_call(functools.partial(_norm_kernel, eps=eps), grid=(m,), out_shape=out,
                       compiler_params=params, interpret=interpret)(x_md, weight)
    return x_md, y
  s, y = pl.pallas_call(functools.partial(_add_norm_kernel, eps=eps), grid=(m,),
                        out_shape=[out, out], compiler_params=params,
                        interpret=interpret)(x_md, h_md, weight)
  return s, y


def _add_norm_kernel(x_ref, h_ref, w_ref, s_ref, y_ref, *, eps):
  """Program `row`: s = x + h (rounded to x's dtype), y = its RMSNorm; both stored."""
  row, cols, live = _row_lanes(x_ref)
  x = plt.load(x_ref.at[row, cols], mask=live, other=0.0).astype(jnp.float32)
  h = plt.load(h_ref.at[row, cols], mask=live, other=0.0).astype(jnp.float32)
  s = (x + h).astype(s_ref.dtype)
  plt.store(s_ref.at[row, cols], s, mask=live)
  plt.store(y_ref.at[row, cols], _normed(s, w_ref, cols, live, eps), mask=live)


def _norm_kernel(x_ref, w_ref, y_ref, *, eps):
  """Program `row`: y = RMSNorm of its row x."""
  row, cols, live = _row_lanes(x_ref)
  x = plt.load(x_ref.at[row, cols], mask=live, other=0.0)
  plt.store(y_ref.at[row, cols], _normed(x, w_ref, cols, live, eps), mask=live)


def _row_lanes(x_ref):
  """(this program's row, its D columns padded to a power of two, which lanes are real)."""
  d = x_ref.shape[1]
  dp = pl.next_power_of_2(d)
  return pl.program_id(0), pl.ds(0, dp), jnp.arange(dp, dtype=jnp.int32) < d


def _normed(s, w_ref, cols, live, eps):
  """`norm.rms_norm` of one row s [DP] (its padded lanes 0), in s's dtype."""
  d = w_ref.shape[0]
  sf = s.astype(jnp.float32)
  mean_square = jnp.sum(sf * sf) / d
  w = plt.load(w_ref.at[cols], mask=live, other=0.0).astype(jnp.float32)
  return (w * (sf * jax.lax.rsqrt(mean_square + eps))).astype(s.dtype)
