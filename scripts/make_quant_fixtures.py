"""Writes FP8 (K2) and INT4 (K2.5/K2.6 wrapper) checkpoints + transformers reference logits.

Starts from the f32 fixture `tests/fixtures/hf/k2_qlora_yarn32`, quantises it with torch / numpy
(independently of kdtree_jax), writes the exact HF layouts, dequantises again in torch, and runs
transformers' DeepseekV3ForCausalLM on the dequantised weights:
  * fp8_k2:   F8_E4M3 weights + F32 `weight_scale_inv` blocks (16 x 16 here, so there are many
              blocks and partial ones at the edges), bf16 embed / head / norms / router, f32 bias;
  * int4_k25: `language_model.`-prefixed K2.5 wrapper; routed experts as int32 `weight_packed`
              (low nibble first, value - 8) + bf16 `weight_scale` (group 8 here) + `weight_shape`;
              the rest bf16; two shards + index; a dummy vision tower.
Each directory gets `reference.npz` (tokens, logits of HF on the dequantised weights).

  .venv311/bin/python scripts/make_quant_fixtures.py --out tests/fixtures/quant
"""

import argparse
import json
import os
import shutil
import tempfile

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

SRC = "tests/fixtures/hf/k2_qlora_yarn32"
FP8_BLOCK = 16
INT4_GROUP = 8


def fp8_quantize(w):
  """Per-block e4m3: returns (fp8 weight, f32 scale_inv [ceil(out/b), ceil(in/b)])."""
  rows, cols = w.shape
  br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
  scale = torch.ones(br, bc)
  q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
  for i in range(br):
    for j in range(bc):
      blk = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
      s = blk.abs().max().item() / 448.0 or 1.0
      scale[i, j] = s
      q[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = (blk / s).to(
          torch.float8_e4m3fn)
  return q, scale


def fp8_dequantize(q, scale):
  out = q.to(torch.float32).clone()
  for i in range(scale.shape[0]):
    for j in range(scale.shape[1]):
      out[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] *= scale[i, j]
  return out


def int4_quantize(w):
  """Symmetric groups of INT4_GROUP along `in` -> (int32 packed [out, in/8], bf16 scale)."""
  rows, cols = w.shape
  g = w.reshape(rows, cols // INT4_GROUP, INT4_GROUP)
  scale = (g.abs().amax(-1) / 7.0).to(torch.bfloat16)
  q = torch.clamp(torch.round(g / scale.float().clamp_min(1e-12)[..., None]), -8, 7)
  nib = (q.reshape(rows, cols).to(torch.int64) + 8).numpy().astype(np.uint32)
  words = np.zeros((rows, cols // 8), np.uint32)
  for k in range(8):
    words |= nib[:, k::8] << np.uint32(4 * k)
  return torch.from_numpy(words.view(np.int32)), scale


def int4_dequantize(packed, scale):
  words = packed.numpy().view(np.uint32)
  rows, n = words.shape
  q = np.empty((rows, n * 8), np.float32)
  for k in range(8):
    q[:, k::8] = ((words >> np.uint32(4 * k)) & 0xF).astype(np.float32) - 8
  s = scale.float().numpy().repeat(INT4_GROUP, axis=1)
  return torch.from_numpy(q * s)


def fp8_target(name):
  keep = ("embed_tokens", "lm_head", "norm", "layernorm", "mlp.gate.weight", "e_score_correction")
  return name.endswith(".weight") and not any(k in name for k in keep)


def reference_logits(cfg_dict, state, tokens):
  """transformers on the dequantised weights (saved per-expert, loaded by from_pretrained)."""
  tmp = tempfile.mkdtemp()
  cfg = {k: v for k, v in cfg_dict.items() if k != "quantization_config"}
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(cfg, f)
  save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"),
            metadata={"format": "pt"})
  model = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
  shutil.rmtree(tmp)
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def write_fp8(src, out, cfg, tokens):
  tensors, deq = {}, {}
  for name, w in src.items():
    if name.endswith("e_score_correction_bias"):
      tensors[name] = deq[name] = w.float()
    elif fp8_target(name):
      q, s = fp8_quantize(w.float())
      tensors[name], tensors[name + "_scale_inv"] = q, s
      deq[name] = fp8_dequantize(q, s)
    else:
      tensors[name] = w.to(torch.bfloat16)
      deq[name] = tensors[name].float()
  cfg = dict(cfg, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                       "activation_scheme": "dynamic",
                                       "weight_block_size": [FP8_BLOCK, FP8_BLOCK]})
  os.makedirs(out, exist_ok=True)
  save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cfg, f, indent=1)
  np.savez(os.path.join(out, "reference.npz"), tokens=tokens,
           logits=reference_logits(cfg, deq, tokens))


def write_int4(src, out, cfg, tokens):
  tensors, deq = {}, {}
  for name, w in src.items():
    if name.endswith("e_score_correction_bias"):
      tensors[name] = deq[name] = w.float()
    elif ".mlp.experts." in name:
      base = name[:-len(".weight")]
      p, s = int4_quantize(w.float())
      tensors[base + ".weight_packed"], tensors[base + ".weight_scale"] = p, s
      tensors[base + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
      deq[name] = int4_dequantize(p, s)
    else:
      tensors[name] = w.to(torch.bfloat16)
      deq[name] = tensors[name].float()
  tensors = {"language_model." + k: v for k, v in tensors.items()}
  tensors["vision_tower.patch_embed.weight"] = torch.zeros(4, 3, dtype=torch.bfloat16)
  tensors["mm_projector.proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
  qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "group_size": INT4_GROUP, "strategy": "group", "symmetric": True,
            "type": "int"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}
  wrapper = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
             "text_config": dict(cfg, quantization_config=qc), "vision_config": {"depth": 1}}
  os.makedirs(out, exist_ok=True)
  names = sorted(tensors)
  shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
  for fname, chunk in shards.items():
    save_file({n: tensors[n] for n in chunk}, os.path.join(out, fname), metadata={"format": "pt"})
  with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": {n: fn for fn, ch in shards.items() for n in ch}}, f,
              indent=1)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(wrapper, f, indent=1)
  np.savez(os.path.join(out, "reference.npz"), tokens=tokens,
           logits=reference_logits(cfg, deq, tokens))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="tests/fixtures/quant")
  args = ap.parse_args()
  torch.manual_seed(0)
  src = load_file(os.path.join(SRC, "model.safetensors"))
  with open(os.path.join(SRC, "config.json")) as f:
    cfg = json.load(f)
  tokens = np.load(os.path.join(SRC, "reference.npz"))["tokens"]
  shutil.rmtree(args.out, ignore_errors=True)
  write_fp8(src, os.path.join(args.out, "fp8_k2"), cfg, tokens)
  write_int4(src, os.path.join(args.out, "int4_k25"), cfg, tokens)
  print("wrote", sorted(os.listdir(args.out)))


if __name__ == "__main__":
  main()
