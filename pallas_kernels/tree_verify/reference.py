"""f32 XLA reference for absorbed-MLA tree-verify attention over a dense latent cache.

Letters: B batch, N tree nodes (queries), H heads, L cache rows, C = R + P latent width (576),
R latent rank (512, also the value width).
"""

import jax
import jax.numpy as jnp


def visibility_bnl(lengths, tree_mask, max_len):
  """[B, N, L] bool: key j is visible to node i iff j < len, or j = len + k with tree_mask[i, k]."""
  n = tree_mask.shape[-1]
  j = jnp.arange(max_len)[None, None, :]
  ln = lengths[:, None, None]
  k = j - ln
  in_tree = (k >= 0) & (k < n)
  tree_vis = jnp.take_along_axis(
      tree_mask, jnp.broadcast_to(jnp.clip(k, 0, n - 1), tree_mask.shape[:2] + (max_len,)), axis=2)
  return (j < ln) | (in_tree & tree_vis)


def tree_verify_attention_reference(q, cache, lengths, tree_mask, *, scale, value_dim=None,
                                    precision=jax.lax.Precision.HIGHEST):
  """out[b,i,h] = softmax_j(scale * q[b,i,h] . cache[b,j]) @ cache[b,j,:R], j visible; f32 math.

  q [B, N, H, C], cache [B, L, C], lengths [B] int32, tree_mask [B, N, N] bool.
  Returns (out [B, N, H, R] in q.dtype, lse [B, N, H] f32 natural log).
  """
  r = value_dim if value_dim is not None else cache.shape[-1] - 64
  qf = q.astype(jnp.float32)
  kf = cache.astype(jnp.float32)
  s = jnp.einsum("bnhc,blc->bnhl", qf, kf, precision=precision) * scale
  vis = visibility_bnl(lengths, tree_mask, cache.shape[1])[:, :, None, :]
  s = jnp.where(vis, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("bnhl,blr->bnhr", p, kf[..., :r], precision=precision) / denom
  lse = (jnp.log(denom) + m)[..., 0]
  return out.astype(q.dtype), lse
