"""XLA references for the grouped expert matmul (f32 accumulation): bf16 and INT4 weights.

INT4 layout (kdtree_jax/checkpoint/int4.py): q int4 [G, N, K] (output-major, as HF stores `weight_packed`),
scale [G, K/S, N] (one scale per S = 32 input rows and output column).
"""

import jax
import jax.numpy as jnp


def dequantize(q_gnk, scale_gsn, dtype):
  """int4 [G, N, K] x scale [G, K/S, N] -> [G, K, N] in dtype (product rounded once to dtype)."""
  group = q_gnk.shape[2] // scale_gsn.shape[1]
  w = jnp.swapaxes(q_gnk, 1, 2).astype(dtype)
  return w * jnp.repeat(scale_gsn.astype(dtype), group, axis=1)


def grouped_matmul_reference(x_mk, w_gkn, group_sizes, out_dtype=None):
  """out[rows of group g] = x[rows of group g] @ w[g]; rows past sum(group_sizes) are 0."""
  out = jax.lax.ragged_dot(x_mk, w_gkn, group_sizes, preferred_element_type=jnp.float32,
                           precision=jax.lax.Precision.HIGHEST)
  return out.astype(out_dtype or x_mk.dtype)


def int4_grouped_matmul_reference(x_mk, q_gnk, scale_gsn, group_sizes, out_dtype=None):
  """As `grouped_matmul_reference` with w = dequantize(q, scale) in x.dtype (as the kernel)."""
  return grouped_matmul_reference(x_mk, dequantize(q_gnk, scale_gsn, x_mk.dtype), group_sizes,
                                  out_dtype)
