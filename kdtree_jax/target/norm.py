"""RMSNorm computed in f32 (as HF and DeepSeek), cast back to the input dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps):
  """weight * x / rms(x), statistics in f32."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (weight.astype(jnp.float32) * y).astype(x.dtype)
