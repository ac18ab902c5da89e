"""The tree mask in the form the kernel reads: per (node, head) row, 32 tree nodes per int32 word.

Letters: B batch, N tree nodes, H heads, W = ceil(N / 32) words, M = row tiles * 64 padded rows.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from pallas_kernels.tree_verify.tuning import BLOCK_M, num_row_tiles

WORD = 32
WORD_BITS = 5  # log2(WORD)
EXTRA_WORDS = 2  # a KV tile spans at most 3 words from its first one: the kernel reads 3, never OOB


def num_words(n):
  return -(-n // WORD)


def tree_mask_words(tree_mask, h, m_pad):
  """[B, N, N] bool -> [B, W + 2, M] int32; bit k % 32 of word k // 32 of row node * H + head is
  tree_mask[node, k]. Padded rows and the two extra words are zero (nothing visible).

  The bits are laid out per row first (repeat over heads, pad, transpose) and the 32-bit packing
  is the last op, so XLA emits one reduction fusion. It depends only on the tree, so a caller
  running many layers over the same tree computes it once (XLA CSEs identical per-layer calls)."""
  b, n, _ = tree_mask.shape
  w = num_words(n) + EXTRA_WORDS
  bits = jnp.pad(tree_mask, ((0, 0), (0, 0), (0, WORD * w - n)))                   # [B, N, 32 W']
  bits = jnp.pad(jnp.repeat(bits, h, axis=1), ((0, 0), (0, m_pad - n * h), (0, 0)))  # [B, M, 32 W']
  bits = bits.reshape(b, m_pad, w, WORD).transpose(0, 2, 1, 3)                      # [B, W', M, 32]
  shifts = jnp.arange(WORD, dtype=jnp.uint32)
  words = jnp.sum(bits.astype(jnp.uint32) << shifts, axis=-1, dtype=jnp.uint32)
  return lax.bitcast_convert_type(words, jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedTreeMask:
  """A tree mask packed for a head count once (`pack_tree_mask`), for callers that run many
  layers over the same tree; `tree_verify_attention` takes it in place of the bool mask."""
  words: jax.Array                                   # [B, W + 2, M] int32
  num_nodes: int = dataclasses.field(metadata=dict(static=True))
  heads: int = dataclasses.field(metadata=dict(static=True))


def pack_tree_mask(tree_mask, heads):
  """[B, N, N] bool -> PackedTreeMask for `heads` heads (what the kernel path does per call)."""
  n = tree_mask.shape[-1]
  m_pad = num_row_tiles(n, heads) * BLOCK_M
  return PackedTreeMask(tree_mask_words(tree_mask, heads, m_pad), n, heads)


def random_tree_mask(rng: np.random.Generator, b: int, n: int) -> np.ndarray:
  """[B, N, N] bool test / benchmark tree: node i sees itself and its ancestors, each node's
  parent drawn uniformly among the earlier nodes (node 0 is the root)."""
  mask = np.zeros((b, n, n), bool)
  for bb in range(b):
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    for i in range(n):
      j = i
      while j >= 0:
        mask[bb, i, j], j = True, parent[j]
  return mask
