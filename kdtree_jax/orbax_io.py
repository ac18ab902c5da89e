"""Params pytrees as orbax checkpoints, with their TargetConfig or DraftConfig; restored straight
onto a mesh.

A directory written by `save_params`:
  kdtree_jax_orbax.json   marker: format version, kind (target | draft | params), HF config dict
  params/                 the orbax (StandardCheckpointHandler) checkpoint of the params
  (any extra files, e.g. the tokenizer's tiktoken.model / tokenizer_config.json)
Everything is written into `<path>.partial` and renamed into place last, so an interrupted save
never leaves a directory at `path`; the marker is written last inside it. `restore_params`
builds an abstract target of `jax.ShapeDtypeStruct`s with the sharding rules' shardings, so
each device reads only its own shards (nothing is ever whole on one device).
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from kdtree_jax.target import config as model_config
from kdtree_jax import sharding
from kdtree_jax.cli import DataError
from kdtree_jax.draft.config import DraftConfig
from kdtree_jax.checkpoint.int4 import Int4Weight

MARKER = "kdtree_jax_orbax.json"
FORMAT = "kdtree_jax_orbax"
VERSION = 1
PARAMS_DIR = "params"
KEEP_DTYPE = ("bias", "packed", "scale")  # leaves whose dtype `restore_params(dtype=)` keeps


def is_orbax_dir(path: str) -> bool:
  """Whether `path` is a complete directory written by `save_params`."""
  return os.path.isfile(os.path.join(path, MARKER))


def read_marker(path: str) -> dict:
  """The marker of a `save_params` directory (clear errors for foreign or incomplete dirs)."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f"orbax checkpoint {path!r} does not exist")
  if not is_orbax_dir(path):
    hint = (" (an interrupted save leaves only '<dir>.partial'; delete it and convert again)"
            if path.endswith(".partial") else "")
    raise ValueError(f"{path!r} is not a complete kdtree_jax orbax checkpoint: no {MARKER}{hint}; "
                     "write one with scripts/convert_checkpoint.py")
  try:
    with open(os.path.join(path, MARKER)) as f:
      meta = json.load(f)
  except json.JSONDecodeError as e:
    raise DataError(os.path.join(path, MARKER), f"corrupt marker ({e}); convert the checkpoint "
                    "again with scripts/convert_checkpoint.py") from e
  if meta.get("format") != FORMAT or meta.get("version") != VERSION:
    raise ValueError(f"{path}/{MARKER}: unsupported format {meta.get('format')!r} version "
                     f"{meta.get('version')!r}; this code reads {FORMAT!r} version {VERSION}")
  return meta


def summary(params) -> dict:
  """Parameter count (INT4 unpacked), bytes, and {storage dtype: number of values}."""
  count, nbytes, hist = 0, 0, {}
  for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Int4Weight)):
    count += int(np.prod(leaf.shape))
    if isinstance(leaf, Int4Weight):
      parts = [("int4", leaf.packed.size, leaf.packed), (None, leaf.scale.size, leaf.scale)]
    else:
      parts = [(None, leaf.size, leaf)]
    for name, n, a in parts:
      nbytes += int(a.size) * jax.dtypes.itemsize_bits(a.dtype) // 8  # int4: two per byte
      name = name or str(jnp.dtype(a.dtype))
      hist[name] = hist.get(name, 0) + int(n)
  return {"num_params": count, "bytes": nbytes, "dtypes": hist}


def _kind(config, draft_config):
  if config is not None and draft_config is not None:
    raise ValueError("pass config= (a target) or draft_config= (a draft), not both")
  if config is not None:
    return "target", model_config.to_hf_dict(config)
  if draft_config is not None:
    return "draft", draft_config.to_hf_dict()
  return "params", None


def _barrier(name: str):
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(name)


def _write_marker(tmp: str, meta: dict):
  with open(os.path.join(tmp, MARKER), "w") as f:
    json.dump(meta, f, indent=1)


def _commit(tmp: str, path: str):
  """Moves the finished `tmp` to `path` (replacing an older checkpoint there)."""
  old = path.rstrip("/") + ".old"
  shutil.rmtree(old, ignore_errors=True)
  if os.path.exists(path):
    os.replace(path, old)
  os.replace(tmp, path)
  shutil.rmtree(old, ignore_errors=True)


def save_params(path: str, params, *, config=None, draft_config=None, extra_files=()):
  """Writes params (+ the TargetConfig or DraftConfig, + extra files) to `path`, atomically.

  An existing checkpoint at `path` is replaced only once the new one is complete.
  """
  kind, hf = _kind(config, draft_config)
  path = os.path.abspath(path)
  tmp = path.rstrip("/") + ".partial"
  primary = jax.process_index() == 0
  if primary:
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
  _barrier("kdtree_orbax_save_start")
  try:
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckpt:
      ckpt.save(os.path.join(tmp, PARAMS_DIR), args=ocp.args.StandardSave(params))
    _barrier("kdtree_orbax_saved")
    if primary:
      for src in extra_files:
        shutil.copy2(src, os.path.join(tmp, os.path.basename(src)))
      meta = {"format": FORMAT, "version": VERSION, "kind": kind, "config": hf, **summary(params)}
      _write_marker(tmp, meta)
      _commit(tmp, path)
  except BaseException:
    if primary:
      shutil.rmtree(tmp, ignore_errors=True)
    raise
  _barrier("kdtree_orbax_committed")
  return path


def _is_int4(node) -> bool:
  return isinstance(node, dict) and set(node) == {"packed", "scale"}


def _to_structs(node, dtype):
  """Orbax metadata tree -> ShapeDtypeStruct tree (INT4 pairs back to Int4Weight)."""
  if _is_int4(node):
    return Int4Weight(*(_to_structs(node[k], None) for k in ("packed", "scale")))
  if isinstance(node, dict):
    return {k: _to_structs(v, None if k in KEEP_DTYPE else dtype) for k, v in node.items()}
  if isinstance(node, (list, tuple)):
    return type(node)(_to_structs(v, dtype) for v in node)
  saved = jnp.dtype(node.dtype)
  cast = dtype is not None and jnp.issubdtype(saved, jnp.floating)
  return jax.ShapeDtypeStruct(tuple(node.shape), jnp.dtype(dtype) if cast else saved)


def abstract_params(path: str, mesh=None, dtype=None):
  """ShapeDtypeStructs of the saved params, each with the rules' sharding on `mesh`."""
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckpt:
    tree = ckpt.metadata(os.path.join(path, PARAMS_DIR)).item_metadata.tree
  structs = _to_structs(tree, dtype)
  if mesh is None:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, structs)
  else:
    shardings = sharding.param_shardings(structs, mesh)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      structs, shardings)


def _config(meta: dict):
  if meta["kind"] == "target":
    return model_config.config_from_hf_dict(meta["config"])
  if meta["kind"] == "draft":
    return DraftConfig.from_hf_dict(meta["config"])
  return None


def restore_params(path: str, *, mesh=None, dtype=None):
  """(config, params) from a `save_params` directory, placed by the sharding rules on `mesh`.

  config: TargetConfig (target), DraftConfig (draft) or None. dtype: cast floating weights to
  it (the routing bias and INT4 packed/scale keep their saved dtypes); None keeps them all.
  mesh None: everything on the first device.
  """
  meta = read_marker(path)
  try:
    target = abstract_params(path, mesh, dtype)
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckpt:
      params = ckpt.restore(os.path.join(path, PARAMS_DIR),
                            args=ocp.args.StandardRestore(target))
  except Exception as e:  # pylint: disable=broad-except  (tensorstore raises bare Exception)
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    raise DataError(os.path.join(path, PARAMS_DIR), f"orbax restore failed ({first}); the "
                    "checkpoint is incomplete or corrupt: convert it again") from e
  return _config(meta), params
