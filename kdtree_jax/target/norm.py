"""RMSNorm computed in f32 (as HF and DeepSeek), cast back to the input dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps, mean_square=None):
  """weight * x / rms(x), statistics in f32. mean_square: mean(x * x) [..., 1] f32 when already
  computed (mla.input_dots: two norms' statistics from one reduction), else computed here."""
  xf = x.astype(jnp.float32)
  y = xf * rms_factor(x, eps, mean_square)
  return (weight.astype(jnp.float32) * y).astype(x.dtype)


def rms_factor(x, eps, mean_square=None):
  """1 / rms(x) = rsqrt(mean(x * x) + eps) [..., 1] f32 (mean_square: as in rms_norm)."""
  if mean_square is None:
    xf = x.astype(jnp.float32)
    mean_square = jnp.mean(xf * xf, axis=-1, keepdims=True)
  return jax.lax.rsqrt(mean_square + eps)


def normed_dot_t(x, w_gt, eps, mean_square=None):
  """rms_norm(x, g) @ w^T for a gain folded into the out-major weight, w_gt = w^T * g [N, D]
  (target.pack's fold_norms): dot(x, w_gt) * (1 / rms(x)) [..., N] in x's dtype, the sum in f32
  and the factor on the dot's OUTPUT, so the normed x is never made (the same value as
  dot(g * x / rms(x), w) in exact arithmetic; f32 / bf16 rounding differs)."""
  y = jax.lax.dot_general(x, w_gt, (((x.ndim - 1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
  return (y * rms_factor(x, eps, mean_square)).astype(x.dtype)
