"""The ragged work list: one item per (row block, group) pair that holds rows of that group.

Rows of x are sorted by group; a 64-row block can hold the tail of one group and the head of the
next, so each item says which group's weights to use and which rows of its block to store. Items
past the end have size 0 (the kernel skips them: no weight bytes are read for empty experts).
"""

import jax.numpy as jnp


def num_items(m, g, block_m):
  """Static upper bound on the items: every group adds at most one block boundary."""
  return -(-m // block_m) + g - 1


def work_list(group_sizes, m, block_m):
  """int32 [4, T]: (group, block, first row within the block, rows to store) per item."""
  sizes = group_sizes.astype(jnp.int32)
  g = sizes.shape[0]
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first = starts // block_m
  n_blocks = jnp.where(sizes > 0, (ends - 1) // block_m - first + 1, 0)
  upto = jnp.cumsum(n_blocks)
  item = jnp.arange(num_items(m, g, block_m), dtype=jnp.int32)
  grp = jnp.minimum(jnp.searchsorted(upto, item, side="right"), g - 1).astype(jnp.int32)
  blk = first[grp] + item - (upto[grp] - n_blocks[grp])
  row0 = jnp.maximum(starts[grp], blk * block_m)
  row1 = jnp.minimum(ends[grp], (blk + 1) * block_m)
  size = jnp.where(item < upto[-1], jnp.maximum(row1 - row0, 0), 0)
  return jnp.stack([grp, blk, row0 - blk * block_m, size]).astype(jnp.int32)
