"""The routed-expert FFN over the (token, slot) pairs routed to a range of experts (dropless)."""

import jax
import jax.numpy as jnp

from kdtree_jax.target.grouped_matmul import gated_grouped_matmul, grouped_matmul


def expert_ffn(x_td, idx_tk, w_tk, gate_edf, up_edf, down_efd, e0=0, impl="auto"):
  """Experts [e0, e0 + E_l) on the (token, slot) pairs routed to them, dropless -> [T, D] f32.

  Pairs are sorted by expert (pairs for other experts go last and contribute 0), run through
  the gated grouped matmul (gate and up in one call, SiLU-multiply fused) and the down grouped
  matmul, weighted, and scatter-added back to their tokens.
  """
  order, sizes, mine = sort_pairs(idx_tk, gate_edf.shape[0], e0)
  token_of = order // idx_tk.shape[1]
  h = gated_grouped_matmul(x_td[token_of], gate_edf, up_edf, sizes, impl)
  y = grouped_matmul(h, down_efd, sizes, impl).astype(jnp.float32)
  return combine_pairs(y, order, mine, w_tk, x_td.shape[0])


def sort_pairs(idx_tk, e_l, e0=0):
  """(token, slot) pairs sorted by local expert, the others last: (order [T*K], rows per local
  expert [E_l], whether each pair is local [T*K])."""
  local = idx_tk.reshape(-1) - e0
  mine = (local >= 0) & (local < e_l)
  key = jnp.where(mine, local, e_l)
  order = jnp.argsort(key, stable=True)
  return order, jnp.bincount(key, length=e_l + 1)[:e_l].astype(jnp.int32), mine


def combine_pairs(y_md, order, mine, w_tk, t):
  """Sorted pair outputs [T*K, D] weighted by their routing weights, summed per token -> [T, D]."""
  y = jnp.where(mine[order][:, None], y_md * w_tk.reshape(-1)[order][:, None], 0.0)
  return jnp.zeros((t, y_md.shape[-1]), jnp.float32).at[order // w_tk.shape[1]].add(y)
