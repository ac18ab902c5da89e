"""Expert-parallel routed experts (shard_map): every shard sees all tokens, runs its own experts.

For the few tokens of a verify step: tokens, expert ids and weights are replicated over the
model axes; shard s holds experts [s * E_l, (s + 1) * E_l) (and an F slice under `tensor`).
It sorts the (token, slot) pairs routed to its experts first, runs a dropless grouped matmul over
them, and gathers each token's K weighted rows into [T, D] (other shards' pairs count 0); a psum
over the mesh axes that actually split the experts (those the partial sums vary over) adds the
shards. Same math as `moe.routed_experts` (summation order aside).

The shared expert (F split over the model axes by the rules) is a partial sum too: when its
F split spans the same mesh axes as the routed experts', `experts_ep` adds its slice inside the
same shard_map, so the whole MoE costs ONE all-reduce, in the activation dtype (bf16 on GPUs).
Routing runs per data shard in a shard_map too (`route_local`), so it costs no collective.
Future work: long prefills would rather send tokens to their experts (ragged all-to-all).
Letters: T tokens, K experts per token, D hidden, E_l local experts, F_l local expert width.
"""

import jax
import jax.numpy as jnp

from kdtree_jax import sharding
from kdtree_jax.target.experts import expert_ffn
from kdtree_jax.target.mlp import swiglu

_EXPERT_KEYS = ("gate", "up", "down")
_IS_SPEC = lambda x: isinstance(x, jax.sharding.PartitionSpec)


def _leaf_specs(moe_sub, mesh):
  """PartitionSpecs of a sub-dict of one MoE layer's params (rules by path), leaf by leaf."""
  shardings = sharding.param_shardings({"layers": [{"moe": moe_sub}]}, mesh)["layers"][0]["moe"]
  return jax.tree.map(lambda s: s.spec, shardings)


def _split_axes(specs) -> tuple[str, ...]:
  """Mesh axes that split any leaf (the axes the per-shard partial sums vary over)."""
  axes = set()
  for spec in jax.tree.leaves(specs, is_leaf=_IS_SPEC):
    for entry in spec:
      axes.update(() if entry is None else (entry,) if isinstance(entry, str) else entry)
  return tuple(a for a in sharding.AXES if a in axes)


def _real(axes, mesh) -> set[str]:
  """The axes of `axes` that have more than one device."""
  return {a for a in axes if mesh.shape[a] > 1}


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


def route_local(route_fn, p, x_td, mesh):
  """`route_fn(p, x)` -> (idx, w) on each data shard's own tokens (shard_map; router and bias
  replicated by the rules): GSPMD does not split top_k over rows and would all-gather every
  token's routing scores over `data` (3 all-gathers per MoE layer in decode on data=2)."""
  rp = {k: p[k] for k in ("router", "bias")}
  specs = _leaf_specs(rp, mesh)
  tok_spec = sharding.spec(("batch", "embed"), x_td.shape, mesh)
  if not _real(_split_axes(tok_spec), mesh) or _split_axes(specs):
    return route_fn(rp, x_td)
  out = sharding.spec(("batch", "out"), (x_td.shape[0], 1), mesh)
  # check_vma=False: the routing kernel's interpret mode (router_impl "pallas" off a GPU) pads
  # with an invariant value, which the varying-axes check rejects (as in mla.py).
  return jax.shard_map(route_fn, mesh=mesh, in_specs=(specs, tok_spec), out_specs=(out, out),
                       check_vma=False)(rp, x_td)


def routed_experts_ep(p, x_td, idx_tk, w_tk, mesh, impl="auto"):
  """`moe.routed_experts` with gate/up/down sharded by the rules over `mesh` -> [T, D] f32."""
  return _experts_ep(p, None, x_td, idx_tk, w_tk, mesh, impl, jnp.float32)


def experts_ep(p, x_td, idx_tk, w_tk, mesh, impl="auto"):
  """Routed + shared experts over `mesh` -> [T, D] in x's dtype.

  One psum (in x's dtype) when the shared expert is split over the same mesh axes as the
  routed experts; otherwise the routed psum in f32 plus the shared expert partitioned by GSPMD
  (its own all-reduce), as the single-device `moe` adds them.
  """
  shared = p.get("shared")
  if shared is not None and _folds(p, shared, mesh):
    return _experts_ep(p, shared, x_td, idx_tk, w_tk, mesh, impl, x_td.dtype)
  y = routed_experts_ep(p, x_td, idx_tk, w_tk, mesh, impl)
  if shared is not None:
    y = y + swiglu(shared, x_td).astype(jnp.float32)
  return y.astype(x_td.dtype)


def _folds(p, shared, mesh) -> bool:
  """Whether the shared expert's partial sums vary over exactly the routed experts' axes."""
  routed = _real(_split_axes(_leaf_specs({k: p[k] for k in _EXPERT_KEYS}, mesh)), mesh)
  return bool(routed) and routed == _real(_split_axes(_leaf_specs({"shared": shared}, mesh)), mesh)


def _experts_ep(p, shared, x_td, idx_tk, w_tk, mesh, impl, out_dtype):
  """Routed experts (+ the shared expert's F slice when given) per shard, one psum -> [T, D]."""
  specs = _leaf_specs({k: p[k] for k in _EXPERT_KEYS}, mesh)
  split = _split_axes(specs)
  if not split:
    return expert_ffn(x_td, idx_tk, w_tk, p["gate"], p["up"], p["down"], 0, impl=impl)
  extra = () if shared is None else (shared,)
  extra_specs = () if shared is None else (_leaf_specs({"shared": shared}, mesh)["shared"],)
  axes = _split_axes((specs, extra_specs))
  e_axes = _expert_axes(jax.tree.leaves(specs["gate"], is_leaf=_IS_SPEC)[0][0])
  tok_spec = sharding.spec(("batch", "embed"), x_td.shape, mesh)
  pair_spec = sharding.spec(("batch", "out"), idx_tk.shape, mesh)

  def body(x, idx, w, gate, up, down, *shared_local):
    e0 = _shard_index(e_axes, mesh) * gate.shape[0]
    y = expert_ffn(x, idx, w, gate, up, down, e0, impl=impl)
    for sp in shared_local:
      y = y + swiglu(sp, x).astype(jnp.float32)
    return jax.lax.psum(_varying(y.astype(out_dtype), axes), axes)

  fn = jax.shard_map(body, mesh=mesh,
                     in_specs=(tok_spec, pair_spec, pair_spec, specs["gate"], specs["up"],
                               specs["down"], *extra_specs),
                     out_specs=tok_spec)
  return fn(x_td, idx_tk, w_tk, p["gate"], p["up"], p["down"], *extra)
