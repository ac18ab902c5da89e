"""RMSNorm computed in f32 (as HF and DeepSeek), cast back to the input dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps, mean_square=None):
  """weight * x / rms(x), statistics in f32. mean_square: mean(x * x) [..., 1] f32 when already
  computed (mla.input_dots: two norms' statistics from one reduction), else computed here."""
  y = x.astype(jnp.float32) * inv_rms(x, eps, mean_square)
  return (weight.astype(jnp.float32) * y).astype(x.dtype)


def inv_rms(x, eps, mean_square=None):
  """rsqrt(mean(x * x) + eps) [..., 1] f32: the norm's scale without its weight (the folded
  norms of target/pack.py's fold_norm_gains multiply a dot's output by it)."""
  if mean_square is None:
    xf = x.astype(jnp.float32)
    mean_square = jnp.mean(xf * xf, axis=-1, keepdims=True)
  return jax.lax.rsqrt(mean_square + eps)
