"""The work list: one item per window of R rows holding rows of one expert (rows sorted by expert).

An expert's windows start at its first row rounded down to a multiple of 8 (the TMA of a tiled
SMEM tile needs 8-aligned row offsets) and step by R, so an expert whose rows fit one window has
its weights read by exactly one item, and an expert with no rows gets no item: no tile, no weight
bytes. A window may also hold neighbouring experts' rows: they are computed and not stored.
Items past the live count have size 0 and the kernel skips them.
Letters: M rows, G experts, R rows per item.
"""

import jax.numpy as jnp

ALIGN = 8


def num_items(m: int, g: int, rows: int) -> int:
  """Static upper bound on the items (every one is a launched CTA column, live or not).

  Expert g's window starts up to 7 rows before its first row, so it has ceil((n_g + 7) / R) <=
  (n_g + 6 + R) / R items; over k = min(G, M) non-empty experts: (M + k (R + 6)) / R.
  """
  k = min(g, m)
  return (m + k * (rows + 6)) // rows


def work_list(group_sizes, m: int, rows: int):
  """int32 [4, I]: (expert, window's first row, first stored row in it, rows stored) per item."""
  sizes = group_sizes.astype(jnp.int32)
  g = sizes.shape[0]
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  base = starts - starts % ALIGN
  chunks = jnp.where(sizes > 0, -(-(ends - base) // rows), 0)
  upto = jnp.cumsum(chunks)
  item = jnp.arange(num_items(m, g, rows), dtype=jnp.int32)
  grp = jnp.minimum(jnp.searchsorted(upto, item, side="right"), g - 1).astype(jnp.int32)
  win = base[grp] + (item - (upto[grp] - chunks[grp])) * rows
  lo = jnp.maximum(starts[grp], win)
  hi = jnp.minimum(ends[grp], win + rows)
  size = jnp.where(item < upto[-1], jnp.maximum(hi - lo, 0), 0)
  return jnp.stack([grp, win, lo - win, size]).astype(jnp.int32)
