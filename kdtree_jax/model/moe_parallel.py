"""Expert-parallel routed experts (shard_map): every shard sees all tokens, runs its own experts.

For the few tokens of a verify step: tokens, expert ids and weights are replicated over the
model axes; shard s holds experts [s * E_l, (s + 1) * E_l) (and an F slice under `tensor`).
It sorts the (token, slot) pairs routed to its experts first, runs a dropless grouped matmul over
them, zeroes the rest, scatter-adds into [T, D], and a psum over the mesh axes that actually
split the experts (those the partial sums vary over) adds the shards. Same math as
`moe.routed_experts` (summation order aside).
Future work: long prefills would rather send tokens to their experts (ragged all-to-all).
Letters: T tokens, K experts per token, D hidden, E_l local experts, F_l local expert width.
"""

import jax

from kdtree_jax import sharding
from kdtree_jax.model.experts import expert_ffn

_EXPERT_KEYS = ("gate", "up", "down")


def _leaf_specs(p, mesh):
  """PartitionSpecs of the gate / up / down stacks, leaf by leaf (INT4 leaves differ in order)."""
  sub = {k: p[k] for k in _EXPERT_KEYS}
  shardings = sharding.param_shardings({"layers": [{"moe": sub}]}, mesh)["layers"][0]["moe"]
  return jax.tree.map(lambda s: s.spec, shardings)


def _split_axes(specs) -> tuple[str, ...]:
  """Mesh axes that split any expert leaf (the axes the per-shard partial sums vary over)."""
  axes = []
  for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)):
    for entry in spec:
      for a in () if entry is None else (entry,) if isinstance(entry, str) else entry:
        if a not in axes:
          axes.append(a)
  return tuple(a for a in sharding.AXES if a in axes)


def _expert_axes(spec_e) -> tuple[str, ...]:
  return () if spec_e is None else (spec_e,) if isinstance(spec_e, str) else tuple(spec_e)


def _shard_index(axes, mesh):
  """Linear index of this shard over `axes` (major to minor), 0 when unsplit."""
  idx = 0
  for a in axes:
    idx = idx * mesh.shape[a] + jax.lax.axis_index(a)
  return idx


def _varying(y, axes):
  """y marked as varying over `axes`: a Pallas call's output can lose the varying axes of its
  weight operands under shard_map (seen on 2 H200s: psum over `tensor` rejected), yet each
  shard's partial sum does differ over every axis that splits the experts."""
  missing = tuple(a for a in axes if a not in jax.typeof(y).mat.varying)
  return jax.lax.pcast(y, missing, to="varying") if missing else y


def routed_experts_ep(p, x_td, idx_tk, w_tk, mesh, impl="auto"):
  """`moe.routed_experts` with gate/up/down sharded by the rules over `mesh` -> [T, D] f32."""
  specs = _leaf_specs(p, mesh)
  split = _split_axes(specs)
  if not split:
    return expert_ffn(x_td, idx_tk, w_tk, p["gate"], p["up"], p["down"], 0, impl=impl)
  first = jax.tree.leaves(specs["gate"], is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
  e_axes = _expert_axes(first[0])
  tok_spec = sharding.spec(("batch", "embed"), x_td.shape, mesh)
  pair_spec = sharding.spec(("batch", "out"), idx_tk.shape, mesh)

  def body(x, idx, w, gate, up, down):
    e0 = _shard_index(e_axes, mesh) * gate.shape[0]
    y = expert_ffn(x, idx, w, gate, up, down, e0, impl=impl)
    return jax.lax.psum(_varying(y, split), split)

  fn = jax.shard_map(body, mesh=mesh,
                     in_specs=(tok_spec, pair_spec, pair_spec, specs["gate"], specs["up"],
                               specs["down"]),
                     out_specs=tok_spec)
  return fn(x_td, idx_tk, w_tk, p["gate"], p["up"], p["down"])
