"""XLA reference for the INT4 grouped matmul: dequantise every expert, then a ragged dot (f32)."""

import jax
import jax.numpy as jnp


def dequantize(q_gkn, scale_gsn, dtype):
  """int4 [G, K, N] x scale [G, K/S, N] -> [G, K, N] in dtype (product rounded once to dtype)."""
  group = q_gkn.shape[1] // scale_gsn.shape[1]
  return q_gkn.astype(dtype) * jnp.repeat(scale_gsn.astype(dtype), group, axis=1)


def int4_grouped_matmul_reference(x_mk, q_gkn, scale_gsn, group_sizes, out_dtype=None):
  """out[rows of group g] = x[rows of group g] @ dequant(q[g], scale[g]); f32 accumulation.

  The weights are dequantised to x.dtype first (as the kernel does in registers), so the kernel and
  this reference see the same bf16 weight values and differ only by summation order.
  """
  w = dequantize(q_gkn, scale_gsn, x_mk.dtype)
  out = jax.lax.ragged_dot(x_mk, w, group_sizes, preferred_element_type=jnp.float32,
                           precision=jax.lax.Precision.HIGHEST)
  return out.astype(out_dtype or x_mk.dtype)
