"""Merge of the kernel's split partials into the output (several splits only).

Letters: B batch, S splits, M rows (node, head), R value width.

Per row: the splits' total LSE = log2 sum_s 2^lse_s (max, then a sum: two tiny reductions over
[B, S, M]), then out = sum_s 2^(lse_s - LSE) O_s, one reduction over the partials whose only
epilogue is the cast (XLA fuses it: one kernel; dividing by a separate denominator, as v1 did,
costs a fourth kernel). One variadic reduction over S carrying (max, denominator, O) like an
online softmax was slower on the H200 (2026-12-01: whole call 34.1 vs 29.2 us at N=1, H=8, L=46k;
63.4 vs 34.6 at N=8) and was removed.
Only the first `rows` rows of the partials are read (the kernel's rows past N*H are padding).
"""

import math

import jax.numpy as jnp

LN2 = math.log(2.0)


def merge_splits(o_p, lse_p, rows, dtype):
  """O [B, S, M, R] (bf16 or f32, normalised per split), base-2 LSE [B, S, M] -> (out
  [B, rows, R] in dtype, natural LSE [B, rows]). Empty splits carry LSE -inf and O 0; a row with
  no visible key gets O 0 and LSE -inf."""
  o_p, lse_p = o_p[:, :, :rows], lse_p[:, :, :rows]
  m = jnp.max(lse_p, axis=1)
  m = jnp.where(m == -jnp.inf, 0.0, m)
  den = jnp.sum(jnp.exp2(lse_p - m[:, None]), axis=1)
  total = jnp.where(den > 0, m + jnp.log2(jnp.where(den > 0, den, 1.0)), -jnp.inf)
  w = jnp.where(lse_p == -jnp.inf, 0.0, jnp.exp2(lse_p - total[:, None]))  # all -inf: 0, not NaN
  out = jnp.sum(w[..., None] * o_p.astype(jnp.float32), axis=1)
  return out.astype(dtype), total * LN2
