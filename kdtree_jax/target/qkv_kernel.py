"""The attention's input epilogue as ONE Pallas kernel launch (TargetConfig.qkv_split_k): the
packed q_a | kv_a dot's S K-partials summed, the q LoRA RMSNorm, and c_kv's mean square.

Letters: S partials, T token rows, Rq q_lora_rank, R kv_lora_rank, P rope dim, W = Rq + R + P.

At decode (one token; 16 in a DDTree 15 verify) XLA splits the [T, D] x [D, W] dot over K and
then runs three small kernels per layer: the split-K sum into y, the joint mean squares
(`mla.lora_mean_squares`) and the q norm writing c_q for the q_b dot (~1.3-1.5 us each, mostly
launch latency, 61 layers per step). Here the dot is our own split (`pack.dot_t_partials`, S
partials [S, T, W] f32) and one program per token row sums its S partial rows in order
s = 0..S-1, rounds the sum to the output dtype (y, as the dot's own output is rounded), and
writes y, c_q = rms_norm(y[:Rq], q_a_norm) (f32 statistics of the ROUNDED y as `norm.rms_norm`:
rsqrt(mean + eps), weight * (y * scale), rounded once) and mean(c_kv^2) of y[Rq:Rq + R] f32 for
the kv norm inside the cache-row write (`mla.latent_rows`). On a CUDA GPU it lowers through
Triton, elsewhere it runs in Pallas interpret mode (`jax.lax.platform_dependent`).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kdtree_jax.target.partial_rows import lanes, live, summed

# Up to this many token rows the kernel runs (one program each); more (prefill): XLA's dot.
MAX_ROWS = 128
# 4 warps: a K2.6 row's q part is 1536 of 2048 power-of-2 lanes, 16 f32 registers per thread
# per live vector at 4 warps (64 at one). Not yet timed against 1, 2 or 8 on a GPU.
NUM_WARPS = 4


def supports(rows: int) -> bool:
  """Whether the kernel takes this many token rows."""
  return 1 <= rows <= MAX_ROWS


def qkv_epilogue(parts_srw, q_a_norm, rq: int, r: int, eps: float, out_dtype):
  """(y [T, W] out_dtype: sum_s parts[s] rounded; c_q [T, Rq] out_dtype: rms_norm(y[:, :Rq],
  q_a_norm, eps); ms_kv [T, 1] f32: mean(y[:, Rq:Rq + R]^2)). parts_srw: [S, T, W] f32 with
  W > Rq + R (the rope columns last), summed in order s = 0..S-1."""
  _, t, w = parts_srw.shape
  if not supports(t) or q_a_norm.shape != (rq,) or min(rq, r) < 1 or w <= rq + r:
    raise ValueError(f"qkv_epilogue: parts {parts_srw.shape}, q_a_norm {q_a_norm.shape}, "
                     f"{rq=}, {r=} (T <= {MAX_ROWS}, W > Rq + R)")
  call = functools.partial(_pallas_epilogue, rq=rq, r=r, eps=float(eps),
                           out_dtype=jnp.dtype(out_dtype))
  parts = parts_srw.astype(jnp.float32)
  return jax.lax.platform_dependent(parts, q_a_norm, cuda=call,
                                    default=functools.partial(call, interpret=True))


def _pallas_epilogue(parts_srw, q_a_norm, *, rq, r, eps, out_dtype, interpret=False):
  _, t, w = parts_srw.shape
  out = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=jax.typeof(parts_srw).mat)
  kernel = functools.partial(_epilogue_kernel, rq=rq, r=r, eps=eps)
  return pl.pallas_call(
      kernel,
      grid=(t,),
      out_shape=[out((t, w), out_dtype), out((t, rq), out_dtype), out((t, 1), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
  )(parts_srw, q_a_norm)


def _epilogue_kernel(parts_ref, norm_ref, y_ref, c_q_ref, ms_ref, *, rq, r, eps):
  """Program `row`: its S partial rows [S, W] summed (s = 0..S-1) and rounded -> y, c_q, ms_kv.
  Three column ranges (q, kv, rope), each as power-of-2 lanes masked past its width."""
  row = pl.program_id(0)
  dtype = y_ref.dtype
  y_q = _rounded_into(y_ref, parts_ref, row, 0, rq)
  scale = jax.lax.rsqrt(jnp.sum(y_q * y_q) / rq + eps)
  gain = plt.load(norm_ref.at[lanes(row, 0, rq)], mask=live(rq), other=0.0)
  plt.store(c_q_ref.at[row, lanes(row, 0, rq)],
            (gain.astype(jnp.float32) * (y_q * scale)).astype(dtype), mask=live(rq))
  y_kv = _rounded_into(y_ref, parts_ref, row, rq, r)
  ms_ref[row, :] = jnp.full((1,), jnp.sum(y_kv * y_kv) / r, jnp.float32)
  _rounded_into(y_ref, parts_ref, row, rq + r, y_ref.shape[1] - rq - r)


def _rounded_into(y_ref, parts_ref, row, start, n):
  """y[row, start:start + n] = sum over s = 0..S-1 of the partials, rounded to y's dtype;
  returns that rounded value in f32 [n_pow2] (0 past n)."""
  y = summed(parts_ref, row, start, n).astype(y_ref.dtype)
  plt.store(y_ref.at[row, lanes(row, start, n)], y, mask=live(n))
  return y.astype(jnp.float32)
