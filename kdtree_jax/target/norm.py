"""RMSNorm computed in f32 (as HF and DeepSeek), cast back to the input dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps, mean_square=None):
  """weight * x / rms(x), statistics in f32. mean_square: mean(x * x) [..., 1] f32 when already
  computed (mla.input_dots: two norms' statistics from one reduction), else computed here."""
  xf = x.astype(jnp.float32)
  if mean_square is None:
    mean_square = jnp.mean(xf * xf, axis=-1, keepdims=True)
  y = xf * jax.lax.rsqrt(mean_square + eps)
  return (weight.astype(jnp.float32) * y).astype(x.dtype)
