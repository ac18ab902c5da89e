"""Writes params in the exact Hugging Face layouts (bf16/f32, FP8 block-scaled, INT4 packed).

Used to ship the trained small models and to build small test checkpoints of every format.
"""

import json
import os
import shutil

import ml_dtypes
import numpy as np

from kdtree_jax.checkpoint import quant
from kdtree_jax.target.checkpoint import layer_specs, top_specs
from kdtree_jax.checkpoint.safetensors_io import save_file
from kdtree_jax.target.config import TargetConfig, to_hf_dict

FP8_MAX = 448.0


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def hf_tensors(cfg: TargetConfig, params) -> dict[str, np.ndarray]:
  """{HF name: f32 array in HF layout} for every weight (no prefix)."""
  out = {}
  specs = dict(top_specs(cfg))
  for i in range(cfg.num_hidden_layers):
    specs.update({("layers", i) + k: v for k, v in layer_specs(cfg, i).items()})
  for path, (name, shape, _) in specs.items():
    if isinstance(path[-1], int):
      w = np.asarray(_get(params, path[:-1]), np.float32)[path[-1]]
    else:
      w = np.asarray(_get(params, path), np.float32)
    if len(shape) == 2 and name != "model.embed_tokens.weight":
      w = w.reshape(shape[1], shape[0]).T  # ours [in, ...] -> HF [out, in]
    out[name] = np.ascontiguousarray(w.reshape(shape))
  return out


def _is_routed_expert(name):
  return ".mlp.experts." in name


def _fp8_target(name):
  keep = ("embed_tokens", "lm_head", "norm", "layernorm", "mlp.gate.weight", "e_score_correction")
  return name.endswith(".weight") and not any(k in name for k in keep)


def quantize_fp8(w: np.ndarray, block=128):
  """Per-128x128-block e4m3 quantisation -> (fp8 weight, f32 scale_inv [ceil, ceil])."""
  rows, cols = w.shape
  br, bc = -(-rows // block), -(-cols // block)
  pad = np.zeros((br * block, bc * block), np.float32)
  pad[:rows, :cols] = w
  amax = np.abs(pad.reshape(br, block, bc, block)).max(axis=(1, 3))
  scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
  s = np.repeat(np.repeat(scale, block, 0), block, 1)[:rows, :cols]
  return (w / s).astype(ml_dtypes.float8_e4m3fn), scale


def quantize_int4(w: np.ndarray, gsize=32):
  """Symmetric group-32 int4 -> (packed int32 [out, in/8], bf16 scale [out, in/32])."""
  rows, cols = w.shape
  g = w.reshape(rows, cols // gsize, gsize)
  scale = (np.abs(g).max(axis=-1) / 7.0).astype(ml_dtypes.bfloat16)
  sf = np.where(scale.astype(np.float32) > 0, scale.astype(np.float32), 1.0)
  q = np.clip(np.round(g / sf[..., None]), -8, 7).astype(np.int8).reshape(rows, cols)
  return quant.pack_int4(q), scale


def encode(tensors: dict, fmt: str) -> dict:
  """Converts f32 HF tensors to storage format 'float32' | 'bfloat16' | 'fp8' | 'int4'."""
  out = {}
  for name, w in tensors.items():
    if name.endswith("e_score_correction_bias") or fmt == "float32":
      out[name] = w.astype(np.float32)
    elif fmt == "fp8" and _fp8_target(name):
      out[name], out[name + "_scale_inv"] = quantize_fp8(w)
    elif fmt == "int4" and _is_routed_expert(name):
      base = name[:-len(".weight")]
      out[base + ".weight_packed"], out[base + ".weight_scale"] = quantize_int4(w)
      out[base + ".weight_shape"] = np.asarray(w.shape, np.int32)
    else:
      out[name] = w.astype(ml_dtypes.bfloat16)
  return out


def quant_config(fmt: str) -> dict | None:
  if fmt == "fp8":
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}
  if fmt == "int4":
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "group_size": 32, "strategy": "group", "symmetric": True,
                "type": "int"}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}
  return None


def save_hf_checkpoint(path: str, cfg: TargetConfig, params, fmt="float32", num_shards=1,
                       kimi_k25_wrapper=False):
  """Writes config.json + safetensors shards (+ index when sharded); atomic via a temp dir."""
  tensors = encode(hf_tensors(cfg, params), fmt)
  conf = to_hf_dict(cfg)
  if quant_config(fmt):
    conf["quantization_config"] = quant_config(fmt)
  if kimi_k25_wrapper:
    tensors = {"language_model." + k: v for k, v in tensors.items()}
    conf = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": conf, "vision_config": {"depth": 0}}
  tmp = path.rstrip("/") + ".partial"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  names = list(tensors)
  chunks = [names[k::num_shards] for k in range(num_shards)]
  weight_map = {}
  for k, chunk in enumerate(chunks):
    fname = ("model.safetensors" if num_shards == 1
             else f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors")
    save_file({n: tensors[n] for n in chunk}, os.path.join(tmp, fname), {"format": "pt"})
    weight_map.update({n: fname for n in chunk})
  if num_shards > 1:
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(conf, f, indent=1)
  shutil.rmtree(path, ignore_errors=True)
  os.replace(tmp, path)
