"""Merge of the kernel's split partials into the output: the XLA reference of the merge.

Letters: B batch, S splits, M rows (node, head), R value width.
"""

import math

import jax.numpy as jnp

LN2 = math.log(2.0)


def merge_splits_xla(o_p, lse_p, dtype):
  """O [B, S, M, R] (bf16 or f32, normalised per split), base-2 LSE [B, S, M] -> (out [B, M, R] in dtype,
  natural LSE [B, M]). Empty splits carry LSE -inf and O 0; a row with no visible key gets O 0."""
  m = jnp.max(lse_p, axis=1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp2(lse_p - m[:, None])
  den = jnp.sum(w, axis=1)
  num = jnp.einsum("bsm,bsmr->bmr", w, o_p.astype(jnp.float32))
  out = num / jnp.where(den > 0, den, 1.0)[..., None]
  return out.astype(dtype), (m + jnp.log2(den)) * LN2
