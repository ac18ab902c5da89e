"""DFlash draft checkpoints: config.json + *.safetensors in the z-lab / SpecForge layout.

HF names (optionally prefixed `model.`): fc.weight, hidden_norm.weight, norm.weight,
layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
layers.{i}.{input,post_attention}_layernorm.weight, layers.{i}.mlp.{gate,up,down}_proj.weight.
embed_tokens / lm_head tensors, if present, are ignored (the draft uses the target's).
"""

from __future__ import annotations

import glob
import json
import os
import warnings

import jax.numpy as jnp
from safetensors import safe_open
from safetensors.flax import save_file

from kdtree_jax.checkpoint.safetensors_io import SafetensorsFile
from kdtree_jax.cli import DataError
from kdtree_jax.draft.config import DraftConfig

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_MLP = ("gate_proj", "up_proj", "down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")
_IGNORED = ("embed_tokens.", "lm_head.")


def _hf_name(key: str, i: int | None = None) -> str:
  """HF tensor name of one params key (layer i for stacked layer keys)."""
  if i is None:
    return f"{key}.weight"
  group = "self_attn" if key in _ATTN else "mlp" if key in _MLP else None
  return f"layers.{i}.{group}.{key}.weight" if group else f"layers.{i}.{key}.weight"


def _expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
  """HF-layout ([out, in]) shape of every tensor the draft needs."""
  D, E, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
  HE, GE = cfg.num_attention_heads * E, cfg.num_key_value_heads * E
  per_layer = dict(q_proj=(HE, D), k_proj=(GE, D), v_proj=(GE, D), o_proj=(D, HE),
                   q_norm=(E,), k_norm=(E,), input_layernorm=(D,), post_attention_layernorm=(D,),
                   gate_proj=(F, D), up_proj=(F, D), down_proj=(D, F))
  out = {_hf_name("fc"): (D, cfg.n_taps * D), _hf_name("hidden_norm"): (D,), _hf_name("norm"): (D,)}
  for i in range(cfg.num_hidden_layers):
    out.update({_hf_name(k, i): s for k, s in per_layer.items()})
  return out


def _read_tensors(path: str) -> dict:
  """All tensors of the directory's *.safetensors (index.json or glob), `model.` stripped."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
    files = [os.path.join(path, name) for name in files]
  else:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors in {path}")
  out = {}
  for fn in files:
    if not os.path.isfile(fn):
      raise DataError(fn, "missing: model.safetensors.index.json lists it")
    SafetensorsFile(fn)  # header and size checked: a truncated file fails naming itself
    with safe_open(fn, framework="flax") as f:
      for name in f.keys():
        key = name[len("model."):] if name.startswith("model.") else name
        if not key.startswith(_IGNORED):
          out[key] = f.get_tensor(name)
  return out


def load_dflash_checkpoint(path: str, dtype=jnp.float32) -> tuple[DraftConfig, dict]:
  """Load (DraftConfig, params) from a DFlash checkpoint directory."""
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise DataError(os.path.join(path, "config.json"), "missing: a DFlash checkpoint directory "
                    "holds config.json and *.safetensors")
  cfg = DraftConfig.from_json(path)
  tensors = _read_tensors(path)
  want = _expected_shapes(cfg)
  missing = sorted(set(want) - set(tensors))
  if missing:
    raise KeyError(f"DFlash checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:5]}; "
                   f"found e.g. {sorted(tensors)[:5]}")
  for name, shape in want.items():
    if tuple(tensors[name].shape) != shape:
      raise ValueError(f"{name}: expected shape {shape} (HF [out, in]), got {tuple(tensors[name].shape)}")
  unknown = sorted(set(tensors) - set(want))
  if unknown:
    warnings.warn(f"DFlash checkpoint {path}: ignoring {len(unknown)} unknown tensors, e.g. {unknown[:5]}")
  return cfg, _to_params(cfg, tensors, dtype)


def _to_params(cfg, tensors, dtype) -> dict:
  """HF tensors -> params pytree ([in, out] linears, a list of per-layer dicts)."""
  get = lambda name: jnp.asarray(tensors[name], dtype)
  lin = lambda name: get(name).T
  layers = [{key: (get if key.endswith("norm") else lin)(_hf_name(key, i))
             for key in _ATTN + _MLP + _NORMS} for i in range(cfg.num_hidden_layers)]
  return dict(fc=lin(_hf_name("fc")), hidden_norm=get(_hf_name("hidden_norm")),
              norm=get(_hf_name("norm")), layers=layers)


def save_dflash_checkpoint(path: str, cfg: DraftConfig, params: dict) -> None:
  """Write config.json + model.safetensors in the z-lab layout (HF [out, in] linears)."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg.to_hf_dict(), f, indent=2)
  hf = lambda a, norm: jnp.asarray(a if norm else a.T)
  out = {_hf_name("fc"): hf(params["fc"], False), _hf_name("hidden_norm"): hf(params["hidden_norm"], True),
         _hf_name("norm"): hf(params["norm"], True)}
  for i, layer in enumerate(params["layers"]):
    for key, a in layer.items():
      out[_hf_name(key, i)] = hf(a, key.endswith("norm"))
  save_file({k: jnp.asarray(v) for k, v in out.items()}, os.path.join(path, "model.safetensors"),
            metadata={"format": "pt"})
