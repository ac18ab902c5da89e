"""Merge of the kernel's split partials into the output (several splits only).

Letters: B batch, S splits, M rows (node, head), R value width.

One variadic XLA reduction over S carries (running max, denominator, weighted O) per element and
combines two of them like an online softmax: a single pass over the partials, which XLA emits as
one reduction kernel (the LSE broadcast along R is fused into it, not materialised).
"""

import math

import jax.numpy as jnp
from jax import lax

LN2 = math.log(2.0)


def _online_merge(a, b):
  """(max, den, O) x (max, den, O) -> their merge; -inf maxima (empty splits) weigh 0."""
  (ma, da, oa), (mb, db, ob) = a, b
  m = jnp.maximum(ma, mb)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  wa, wb = jnp.exp2(ma - m_safe), jnp.exp2(mb - m_safe)
  return m, da * wa + db * wb, oa * wa + ob * wb


def merge_splits_xla(o_p, lse_p, dtype):
  """O [B, S, M, R] (bf16 or f32, normalised per split), base-2 LSE [B, S, M] -> (out [B, M, R] in
  dtype, natural LSE [B, M]). Empty splits carry LSE -inf and O 0; a row with no visible key gets
  O 0 and LSE -inf."""
  o32 = o_p.astype(jnp.float32)
  lse_full = jnp.broadcast_to(lse_p[..., None], o_p.shape)
  m, den, num = lax.reduce((lse_full, jnp.ones_like(o32), o32),
                           (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(0.0)),
                           _online_merge, (1,))
  out = num / jnp.where(den > 0, den, 1.0)
  lse = jnp.where(den[..., 0] > 0, m[..., 0] + jnp.log2(den[..., 0]), -jnp.inf) * LN2
  return out.astype(dtype), lse
