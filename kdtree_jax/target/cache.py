"""The dense latent KV cache: one [B, L, C] buffer per layer, defragmented by construction.

latent[layer] [B, L, C]: per row, normalized c_kv (R) + rotated k_pe (P); rows [0, lengths[b])
are committed. A verify step writes its N tree nodes at [len, len + N); commit compacts the
accepted ones onto [len, len + a) and advances `lengths`. No page tables.

Why one buffer per layer, not one [layers, B, L, C] array: with the stacked array, XLA copied the
whole cache three times per decode step plus every layer's slice once (the per-layer slice fed
to the attention is updated and written back; `kdtree_jax.hlo_audit` finds the copies). Separate
buffers are updated in place (the step writes only its new rows) and the attention kernel reads
each one whole, with no slice to materialise.
"""

import flax.struct
import jax
import jax.numpy as jnp

from kdtree_jax.target.config import TargetConfig


@flax.struct.dataclass
class LatentCache:
  """Dense MLA cache: `latent`, a tuple of one [B, max_len, C] array per layer, and committed
  `lengths` [B] int32."""

  latent: tuple
  lengths: jax.Array

  @property
  def max_len(self) -> int:
    return self.latent[0].shape[1]

  @property
  def batch(self) -> int:
    return self.latent[0].shape[0]

  @property
  def dtype(self):
    return self.latent[0].dtype

  @classmethod
  def zeros(cls, cfg: TargetConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> "LatentCache":
    latent = tuple(jnp.zeros((batch, max_len, cfg.cache_dim), dtype)
                   for _ in range(cfg.num_hidden_layers))
    return cls(latent=latent, lengths=jnp.zeros((batch,), jnp.int32))


def compact_rows(latent, lengths_b, src_bn, count_b):
  """Moves rows len + src[b, k] onto len + k for k < count[b], in every layer's buffer.

  latent: a tuple of [B, L, C] buffers. src_bn [B, A] are tree-row offsets of the accepted nodes
  in increasing order, so a forward gather-then-write never reads a row it has already overwritten.
  """
  return tuple(_compact_layer(lc, lengths_b, src_bn, count_b) for lc in latent)


def _compact_layer(cache_blc, lengths_b, src_bn, count_b):
  """One gather of the W rows to write (accepted rows, or a row's own value past `count`) and
  one in-place write at len; the write window is clamped into the buffer as
  dynamic_update_slice clamps it, so rows past `count` are rewritten unchanged."""
  a, rows_total = src_bn.shape[1], cache_blc.shape[1]
  k = jnp.arange(a)[None, :]
  start = jnp.clip(lengths_b, 0, rows_total - a)[:, None]                # the DUS's own clamp
  idx = jnp.where(k < count_b[:, None], lengths_b[:, None] + src_bn, start + k)  # [B, A]
  rows = jax.vmap(lambda c_lc, i: jnp.take(c_lc, i, axis=0, mode="clip"))(cache_blc, idx)
  return jax.vmap(lambda c_lc, r, ln: jax.lax.dynamic_update_slice_in_dim(c_lc, r, ln, axis=0))(
      cache_blc, rows, lengths_b)
