"""Merge of the kernel's split partials into the output (several splits only).

Letters: B batch, S splits, M rows (node, head), R value width.

Per row: the splits' total LSE = log2 sum_s 2^lse_s as ONE variadic reduction over the small
[B, S, M] LSEs (running max and denominator, combined like an online softmax), then
out = sum_s 2^(lse_s - LSE) O_s, one reduction over the partials (the weights and the cast fuse
into it). On the H200 (2026-12-01) the max / sum / divide form took 4 kernels (~6 us at N=1, H=8,
L=46k, S=132); a variadic reduction over the whole partials [B, S, M, R] was slower still (whole
call 34.1 vs 29.2 us at N=1; 63.4 vs 34.6 at N=8) and is not used.
Only the first `rows` rows of the partials are read (the kernel's rows past N*H are padding).
"""

import math

import jax.numpy as jnp
from jax import lax

LN2 = math.log(2.0)


def _online_merge(a, b):
  """(max, den) x (max, den) -> their merge (den relative to the max); -inf maxima weigh 0."""
  (ma, da), (mb, db) = a, b
  m = jnp.maximum(ma, mb)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  return m, da * jnp.exp2(ma - m_safe) + db * jnp.exp2(mb - m_safe)


def merge_splits(o_p, lse_p, rows, dtype):
  """O [B, S, M, R] (bf16 or f32, normalised per split), base-2 LSE [B, S, M] -> (out
  [B, rows, R] in dtype, natural LSE [B, rows]). Empty splits carry LSE -inf and O 0; a row with
  no visible key gets O 0 and LSE -inf."""
  o_p, lse_p = o_p[:, :, :rows], lse_p[:, :, :rows]
  m, den = lax.reduce((lse_p, jnp.ones_like(lse_p)), (jnp.float32(-jnp.inf), jnp.float32(0.0)),
                      _online_merge, (1,))
  total = jnp.where(den > 0, m + jnp.log2(jnp.where(den > 0, den, 1.0)), -jnp.inf)
  w = jnp.where(lse_p == -jnp.inf, 0.0, jnp.exp2(lse_p - total[:, None]))  # all -inf: 0, not NaN
  out = jnp.sum(w[..., None] * o_p.astype(jnp.float32), axis=1)
  return out.astype(dtype), total * LN2
