"""Expert-parallel routed experts (shard_map): every shard sees all tokens, runs its own experts.

For the few tokens of a verify step: tokens, expert ids and weights are replicated over the
model axes; shard s holds experts [s * E_l, (s + 1) * E_l) (and an F slice under `tensor`).
It sorts the (token, slot) pairs routed to its experts first, runs a dropless ragged_dot over
them, zeroes the rest, scatter-adds into [T, D], and a psum over the expert and tensor axes
sums the shards. Same math as `moe.routed_experts` (summation order aside).
Future work: long prefills would rather send tokens to their experts (ragged all-to-all).
Letters: T tokens, K experts per token, D hidden, E_l local experts, F_l local expert width.
"""

import math

import jax

from kdtree_jax import sharding
from kdtree_jax.model.experts import expert_ffn


def _axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _shard_index(axes, mesh):
  """Linear index of this shard over `axes` (major to minor), 0 when unsplit."""
  idx = 0
  for a in axes:
    idx = idx * mesh.shape[a] + jax.lax.axis_index(a)
  return idx


def routed_experts_ep(p, x_td, idx_tk, w_tk, mesh):
  """`moe.routed_experts` with gate/up/down sharded by the rules over `mesh` -> [T, D] f32."""
  in_spec = sharding.spec(sharding.PARAM_AXES["layers/moe/gate"], p["gate"].shape, mesh)
  down_spec = sharding.spec(sharding.PARAM_AXES["layers/moe/down"], p["down"].shape, mesh)
  tok_spec = sharding.spec(("batch", "embed"), x_td.shape, mesh)
  e_axes, f_axes = _axes(in_spec[0]), _axes(in_spec[2])

  def body(x, idx, w, gate, up, down):
    e0 = _shard_index(e_axes, mesh) * gate.shape[0]
    y = expert_ffn(x, idx, w, gate, up, down, e0)
    return jax.lax.psum(y, e_axes + f_axes) if e_axes + f_axes else y

  if math.prod(mesh.shape[a] for a in e_axes + f_axes) == 1:
    return expert_ffn(x_td, idx_tk, w_tk, p["gate"], p["up"], p["down"], 0)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(tok_spec,) * 3 + (in_spec, in_spec, down_spec),
                     out_specs=tok_spec)
  return fn(x_td, idx_tk, w_tk, p["gate"], p["up"], p["down"])
