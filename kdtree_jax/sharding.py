"""Meshes and sharding rules: the one place that maps logical axes to mesh axes.

Mesh axes: `data` (batch rows), `expert` (routed experts), `tensor` (heads, ffn width, vocab).
Outside the routed experts, `expert` and `tensor` together form the model-parallel group MODEL:
decode batches are too small for the expert axis to serve as data parallelism, and K2.6's
attention, dense MLPs, embedding and head would otherwise be replicated on every expert shard.

Every parameter, cache and decode-state array gets logical axes by its path (PARAM_AXES,
CACHE_AXES, STATE_AXES); RULES turns those into a PartitionSpec for a mesh. A mesh axis that
does not divide a dimension is dropped for that dimension (tests check that no K2.6 parameter
over 1 MB ends up replicated).
"""

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

AXES = ("data", "expert", "tensor")
MODEL = ("expert", "tensor")

# logical axis -> mesh axes (None: replicated).
RULES = {
    "batch": ("data",),
    "vocab": MODEL,          # vocab-parallel embedding and lm_head
    "heads": MODEL,          # tensor-parallel attention (target MLA and draft q / o)
    "kv_heads": MODEL,       # draft k / v projections and draft cache
    "mlp": MODEL,            # dense MLP, shared experts, draft MLP: F split
    "embed_in": MODEL,       # D contracted by the draft fc (row-parallel; 617 MB at K2.6 with
                             # 6 taps: kept sharded, its psum runs once per step, not per layer)
    "route": None,           # router columns and bias: replicated, top-k on local logits
    "experts": ("expert",),  # routed experts (expert-parallel MoE, moe_parallel.py)
    "expert_mlp": ("tensor",),
    "embed": None, "norm": None, "head_dim": None, "q_lora": None, "kv_lora": None,
    "layers": None, "cache_len": None, "taps": None, "out": None,
}

# Parameters allowed to stay replicated over MODEL although larger than 1 MB, with the reason.
# Each one sharded would cost a collective per target layer in decode (at batch 1 one small
# all-reduce is ~15-25 us on H200s, 61 layers of them ~1-1.5 ms per step); replicated they cost
# HBM bytes (K2.6, bf16, per layer: q_a 22 MB, kv_a 8.3 MB, router 5.5 MB; 2.2 GB over the
# model, 1.9 GB per GPU more than 8-way sharded). (Replication over `data` is data parallelism.)
REPLICATED_OK: dict[str, str] = {
    "layers/attn/q_a": "row-parallel q_a would all-reduce its [T, Rq] output every layer",
    "layers/attn/kv_a": "row-parallel kv_a would all-reduce its [T, R + P] output every layer",
    "layers/moe/router": "sharded router columns would all-gather the logits before top-k",
}

_ATTN = {"q": ("embed", "heads", "head_dim"), "q_a": ("embed", "q_lora"),
         "q_a_norm": ("q_lora",), "q_b": ("q_lora", "heads", "head_dim"),
         "kv_a": ("embed", "kv_lora"), "kv_a_norm": ("kv_lora",),
         "kv_b": ("kv_lora", "heads", "head_dim"), "o": ("heads", "head_dim", "embed")}
_MLP = {"gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed")}
_DRAFT_LAYER = {"q_proj": ("embed", "heads"), "k_proj": ("embed", "kv_heads"),
                "v_proj": ("embed", "kv_heads"), "o_proj": ("heads", "embed"),
                "q_norm": ("head_dim",), "k_norm": ("head_dim",), "input_layernorm": ("norm",),
                "post_attention_layernorm": ("norm",), "gate_proj": ("embed", "mlp"),
                "up_proj": ("embed", "mlp"), "down_proj": ("mlp", "embed")}

# Parameter path (ints dropped, "/"-joined) -> logical axes. Target: target/params.py; draft:
# draft/model.py (a list of per-layer dicts, like the target's layers).
PARAM_AXES = {
    "embed": ("vocab", "embed"), "lm_head": ("embed", "vocab"), "final_norm": ("norm",),
    "layers/attn_norm": ("norm",), "layers/mlp_norm": ("norm",),
    **{f"layers/attn/{k}": v for k, v in _ATTN.items()},
    **{f"layers/mlp/{k}": v for k, v in _MLP.items()},
    **{f"layers/moe/shared/{k}": v for k, v in _MLP.items()},
    "layers/moe/router": ("embed", "route"), "layers/moe/bias": ("route",),
    "layers/moe/gate": ("experts", "embed", "expert_mlp"),
    "layers/moe/up": ("experts", "embed", "expert_mlp"),
    "layers/moe/down": ("experts", "expert_mlp", "embed"),
    # INT4 routed experts (checkpoint/int4.py Int4Weight): packed int4 [E, out, in], scale [E, in/Q, out].
    **{f"layers/moe/{m}/packed": ("experts", "expert_mlp", "embed") for m in ("gate", "up")},
    **{f"layers/moe/{m}/scale": ("experts", "embed", "expert_mlp") for m in ("gate", "up")},
    "layers/moe/down/packed": ("experts", "embed", "expert_mlp"),
    "layers/moe/down/scale": ("experts", "expert_mlp", "embed"),
    "fc": ("embed_in", "embed"), "hidden_norm": ("norm",), "norm": ("norm",),
    **{f"layers/{k}": v for k, v in _DRAFT_LAYER.items()},
}

# LatentCache, DraftCache and DecodeState fields -> logical axes.
STATE_AXES = {
    "latent": ("batch", "cache_len", "kv_lora"), "lengths": ("batch",),  # one buffer per layer
    "k": ("batch", "kv_heads", "cache_len", "head_dim"),  # draft cache: one buffer per layer
    "v": ("batch", "kv_heads", "cache_len", "head_dim"),
    "pos": ("batch", "cache_len"), "ctx_len": ("batch",),
    "bonus": ("batch",), "pending_taps": ("batch", "out", "taps"), "pending_count": ("batch",),
    "out": ("batch", "out"), "n_out": ("batch",), "done": ("batch",), "key": (), "steps": (),
    "capacity": (),
    "accepted": ("out", "batch"),
}


# ---- meshes ---------------------------------------------------------------------------------
def parse_mesh(spec: str) -> dict[str, int]:
  """'tensor=2,expert=4' -> {'data': 1, 'expert': 4, 'tensor': 2} (unspecified axes are 1)."""
  sizes = dict.fromkeys(AXES, 1)
  seen = set()
  for part in filter(None, (s.strip() for s in spec.split(","))):
    name, eq, value = part.partition("=")
    name = name.strip()
    if not eq or name not in AXES:
      raise ValueError(f"bad mesh entry {part!r} in {spec!r}: expected AXIS=N with AXIS in {AXES}")
    if name in seen:
      raise ValueError(f"mesh axis {name!r} given twice in {spec!r}")
    if not value.strip().isdigit() or int(value) < 1:
      raise ValueError(f"mesh axis {name!r} needs a positive integer size, got {value!r} "
                       f"in {spec!r}")
    seen.add(name)
    sizes[name] = int(value)
  if not seen:
    raise ValueError(f"empty mesh spec {spec!r}: expected e.g. 'tensor=8' or 'tensor=2,expert=4'")
  return sizes


def make_mesh(spec: str, devices=None) -> jax.sharding.Mesh:
  """A ("data", "expert", "tensor") mesh from 'AXIS=N,...' over all (or the given) devices."""
  sizes = parse_mesh(spec)
  devices = list(jax.devices() if devices is None else devices)
  n = math.prod(sizes.values())
  if n != len(devices):
    raise ValueError(f"mesh {spec!r} has {n} devices ({sizes}) but {len(devices)} devices are "
                     "available; the product of the axis sizes must equal the device count")
  shape = tuple(sizes[a] for a in AXES)
  return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES),
                       devices=devices)


def abstract_mesh(spec: str) -> jax.sharding.AbstractMesh:
  """The mesh's shape only (no devices): for planning memory on any machine."""
  sizes = parse_mesh(spec)
  return jax.sharding.AbstractMesh(tuple(sizes[a] for a in AXES), AXES,
                                   axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def use_mesh(mesh):
  """Context in which the model code sees `mesh` (a no-op context for None)."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def current_mesh():
  """The abstract mesh of the enclosing `use_mesh`, or None (single-device code paths)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(AXES) <= set(mesh.axis_names):
    return None
  return mesh


# ---- logical axes -> PartitionSpec ----------------------------------------------------------
def spec(logical: tuple, shape: tuple[int, ...], mesh) -> PartitionSpec:
  """PartitionSpec for logical axes; mesh axes that do not divide a dim are dropped."""
  if len(logical) != len(shape):
    raise ValueError(f"logical axes {logical} do not match shape {shape}")
  sizes, used, out = dict(mesh.shape), set(), []
  for name, dim in zip(logical, shape):
    axes = [a for a in (RULES[name] or ()) if a in sizes and a not in used]
    while axes and dim % math.prod(sizes[a] for a in axes):
      axes.pop()
    used.update(axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return PartitionSpec(*out)


def path_key(path) -> str:
  """A pytree key path (or tuple of keys) as a table key: ints dropped, names '/'-joined."""
  parts = []
  for k in path:
    k = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
    if not isinstance(k, int):
      parts.append(str(k))
  return "/".join(parts)


def param_axes(path) -> tuple:
  """Logical axes of the parameter at `path` (target or draft)."""
  key = path_key(path)
  if key not in PARAM_AXES:
    raise KeyError(f"no sharding rule for parameter {key!r}; add it to sharding.PARAM_AXES")
  return PARAM_AXES[key]


def state_axes(path, ndim) -> tuple:
  """Logical axes of a cache / decode-state field (by its name, the last path entry)."""
  key = path_key(path).split("/")[-1]
  if key not in STATE_AXES:
    raise KeyError(f"no sharding rule for state field {key!r}; add it to sharding.STATE_AXES")
  return STATE_AXES[key] if key != "key" else (None,) * ndim


def _tree_shardings(tree, mesh, axes_fn):
  def one(path, x):
    return NamedSharding(mesh, spec(axes_fn(path, x.ndim), x.shape, mesh))
  return jax.tree.map_with_path(one, tree)


def param_shardings(params, mesh):
  """NamedShardings for a target or draft params pytree (arrays or ShapeDtypeStructs)."""
  return _tree_shardings(params, mesh, lambda p, _: param_axes(p))


def state_shardings(tree, mesh):
  """NamedShardings for a LatentCache, DraftCache or DecodeState (or any of their fields)."""
  return _tree_shardings(tree, mesh, state_axes)


def shard(tree, shardings):
  """device_put a pytree onto its shardings (a no-op for arrays already placed so)."""
  return jax.device_put(tree, shardings)


def constrain_state(state):
  """Pins a traced cache / decode state to the rules under `use_mesh` (identity otherwise)."""
  mesh = current_mesh()
  if mesh is None:
    return state
  return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh))


# ---- creating params directly sharded -------------------------------------------------------
def init_sharded(init_fn, mesh, *args):
  """Runs `init_fn(*args)` under jit with the rules' out_shardings: born sharded, never whole."""
  shapes = jax.eval_shape(init_fn, *args)
  return jax.jit(init_fn, out_shardings=param_shardings(shapes, mesh))(*args)


def loader_put(mesh, dtype):
  """A `put(path, np_array)` for `load_hf_checkpoint`: each host places only its shards."""
  def put(path, w):
    if path[-1] not in ("packed", "scale"):  # INT4 leaves keep their storage dtype
      w = np.asarray(w, np.float32 if path[-1] == "bias" else jnp.dtype(dtype))
    sh = NamedSharding(mesh, spec(param_axes(path), w.shape, mesh))
    return jax.make_array_from_callback(w.shape, sh, lambda idx: w[idx])
  return put


def to_host(tree):
  """jax.device_get, gathering from every process first when running multi-host."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_get(tree)


# ---- multi-host -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Distributed:
  """This process's place in a multi-process run: the coordinator's 'host:port', the number of
  processes and this one's rank (scripts read it from the launcher: cli.distributed_from_env)."""

  coordinator: str | None = None
  num_processes: int = 1
  process_id: int | None = None


def initialize_distributed(d: Distributed) -> bool:
  """jax.distributed.initialize() for a run of several processes; returns whether it ran."""
  if not d.coordinator or d.num_processes <= 1 or jax.distributed.is_initialized():
    return False
  if d.process_id is None or not 0 <= d.process_id < d.num_processes:
    raise ValueError(f"a run of {d.num_processes} processes (coordinator {d.coordinator}) needs "
                     f"this process's rank in [0, {d.num_processes}), got {d.process_id}")
  jax.distributed.initialize(d.coordinator, num_processes=d.num_processes,
                             process_id=d.process_id)
  return True
