"""Loads Hugging Face Kimi K2 / K2.5 / K2.6 / DeepSeek-V3 checkpoints into the params pytree.

Streams tensor by tensor (memory-mapped), dequantising FP8 / INT4 to f32 on the host, then
casting and placing each tensor through `put` (default: `jnp.asarray`; a sharded loader passes
a `jax.device_put` with the rules' sharding). The whole checkpoint is never in host memory.
"""

import json
import os
import re
import sys
from typing import Callable

import jax.numpy as jnp
import numpy as np

from kdtree_jax.checkpoint import quant
from kdtree_jax.checkpoint.safetensors_io import CheckpointDir
from kdtree_jax.cli import DataError
from kdtree_jax.target.config import TargetConfig, config_from_hf_dict
from kdtree_jax.checkpoint import int4
from kdtree_jax.target.params import param_shapes

# Tensors that exist in real checkpoints but are not part of the text model.
IGNORED = (re.compile(r"^(vision_tower|mm_projector|multi_modal_projector)\."),
           re.compile(r".*rotary_emb\.inv_freq$"))


def _linear(shape_out_in, reshape=None):
  """HF Linear [out, in] -> ours [in, out] (optionally reshaped)."""
  def f(w):
    w = w.T
    return w.reshape(reshape) if reshape else w
  return shape_out_in, f


def _vector(n):
  return (n,), lambda w: w


def layer_specs(cfg: TargetConfig, i: int) -> dict:
  """{param path: (hf name, hf shape, transform)} for layer i (routed experts listed per expert)."""
  d, h, r, p = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
  qk, dn, dv = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
  pre = f"model.layers.{i}."
  a = pre + "self_attn."
  s = {("attn_norm",): (pre + "input_layernorm.weight",) + _vector(d),
       ("mlp_norm",): (pre + "post_attention_layernorm.weight",) + _vector(d),
       ("attn", "kv_a"): (a + "kv_a_proj_with_mqa.weight",) + _linear((r + p, d)),
       ("attn", "kv_a_norm"): (a + "kv_a_layernorm.weight",) + _vector(r),
       ("attn", "kv_b"): (a + "kv_b_proj.weight",) + _linear((h * (dn + dv), r), (r, h, dn + dv)),
       ("attn", "o"): (a + "o_proj.weight",) + _linear((d, h * dv), (h, dv, d))}
  if cfg.q_lora_rank is None:
    s[("attn", "q")] = (a + "q_proj.weight",) + _linear((h * qk, d), (d, h, qk))
  else:
    rq = cfg.q_lora_rank
    s[("attn", "q_a")] = (a + "q_a_proj.weight",) + _linear((rq, d))
    s[("attn", "q_a_norm")] = (a + "q_a_layernorm.weight",) + _vector(rq)
    s[("attn", "q_b")] = (a + "q_b_proj.weight",) + _linear((h * qk, rq), (rq, h, qk))
  if i < cfg.first_k_dense_replace:
    f = cfg.intermediate_size
    for name, shp in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
      s[("mlp", name)] = (f"{pre}mlp.{name}_proj.weight",) + _linear(shp)
    return s
  e, f = cfg.n_routed_experts, cfg.moe_intermediate_size
  s[("moe", "router")] = (pre + "mlp.gate.weight",) + _linear((e, d))
  s[("moe", "bias")] = (pre + "mlp.gate.e_score_correction_bias",) + _vector(e)
  for j in range(e):
    for name, shp in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
      s[("moe", name, j)] = (f"{pre}mlp.experts.{j}.{name}_proj.weight",) + _linear(shp)
  if cfg.n_shared_experts:
    fs = f * cfg.n_shared_experts
    for name, shp in (("gate", (fs, d)), ("up", (fs, d)), ("down", (d, fs))):
      s[("moe", "shared", name)] = (f"{pre}mlp.shared_experts.{name}_proj.weight",) + _linear(shp)
  return s


def top_specs(cfg: TargetConfig) -> dict:
  v, d = cfg.vocab_size, cfg.hidden_size
  return {("embed",): ("model.embed_tokens.weight", (v, d), lambda w: w),
          ("final_norm",): ("model.norm.weight",) + _vector(d),
          ("lm_head",): ("lm_head.weight",) + _linear((v, d))}


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64", "F8_E4M3")


class _Reader:
  """Reads one logical weight by name, dequantising FP8 / INT4 storage to f32 numpy."""

  def __init__(self, ckpt: CheckpointDir, qc: dict | None):
    self.ckpt, self.qc = ckpt, qc
    self.used: set[str] = set()

  def has(self, name):
    base = name[:-len(".weight")] if name.endswith(".weight") else None
    return name in self.ckpt or (base is not None and base + ".weight_packed" in self.ckpt)

  def is_int4(self, name):
    return name.endswith(".weight") and name[:-len(".weight")] + ".weight_packed" in self.ckpt

  def read_int4(self, name, want_shape):
    """A packed INT4 matrix kept quantised -> (int8 q [in, out], scale [in/Q, out])."""
    base = name[:-len(".weight")]
    parts = [base + s for s in (".weight_packed", ".weight_scale", ".weight_shape")]
    packed, scale, shape = (self.ckpt.get(n) for n in parts)
    if tuple(int(x) for x in shape) != tuple(want_shape):
      raise ValueError(f"weight {base!r} has weight_shape {tuple(shape)}, expected {want_shape}")
    self.used.update(parts)
    return int4.from_hf(packed, scale, shape)

  def read(self, name, want_shape):
    if name in self.ckpt:
      if self.ckpt.dtype(name) not in FLOAT_DTYPES:
        raise ValueError(f"weight {name!r} is stored as {self.ckpt.dtype(name)}; expected one of "
                         f"{FLOAT_DTYPES}")
      w = self.ckpt.get(name)
      self.used.add(name)
      if self.ckpt.dtype(name) == "F8_E4M3":
        sname = name + "_scale_inv"
        if sname not in self.ckpt:
          raise ValueError(f"FP8 weight {name!r} has no {sname!r}")
        block = tuple((self.qc or {}).get("weight_block_size", (128, 128)))
        self.used.add(sname)
        w = quant.dequant_fp8(w, self.ckpt.get(sname), block)
    else:
      base = name[:-len(".weight")]
      parts = [base + s for s in (".weight_packed", ".weight_scale", ".weight_shape")]
      missing = [n for n in parts if n not in self.ckpt]
      if missing:
        raise ValueError(f"INT4 weight {base!r} is missing {missing}")
      if self.qc is None or self.qc.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{base!r} is INT4-packed but config.json has no compressed-tensors "
                         "quantization_config")
      packed, scale, shape = (self.ckpt.get(n) for n in parts)
      self.used.update(parts)
      w = quant.dequant_int4(packed, scale, tuple(int(x) for x in shape), quant.group_size(self.qc))
    if tuple(w.shape) != tuple(want_shape):
      raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(want_shape)} "
                       "from config.json")
    return np.asarray(w, np.float32) if w.dtype != np.float32 else w


def _set(tree, path, value):
  node = tree
  for key in path[:-1]:
    node = node[key]
  node[path[-1]] = value


def _empty_tree(cfg):
  shapes = param_shapes(cfg)
  layers = [{k: ({} if isinstance(v, dict) else None) for k, v in ls.items()} for ls in shapes["layers"]]
  for ls, layer in zip(shapes["layers"], layers):
    for k, v in ls.items():
      if isinstance(v, dict):
        layer[k] = {kk: ({} if isinstance(vv, dict) else None) for kk, vv in v.items()}
  return {"embed": None, "final_norm": None, "lm_head": None, "layers": layers}


def default_put(dtype):
  """Places one tensor: routing bias f32, INT4 `packed`/`scale` as stored, the rest in dtype."""
  def put(path, w):
    if path[-1] == "bias":
      return jnp.asarray(w, jnp.float32)
    if path[-1] in ("packed", "scale"):
      return jnp.asarray(w)
    return jnp.asarray(w, dtype)
  return put


def load_hf_checkpoint(path: str, dtype=jnp.float32, put: Callable | None = None,
                       progress: bool = False, int4_experts: bool = False):
  """Loads a HF checkpoint directory -> (TargetConfig, params pytree).

  dtype: the dtype of every weight except the routing bias (kept f32). put(path, np.ndarray)
  places one tensor (default `default_put(dtype)`). int4_experts: keep INT4-packed routed
  experts packed on device (`model.int4.Int4Weight`) instead of dequantising them.
  """
  raw = read_config_json(path)
  cfg = config_from_hf_dict(raw)
  qc = quant.check_quant_config((raw.get("text_config") or raw).get("quantization_config")
                                or raw.get("quantization_config"))
  reader = _Reader(CheckpointDir(path), qc)
  put = put or default_put(dtype)
  specs = dict(top_specs(cfg))
  for i in range(cfg.num_hidden_layers):
    specs.update({("layers", i) + k: v for k, v in layer_specs(cfg, i).items()})
  missing = [n for (n, _, _) in specs.values() if not reader.has(cfg.weight_prefix + n)]
  if missing:
    raise ValueError(_missing_message(missing, reader.ckpt.keys(), cfg.weight_prefix))
  params = _empty_tree(cfg)
  experts: dict = {}
  for k, (pidx, (name, shape, tf)) in enumerate(specs.items()):
    full = cfg.weight_prefix + name
    if isinstance(pidx[-1], int) and int4_experts and reader.is_int4(full):
      experts.setdefault(pidx[:-1], []).append(reader.read_int4(full, shape))
      if len(experts[pidx[:-1]]) == cfg.n_routed_experts:
        qs, ss = zip(*experts.pop(pidx[:-1]))
        packed, scale = int4.pack_numpy(np.stack(qs), np.stack(ss))
        _set(params, pidx[:-1], int4.Int4Weight(put(pidx[:-1] + ("packed",), packed),
                                                put(pidx[:-1] + ("scale",), scale)))
      continue
    w = tf(reader.read(full, shape))
    if isinstance(pidx[-1], int):  # one routed expert: stack per (layer, matrix)
      experts.setdefault(pidx[:-1], []).append(w)
      if len(experts[pidx[:-1]]) == cfg.n_routed_experts:
        _set(params, pidx[:-1], put(pidx[:-1], np.stack(experts.pop(pidx[:-1]))))
    else:
      _set(params, pidx, put(pidx, w))
    if progress and k % 50 == 0:
      print(f"\rloading {k + 1}/{len(specs)} tensors", end="", file=sys.stderr, flush=True)
  if progress:
    print(file=sys.stderr)
  _check_unused(reader, cfg)
  return cfg, params


def read_config_json(path: str) -> dict:
  """A checkpoint directory's config.json; DataError naming the file if missing or corrupt."""
  fname = os.path.join(path, "config.json")
  if not os.path.isfile(fname):
    raise DataError(fname, "missing: a HF checkpoint directory holds config.json and "
                    "*.safetensors")
  try:
    with open(fname) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise DataError(fname, f"is not valid JSON ({e})") from e


def _missing_message(missing, present, prefix):
  head = ", ".join(repr(prefix + n) for n in missing[:8])
  more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
  unknown = [n for n in present if not any(p.match(n) for p in IGNORED)][:5]
  return (f"checkpoint is missing {len(missing)} weight(s): {head}{more}. "
          f"(A few names it does hold: {unknown}; check the model_type / weight prefix.)")


def _check_unused(reader: _Reader, cfg: TargetConfig):
  """Unexpected tensors mean a misnamed or foreign weight: fail rather than silently ignore."""
  extra = []
  for n in reader.ckpt.keys():
    if n in reader.used or any(p.match(n) for p in IGNORED):
      continue
    m = re.match(rf"^{re.escape(cfg.weight_prefix)}model\.layers\.(\d+)\.", n)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
      continue  # DeepSeek-V3's MTP layer (layers.61) is not part of the decoder
    extra.append(n)
  if extra:
    raise ValueError(f"checkpoint holds {len(extra)} unexpected weight(s), e.g. {extra[:5]}; "
                     "a weight is misnamed or the config does not match the checkpoint")
