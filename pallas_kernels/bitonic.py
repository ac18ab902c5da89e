"""Bitonic compare-exchange networks over tuples of 1D arrays, in Pallas Triton's vocabulary
(reshape, split, stack, transpose, where): no gathers, no dynamic indexing.

An entry is the tuple's values at one position; `before(a, b)` (tuples of arrays) says which
entries come first. It must be a strict total order (e.g. ending in a unique index), so a network
gives exactly the order a stable sort by the same keys gives. Work is O(L log^2 P) compare-exchanges
for the best P of L entries, where rank counting compares all L^2 pairs.

Used by pallas_kernels.ddtree_build: each DDTree level's best np of Cp candidates
(`top_sorted`) and the running best np of all levels' survivors (`merge_best`).
"""

import jax.numpy as jnp


def log2(x: int) -> int:
  """log2 of a power of two (checked)."""
  if x < 1 or x & (x - 1):
    raise ValueError(f"{x} is not a power of two")
  return x.bit_length() - 1


def _halves(x, h):
  """x [L] -> (a, b) [L/(2h), h]: a = the first h of each 2h block, b = its partner h later."""
  a, b = jnp.split(x.reshape(x.shape[0] // (2 * h), 2, h), 2, axis=1)
  return a.reshape(a.shape[0], h), b.reshape(b.shape[0], h)


def _interleave(a, b):
  """Inverse of `_halves`: [A, h] x 2 -> [2 A h] (block-major: a's block, then b's)."""
  pair = jnp.stack([a, b], axis=-1)                      # [A, h, 2]
  return jnp.transpose(pair, (0, 2, 1)).reshape(-1)


def _block_flag(blocks, h, bit):
  """[A, 1] bool: bit `bit` of the position of each 2h block's first entry (the direction bit:
  positions i and i + h share every bit above log2(h))."""
  start = jnp.arange(blocks, dtype=jnp.int32)[:, None] * (2 * h)
  return ((start >> bit) & 1) == 1


def exchange(xs, before, h, desc_bit):
  """One compare-exchange stage at distance h: in each 2h block, entry i and i + h swap unless in
  the block's direction (ascending: `before` order; descending where bit `desc_bit` of the
  position is 1; desc_bit=None: all ascending, True: all descending)."""
  halves = [_halves(x, h) for x in xs]
  a, b = [p[0] for p in halves], [p[1] for p in halves]
  blocks = halves[0][0].shape[0]
  if desc_bit is None or desc_bit is True:
    desc = jnp.full((blocks, 1), desc_bit is True)
  else:
    desc = _block_flag(blocks, h, desc_bit)
  a_first = before(a, b) != desc
  return tuple(_interleave(jnp.where(a_first, u, v), jnp.where(a_first, v, u))
               for u, v in zip(a, b))


def better_half(xs, before, h):
  """In each 2h block (an ascending h then a descending h), the better of entries i and i + h:
  the block's best h entries as one bitonic sequence, L/2 entries in all."""
  halves = [_halves(x, h) for x in xs]
  a, b = [p[0] for p in halves], [p[1] for p in halves]
  a_first = before(a, b)
  return tuple(jnp.where(a_first, u, v).reshape(-1) for u, v in zip(a, b))


def merge(xs, before, size, desc_bit):
  """Sorts each bitonic block of `size` entries (directions as in `exchange`)."""
  h = size // 2
  while h >= 1:
    xs = exchange(xs, before, h, desc_bit)
    h //= 2
  return xs


def sort_blocks(xs, before, size):
  """Sorts every block of `size` entries, block b ascending for even b, descending for odd b
  (the bitonic sort's phases up to `size`)."""
  span = 2
  while span <= size:
    xs = merge(xs, before, span, log2(span))
    span *= 2
  return xs


def top_sorted(xs, before, p):
  """The best p entries of xs (length L, a power of two >= p), ascending in `before` order."""
  n = xs[0].shape[0]
  xs = sort_blocks(xs, before, p)
  while n > p:
    xs = better_half(xs, before, p)
    n //= 2
    xs = merge(xs, before, p, log2(p) if n > p else None)
  return xs


def merge_best(acc_desc, new_asc, before):
  """The best P of two sorted lists of P entries (acc descending, new ascending), descending:
  their elementwise better entries form a bitonic sequence holding exactly the best P."""
  new_first = before(new_asc, acc_desc)
  best = tuple(jnp.where(new_first, u, v) for u, v in zip(new_asc, acc_desc))
  if best[0].shape[0] == 1:
    return best
  return merge(best, before, best[0].shape[0], True)
