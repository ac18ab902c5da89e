"""The routed-expert FFN over the (token, slot) pairs routed to a range of experts (dropless)."""

import jax.numpy as jnp

from kdtree_jax.target.grouped_matmul import expert_mlp

# Up to this many (token, slot) pairs their expert order comes from comparisons ([M, M], a few
# fused reductions on a GPU) instead of a sort kernel (~6 us for any size on an H200).
COMPARE_SORT_MAX_PAIRS = 2048


def expert_ffn(x_td, idx_tk, w_tk, gate_edf, up_edf, down_efd, e0=0, impl="auto"):
  """Experts [e0, e0 + E_l) on the (token, slot) pairs routed to them, dropless -> [T, D] f32.

  Pairs are sorted by expert (pairs for other experts go last and contribute 0), run through
  the gated grouped matmul (gate and up in one call, SiLU-multiply fused) and the down grouped
  matmul on one work list, then each token gathers its K rows, weighted (one fusion, no scatter).
  """
  order, rank, sizes, mine = sort_pairs(idx_tk, gate_edf.shape[0], e0)
  y = expert_mlp(x_td[order // idx_tk.shape[1]], gate_edf, up_edf, down_efd, sizes, impl,
                 group_ends=group_ends(idx_tk, gate_edf.shape[0], e0))
  return combine_pairs(y, rank, mine, w_tk)


def group_ends(idx_tk, e_l, e0=0):
  """cumsum of the rows per local expert, counted from the expert ids as the sizes are (a
  reduction beside theirs, not one after them)."""
  local = idx_tk.reshape(-1) - e0
  return jnp.sum((local[None, :] >= 0) & (local[None, :] <= jnp.arange(e_l)[:, None]), axis=1,
                 dtype=jnp.int32)


def sort_pairs(idx_tk, e_l, e0=0):
  """(token, slot) pairs sorted by local expert (stable), the others last.

  Returns (order [M]: the pair at each sorted row, rank [M]: each pair's sorted row, rows per
  local expert [E_l], whether each pair is local [M]), M = T*K.
  """
  local = idx_tk.reshape(-1) - e0
  mine = (local >= 0) & (local < e_l)
  key = jnp.where(mine, local, e_l).astype(jnp.int32)
  m = key.shape[0]
  pair = jnp.arange(m, dtype=jnp.int32)
  sizes = jnp.sum(key[None, :] == jnp.arange(e_l, dtype=jnp.int32)[:, None], axis=1,
                  dtype=jnp.int32)
  if m > COMPARE_SORT_MAX_PAIRS:
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    return order, jnp.argsort(order).astype(jnp.int32), sizes, mine
  code = key * m + pair  # distinct; ascending code = stable order by key
  rank = jnp.sum(code[None, :] < code[:, None], axis=1, dtype=jnp.int32)
  order = jnp.sum(jnp.where(rank[None, :] == pair[:, None], pair[None, :], 0), axis=1,
                  dtype=jnp.int32)
  return order, rank, sizes, mine


def combine_pairs(y_smd, rank, mine, w_tk):
  """Sorted pair outputs as K-partials [S, T*K, D] -> [T, D] f32: per token, the sum over its K
  local pairs (and the S partials) of weight x row. Non-local pairs' rows are undefined: masked."""
  t, k = w_tk.shape
  rows = y_smd[:, rank.reshape(t, k)]  # [S, T, K, D]
  keep = mine.reshape(1, t, k, 1)
  weighted = jnp.where(keep, rows * w_tk.astype(jnp.float32)[None, :, :, None], 0.0)
  return jnp.sum(weighted, axis=(0, 2))
