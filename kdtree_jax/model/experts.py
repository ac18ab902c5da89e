"""The routed-expert FFN over the (token, slot) pairs routed to a range of experts (dropless)."""

import jax
import jax.numpy as jnp

from kdtree_jax.model.grouped_matmul import gated_grouped_matmul, grouped_matmul


def expert_ffn(x_td, idx_tk, w_tk, gate_edf, up_edf, down_efd, e0=0, impl="auto"):
  """Experts [e0, e0 + E_l) on the (token, slot) pairs routed to them, dropless -> [T, D] f32.

  Pairs are sorted by expert (pairs for other experts go last and contribute 0), run through
  the gated grouped matmul (gate and up in one call, SiLU-multiply fused) and the down grouped
  matmul, weighted, and scatter-added back to their tokens.
  """
  t, k = idx_tk.shape
  e_l = gate_edf.shape[0]
  local = idx_tk.reshape(-1) - e0
  mine = (local >= 0) & (local < e_l)
  key = jnp.where(mine, local, e_l)
  order = jnp.argsort(key, stable=True)
  token_of = order // k
  sizes = jnp.bincount(key, length=e_l + 1)[:e_l].astype(jnp.int32)
  xs = x_td[token_of]
  h = gated_grouped_matmul(xs, gate_edf, up_edf, sizes, impl)
  y = grouped_matmul(h, down_efd, sizes, impl).astype(jnp.float32)
  y = jnp.where(mine[order][:, None], y * w_tk.reshape(-1)[order][:, None], 0.0)
  return jnp.zeros((t, x_td.shape[-1]), jnp.float32).at[token_of].add(y)
