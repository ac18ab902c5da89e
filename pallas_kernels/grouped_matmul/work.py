"""The work list: one item per window of R rows holding rows of one expert (rows sorted by expert).

An expert's windows start at its first row rounded down to a multiple of 8 (the TMA of a tiled
SMEM tile needs 8-aligned row offsets) and step by R, so an expert whose rows fit one window has
its weights read by exactly one item, and an expert with no rows gets no item: no tile, no weight
bytes. A window may also hold neighbouring experts' rows: they are computed and not stored.
Items past the live count have size 0 and the kernel skips them. The list is built once per MoE
layer and shared by its gated and down calls (same R).
Letters: M rows, G experts, R rows per item.
"""

import jax.numpy as jnp

ALIGN = 8


def num_items(m: int, g: int, rows: int) -> int:
  """Static upper bound on the items (every one is a launched CTA column, live or not).

  An expert of n >= 1 rows starting up to 7 rows past an 8-aligned row has at most
  ceil((n + 7) / R) = 1 + floor((n + 6) / R) items: its first item costs 1 row, its second
  R - 7 more rows, every later one R more. The most items M rows can buy over at most G experts:
  j = min(G, M) experts of one row each, then as many (R - 7)-row second items as the rows left
  allow (at most j), then R-row items.
  """
  j = min(g, m)
  left = m - j
  second = min(j, left // (rows - 7))
  return j + second + (left - second * (rows - 7)) // rows


def num_items_aligned(m: int, g: int, rows: int) -> int:
  """`num_items` where every expert's rows start at a multiple of 8 (an aligned layout with gaps,
  m pairs in it): an expert of n >= 1 rows has ceil(n / R) <= 1 + floor((n - 1) / R) items, so
  at most min(G, M) experts' first items plus floor((M - min(G, M)) / R) more."""
  j = min(g, m)
  return j + (m - j) // rows


def _inclusive_sum(v):
  """cumsum of a short vector as one masked reduction (XLA's cumsum is reduce-window passes)."""
  i = jnp.arange(v.shape[0])
  return jnp.sum(jnp.where(i[None, :] <= i[:, None], v[None, :], 0), axis=1, dtype=v.dtype)


def windows_per_group(group_sizes, group_ends, rows: int):
  """Items (R-row windows from the 8-aligned row at or below its first row) per expert [G]."""
  starts = group_ends - group_sizes
  base = starts - starts % ALIGN
  return jnp.where(group_sizes > 0, -(-(group_ends - base) // rows), 0)


def work_list(group_sizes, m: int, rows: int, group_ends=None, items_upto=None,
              max_items: int | None = None):
  """int32 [4, I]: (expert, window's first row, first stored row in it, rows stored) per item;
  items past the live count are all 0.

  Element-wise ops and masked reductions only (the default searchsorted is a while loop of
  ~log2(G) small kernels on a GPU, cumsum a few reduce-window passes): the windows per expert,
  their inclusive sum, then ONE reduction over the experts that finds each item's expert and
  writes all four fields (no search, gather or stack after it). group_ends: the inclusive
  cumsum of the sizes when the caller has it (one dependent reduction less); items_upto: the
  inclusive cumsum of `windows_per_group` for R = rows, when the caller has it (one more less).
  max_items: the static item count (default `num_items(m, G, R)`; `num_items_aligned` where the
  experts start 8-aligned)."""
  sizes = group_sizes.astype(jnp.int32)
  g = sizes.shape[0]
  ends = _inclusive_sum(sizes) if group_ends is None else group_ends.astype(jnp.int32)
  starts = ends - sizes
  base = starts - starts % ALIGN
  chunks = windows_per_group(sizes, ends, rows)
  upto = _inclusive_sum(chunks) if items_upto is None else items_upto.astype(jnp.int32)
  n_items = num_items(m, g, rows) if max_items is None else max_items
  item = jnp.arange(n_items, dtype=jnp.int32)[:, None]  # [I, 1] against [G]
  first = upto - chunks  # the expert's first item
  hit = (first <= item) & (item < upto)  # [I, G]: at most one expert per item
  win = base + (item - first) * rows
  lo = jnp.maximum(starts, win)
  size = jnp.maximum(jnp.minimum(ends, win + rows) - lo, 0)
  fields = (jnp.arange(g, dtype=jnp.int32), win, lo - win, size)
  terms = jnp.stack([jnp.where(hit, jnp.broadcast_to(f, hit.shape), 0) for f in fields])
  return jnp.sum(terms, axis=2, dtype=jnp.int32)
