"""YaRN rotary embedding in DeepSeek's interleaved pair layout.

Rope dims are stored as interleaved pairs (2i, 2i+1). `apply_rope` rotates each pair and returns
the de-interleaved layout [rotated evens | rotated odds]; q and k use the same layout, so their dot
product equals DeepSeek's complex-multiply form (HF `apply_rotary_pos_emb_interleave`).
"""

import math

import jax.numpy as jnp
import numpy as np

from kdtree_jax.target.config import TargetConfig


def _correction_dim(num_rotations, dim, base, max_pos):
  return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def inv_frequencies(cfg: TargetConfig) -> np.ndarray:
  """[P/2] inverse frequencies; YaRN blends interpolated and original ones by a linear ramp."""
  dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  inv = 1.0 / pos_freqs
  ys = cfg.rope_scaling
  if ys is None:
    return inv.astype(np.float32)
  orig = ys.original_max_position_embeddings
  low = max(math.floor(_correction_dim(ys.beta_fast, dim, base, orig)), 0)
  high = min(math.ceil(_correction_dim(ys.beta_slow, dim, base, orig)), dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = 1.0 - ramp  # weight of the original (un-interpolated) frequency
  inv = (inv / ys.factor) * (1 - extrapolation) + inv * extrapolation
  return inv.astype(np.float32)


def cos_sin(cfg: TargetConfig, positions):
  """cos, sin of shape positions.shape + [P/2], f32, with the YaRN cos/sin factor folded in."""
  inv = jnp.asarray(inv_frequencies(cfg))
  angles = positions.astype(jnp.float32)[..., None] * inv
  factor = 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.cos_sin_factor
  return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x, cos, sin):
  """Rotates interleaved pairs of x [..., P]; cos/sin broadcast against x[..., P/2]."""
  xf = x.astype(jnp.float32)
  even, odd = xf[..., 0::2], xf[..., 1::2]
  out = jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
  return out.astype(x.dtype)


def row_columns(start: int, p: int):
  """(i1, i2) static column indices [start + p] of a row of `start` plain columns followed by
  p interleaved rope columns, so the rotated row is x[i1] * [cos | cos] + x[i2] * [-sin | sin]
  with no concatenate of x's parts: apply_rope's column k < p/2 is x[2k] cos_k - x[2k+1] sin_k,
  column p/2 + k is x[2k+1] cos_k + x[2k] sin_k. The plain columns map to themselves."""
  head, k = np.arange(start), np.arange(p // 2)
  even, odd = start + 2 * k, start + 2 * k + 1
  return np.concatenate([head, even, odd]), np.concatenate([head, odd, even])


def rotate_tail(xf, start: int, cos, sin):
  """f32 x [..., start + P] with its last P (interleaved pair) columns rotated as apply_rope
  does and its first `start` columns kept (x * 1 + x * 0: the same finite values), in ONE
  elementwise expression: no concatenate of x's parts. cos / sin broadcast against
  x[..., P/2]; the [1 | cos | cos], [0 | -sin | sin] factors are the only concatenates (of
  cos / sin: shared by every layer that rotates at the same positions)."""
  i1, i2 = row_columns(start, xf.shape[-1] - start)
  ones = jnp.ones(cos.shape[:-1] + (start,), cos.dtype)
  c1 = jnp.concatenate([ones, cos, cos], axis=-1)
  c2 = jnp.concatenate([jnp.zeros_like(ones), -sin, sin], axis=-1)
  return xf[..., i1] * c1 + xf[..., i2] * c2
