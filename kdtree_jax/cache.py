"""The dense latent KV cache: one array for all layers, defragmented by construction.

latent [layers, B, L, C]: per layer and row, normalized c_kv (R) + rotated k_pe (P); rows
[0, lengths[b]) are committed. A verify step writes its N tree nodes at [len, len + N); commit
compacts the accepted ones onto [len, len + a) and advances `lengths`. No page tables.
"""

import flax.struct
import jax
import jax.numpy as jnp

from kdtree_jax.config import ModelConfig


@flax.struct.dataclass
class LatentCache:
  """Dense MLA cache: `latent` [layers, B, max_len, C] and committed `lengths` [B] int32."""

  latent: jax.Array
  lengths: jax.Array

  @property
  def max_len(self) -> int:
    return self.latent.shape[2]

  @property
  def batch(self) -> int:
    return self.latent.shape[1]

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> "LatentCache":
    latent = jnp.zeros((cfg.num_hidden_layers, batch, max_len, cfg.cache_dim), dtype)
    return cls(latent=latent, lengths=jnp.zeros((batch,), jnp.int32))


def compact_rows(latent_lblc, lengths_b, src_bn, count_b):
  """Moves rows len + src[b, k] onto len + k for k < count[b] (all layers at once).

  src_bn [B, A] are tree-row offsets of the accepted nodes in increasing order, so a forward
  gather-then-write never reads a row it has already overwritten.
  """
  a = src_bn.shape[1]
  k = jnp.arange(a)

  def one(lat_lc, ln, src, cnt):  # lat_lc [layers, L, C]
    rows = jnp.take(lat_lc, ln + src, axis=1, mode="clip")
    old = jax.lax.dynamic_slice_in_dim(lat_lc, ln, a, axis=1)
    rows = jnp.where((k < cnt)[None, :, None], rows, old)
    return jax.lax.dynamic_update_slice_in_dim(lat_lc, rows, ln, axis=1)

  return jax.vmap(one, in_axes=(1, 0, 0, 0), out_axes=1)(latent_lblc, lengths_b, src_bn, count_b)
