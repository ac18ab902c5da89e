"""Writes reference fixtures from Hugging Face transformers' DeepseekV3ForCausalLM.

Each fixture directory holds a real HF checkpoint (config.json + safetensors, sharded with an index
for some) and `reference.npz` (`tokens` int32 [B, S], `logits` float32 [B, S, V]) computed by the
HF model in float32, eval mode, no cache, positions 0..S-1, causal, no padding; plus `meta.json`
(versions, seed, what was set) and `sensitivity` numbers: how far the logits move under a few
plausible reimplementation mistakes, to show the fixture can tell them apart.

Needs torch + transformers (not in the project venv):
  .venv311/bin/python scripts/make_hf_fixtures.py --out tests/fixtures/hf
See notes/hf_fixtures.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds3

B = 2

COMMON = dict(
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, hidden_act="silu", scoring_func="sigmoid",
    topk_method="noaux_tc", tie_word_embeddings=False, attention_bias=False, rope_theta=50000.0,
    bos_token_id=0, eos_token_id=1, pad_token_id=None, initializer_range=0.02,
)

# name -> (config kwargs, seq len, bias mean, max_shard_size or None, seed)
FIXTURES = {
    # (a) Kimi K2-0711-like: q_lora, one group, 1 dense layer, normalized top-k, YaRN x32 beta 1/1,
    # prompt (40) longer than original_max_position_embeddings (16).
    "k2_qlora_yarn32": dict(
        cfg=dict(vocab_size=128, hidden_size=48, intermediate_size=96, moe_intermediate_size=24,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                 kv_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                 routed_scaling_factor=2.827, rms_norm_eps=1e-6, max_position_embeddings=128,
                 rope_scaling=dict(type="yarn", factor=32.0, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                                   mscale_all_dim=1.0, original_max_position_embeddings=16)),
        seq=40, bias_mean=0.0, shard=None, seed=1),
    # (b) K2.5-like rope (YaRN x64, beta_fast 32), plain q_proj, grouped routing 4/2, 2 dense layers,
    # un-normalized top-k, several safetensors shards + index.
    "noqlora_group4_yarn64_sharded": dict(
        cfg=dict(vocab_size=160, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
                 kv_lora_rank=16, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=2,
                 n_group=4, topk_group=2, first_k_dense_replace=2, norm_topk_prob=False,
                 routed_scaling_factor=1.5, rms_norm_eps=1e-5, max_position_embeddings=128,
                 rope_scaling=dict(type="yarn", factor=64.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                   mscale_all_dim=1.0, original_max_position_embeddings=16)),
        seq=24, bias_mean=0.0, shard="60KB", seed=2),
    # (c) plain rope, 2 groups pick 1, routed_scaling_factor 2.827, one shared expert. The correction
    # bias is mostly negative (so sigmoid + bias < 0): an implementation that masks dropped groups with
    # 0.0 instead of -inf would pick masked experts here. rms_norm_eps is large (1e-2) so using the
    # config eps in q_a/kv_a_layernorm (HF uses 1e-6 there) shows up.
    "plainrope_group2": dict(
        cfg=dict(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                 kv_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 n_group=2, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                 routed_scaling_factor=2.827, rms_norm_eps=1e-2, max_position_embeddings=64,
                 rope_scaling=None),
        seq=20, bias_mean=-1.0, shard=None, seed=3),
    # (e) the real K2.5/K2.6 rope numbers (theta 5e4, YaRN x64, beta 32/1, original 4096, max 262144)
    # on a 2-layer model: with original 4096 the YaRN ramp spans non-integer dims, so HF's default
    # `truncate` (floor/ceil of the correction range, as DeepSeek) changes the frequencies.
    "k25_real_rope": dict(
        cfg=dict(vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                 kv_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                 routed_scaling_factor=2.827, rms_norm_eps=1e-5, max_position_embeddings=262144,
                 rope_scaling=dict(type="yarn", factor=64.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                   mscale_all_dim=1.0, original_max_position_embeddings=4096)),
        seq=48, bias_mean=0.0, shard=None, seed=5),
}

# (d) K2.5/K2.6 wrapper layout, built from a text model like (a).
WRAPPER = dict(
    name="k25_wrapper",
    cfg=dict(FIXTURES["k2_qlora_yarn32"]["cfg"], vocab_size=112, hidden_size=32, num_hidden_layers=2,
             n_routed_experts=12, num_experts_per_tok=3, n_group=1, topk_group=1, rms_norm_eps=1e-5,
             rope_scaling=dict(type="yarn", factor=64.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                               mscale_all_dim=1.0, original_max_position_embeddings=16)),
    seq=36, bias_mean=0.0, shard="40KB", seed=4)


def build_model(cfg_kwargs: dict, seed: int, bias_mean: float) -> DeepseekV3ForCausalLM:
  kw = copy.deepcopy(dict(COMMON, **cfg_kwargs))  # HF mutates the rope dict it is given
  config = DeepseekV3Config(**kw)
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
  reinit(model, seed, bias_mean)
  return model


@torch.no_grad()
def reinit(model: DeepseekV3ForCausalLM, seed: int, bias_mean: float) -> None:
  """Meaningful random weights: unit-ish activations, non-trivial routing and attention."""
  g = torch.Generator().manual_seed(seed * 1000 + 7)

  def normal(shape, std, mean=0.0):
    return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

  for name, p in model.named_parameters():
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
      p.copy_(normal(p.shape, 0.1, 1.0))
    elif name.endswith("embed_tokens.weight"):
      p.copy_(normal(p.shape, 1.0))
    elif name.endswith("mlp.gate.weight"):  # router: logits with std ~1.5
      p.copy_(normal(p.shape, 1.5 / p.shape[-1] ** 0.5))
    elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
      p.copy_(normal(p.shape, 1.0 / p.shape[-1] ** 0.5))  # [E, out, in]
    elif p.ndim == 2:  # nn.Linear [out, in]
      p.copy_(normal(p.shape, 1.0 / p.shape[-1] ** 0.5))
    else:
      raise ValueError(f"unexpected parameter {name} {tuple(p.shape)}")
  nbias = 0
  for name, b in model.named_buffers():
    if name.endswith("e_score_correction_bias"):
      b.copy_(normal(b.shape, 0.3, bias_mean))
      assert bool((b != 0).all())
      nbias += 1
  assert nbias == model.config.num_hidden_layers - model.config.first_k_dense_replace


@torch.no_grad()
def run_logits(model, tokens: np.ndarray) -> np.ndarray:
  ids = torch.from_numpy(tokens.astype(np.int64))
  out = model(input_ids=ids, use_cache=False)
  return out.logits.float().numpy()


# ---- sensitivity: how far plausible mistakes move the logits ------------------------------------
@contextlib.contextmanager
def _patched(obj, name, value):
  old = getattr(obj, name)
  setattr(obj, name, value)
  try:
    yield
  finally:
    setattr(obj, name, old)


def _router_zero_mask(self, hidden_states):
  """DeepSeek's original remote-code router: dropped groups masked with 0.0, not -inf."""
  F = torch.nn.functional
  hidden_states = hidden_states.view(-1, self.hidden_dim)
  router_logits = F.linear(hidden_states.float(), self.weight.float())
  scores = router_logits.sigmoid()
  sfc = scores + self.e_score_correction_bias
  gs = sfc.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(-1)
  gidx = torch.topk(gs, k=self.topk_group, dim=-1, sorted=False)[1]
  gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
  smask = gmask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(-1, self.num_experts)
  sfc = sfc.masked_fill(~smask.bool(), 0.0)
  idx = torch.topk(sfc, k=self.top_k, dim=-1, sorted=False)[1]
  w = scores.gather(1, idx)
  if self.norm_topk_prob:
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
  return router_logits, w * self.routed_scaling_factor, idx


def sensitivity(model, tokens, ref) -> dict[str, float]:
  """Relative L2 change of the logits under each variant (a fixture detects it if >> 1e-4)."""
  cfg = model.config
  res = {}

  def rel(x):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))

  # 1. rope not interleaved (rotate_half on contiguous halves).
  with _patched(cfg, "rope_interleave", False):
    res["rope_rotate_half_instead_of_interleaved"] = rel(run_logits(model, tokens))
  # 2. no YaRN mscale^2 on the softmax scale.
  attns = [l.self_attn for l in model.model.layers]
  if cfg.rope_parameters.get("rope_type", "default") != "default":
    old = [a.scaling for a in attns]
    for a in attns:
      a.scaling = a.qk_head_dim ** -0.5
    res["softmax_scale_without_yarn_mscale"] = rel(run_logits(model, tokens))
    for a, s in zip(attns, old):
      a.scaling = s
    # 3. plain rope frequencies instead of YaRN ones.
    rot = model.model.rotary_emb
    inv = rot.inv_freq.clone()
    dim = cfg.qk_rope_head_dim
    rot.inv_freq.copy_(1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)))
    res["plain_rope_freqs_instead_of_yarn"] = rel(run_logits(model, tokens))
    # 4. YaRN correction range not truncated (floor/ceil skipped; HF default truncate=True).
    c2 = copy.deepcopy(cfg)
    c2.rope_parameters["truncate"] = False
    rot.inv_freq.copy_(ROPE_INIT_FUNCTIONS["yarn"](c2)[0])
    res["yarn_correction_range_not_truncated"] = rel(run_logits(model, tokens))
    rot.inv_freq.copy_(inv)
  # 5. config rms_norm_eps in q_a_layernorm / kv_a_layernorm (HF and DeepSeek use the 1e-6 default).
  norms = [m for a in attns for m in (a.q_a_layernorm, a.kv_a_layernorm) if m is not None]
  old = [m.variance_epsilon for m in norms]
  for m in norms:
    m.variance_epsilon = cfg.rms_norm_eps
  res["config_eps_in_lora_norms"] = rel(run_logits(model, tokens))
  for m, e in zip(norms, old):
    m.variance_epsilon = e
  # 6. group masking with 0.0 (DeepSeek remote code) instead of -inf (HF, DeepSeek inference/model.py).
  if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
    with _patched(hf_ds3.DeepseekV3TopkRouter, "forward", _router_zero_mask):
      res["group_mask_zero_instead_of_neg_inf"] = rel(run_logits(model, tokens))
  # 7. correction bias ignored (i.e. left at HF's zero init).
  gates = [l.mlp.gate for l in model.model.layers if hasattr(l.mlp, "gate")]
  old = [g.e_score_correction_bias.clone() for g in gates]
  for g in gates:
    g.e_score_correction_bias.zero_()
  res["e_score_correction_bias_zero"] = rel(run_logits(model, tokens))
  for g, b in zip(gates, old):
    g.e_score_correction_bias.copy_(b)
  # 8. routed_scaling_factor dropped.
  if cfg.routed_scaling_factor != 1.0:
    sf = [g.routed_scaling_factor for g in gates]
    for g in gates:
      g.routed_scaling_factor = 1.0
    res["routed_scaling_factor_dropped"] = rel(run_logits(model, tokens))
    for g, s in zip(gates, sf):
      g.routed_scaling_factor = s
  # sanity: restored model reproduces the reference exactly.
  assert rel(run_logits(model, tokens)) == 0.0, "sensitivity probe did not restore the model"
  return res


# ---- writing ------------------------------------------------------------------------------------
def _dir_size(path: str) -> int:
  return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _versions() -> dict:
  return {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__}


def _check_roundtrip(path: str, tokens, ref) -> float:
  """Reloads the saved checkpoint with from_pretrained and checks it gives the same logits."""
  m = DeepseekV3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager").eval()
  err = float(np.abs(run_logits(m, tokens) - ref).max())
  assert err == 0.0, f"{path}: reloaded checkpoint differs from the in-memory model by {err}"
  return err


def _save_reference(path, tokens, logits):
  np.savez_compressed(os.path.join(path, "reference.npz"), tokens=tokens.astype(np.int32),
                      logits=logits.astype(np.float32))


def make_fixture(out_dir: str, name: str, spec: dict) -> dict:
  path = os.path.join(out_dir, name)
  shutil.rmtree(path, ignore_errors=True)
  model = build_model(spec["cfg"], spec["seed"], spec["bias_mean"])
  rng = np.random.default_rng(spec["seed"])
  tokens = rng.integers(0, model.config.vocab_size, size=(B, spec["seq"]), dtype=np.int32)
  logits = run_logits(model, tokens)
  kw = dict(safe_serialization=True)
  if spec["shard"]:
    kw["max_shard_size"] = spec["shard"]
  model.save_pretrained(path, **kw)
  _check_roundtrip(path, tokens, logits)
  _save_reference(path, tokens, logits)
  meta = dict(name=name, versions=_versions(), seed=spec["seed"], batch=B, seq_len=spec["seq"],
              set_config=dict(COMMON, **spec["cfg"]), bias_mean=spec["bias_mean"], attn_implementation="eager",
              sensitivity=sensitivity(model, tokens, logits))
  with open(os.path.join(path, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
  return meta


@torch.no_grad()
def _check_wrapper(path, model, tokens, ref):
  """Reads the hand-written shards back through the index, strips `language_model.`, reloads."""
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    wm = json.load(f)["weight_map"]
  sd = {}
  for fname in sorted(set(wm.values())):
    sd.update(load_file(os.path.join(path, fname)))
  assert set(sd) == set(wm)
  text = {k[len("language_model."):]: v for k, v in sd.items() if k.startswith("language_model.")}
  # HF's own loader converts per-expert tensors back into the fused [E, 2I, D] layout.
  tmp = path + ".tmp_check"
  os.makedirs(tmp, exist_ok=True)
  save_file(text, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
  model.config.save_pretrained(tmp)
  m = DeepseekV3ForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32, attn_implementation="eager").eval()
  shutil.rmtree(tmp)
  err = float(np.abs(run_logits(m, tokens) - ref).max())
  assert err == 0.0, f"wrapper shards do not reproduce the reference ({err})"


def make_wrapper_fixture(out_dir: str, spec: dict) -> dict:
  """K2.5/K2.6 layout: `kimi_k25` wrapper config, text model weights under `language_model.`."""
  name = spec["name"]
  path = os.path.join(out_dir, name)
  tmp = path + ".tmp_text"
  shutil.rmtree(path, ignore_errors=True)
  shutil.rmtree(tmp, ignore_errors=True)
  model = build_model(spec["cfg"], spec["seed"], spec["bias_mean"])
  rng = np.random.default_rng(spec["seed"])
  tokens = rng.integers(0, model.config.vocab_size, size=(B, spec["seq"]), dtype=np.int32)
  logits = run_logits(model, tokens)
  model.save_pretrained(tmp, safe_serialization=True)  # to get HF's on-disk tensor names
  _check_roundtrip(tmp, tokens, logits)
  tensors = load_file(os.path.join(tmp, "model.safetensors"))
  shutil.rmtree(tmp)

  renamed = {"language_model." + k: v.contiguous() for k, v in tensors.items()}
  g = torch.Generator().manual_seed(spec["seed"])
  renamed["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 2, generator=g)
  renamed["vision_tower.patch_embed.proj.bias"] = torch.randn(16, generator=g)
  renamed["vision_tower.encoder.blocks.0.norm0.weight"] = torch.ones(16)
  renamed["mm_projector.pre_norm.weight"] = torch.ones(64)
  renamed["mm_projector.proj.0.weight"] = torch.randn(32, 64, generator=g)
  renamed["mm_projector.proj.2.weight"] = torch.randn(32, 32, generator=g)

  # Shards by hand: vision/projector in the first shard, the text model split by layer, like the
  # real K2.5 checkpoints (model-00001-of-0000N.safetensors + model.safetensors.index.json).
  c = model.config
  groups = [[k for k in renamed if not k.startswith("language_model.")]]
  groups.append([k for k in renamed if k.startswith("language_model.") and ".layers." not in k])
  for l in range(c.num_hidden_layers):
    groups.append([k for k in renamed if k.startswith(f"language_model.model.layers.{l}.")])
  assert sum(map(len, groups)) == len(renamed)
  os.makedirs(path)
  n = len(groups)
  weight_map = {}
  total = 0
  for i, keys in enumerate(groups):
    fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    save_file({k: renamed[k] for k in keys}, os.path.join(path, fname), metadata={"format": "pt"})
    for k in keys:
      weight_map[k] = fname
      total += renamed[k].numel() * renamed[k].element_size()
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)

  # Text config written the way Kimi's own (transformers v4 style) config.json files are: model_type
  # "kimi_k2", rope_theta + rope_scaling {"type": "yarn", ...} at the top level of text_config.
  rs = dict(spec["cfg"]["rope_scaling"])
  text = dict(COMMON, **{k: v for k, v in spec["cfg"].items() if k != "rope_scaling"})
  text.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], rope_scaling=rs,
              moe_layer_freq=1, num_nextn_predict_layers=0, torch_dtype="float32", use_cache=True,
              rope_interleave=True)
  text.pop("initializer_range")
  config = {
      "architectures": ["KimiK25ForConditionalGeneration"],
      "model_type": "kimi_k25",
      "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                   "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
      "text_config": text,
      "vision_config": {"model_type": "kimi_k25_vision", "hidden_size": 16, "patch_size": 2,
                        "num_hidden_layers": 1, "mm_hidden_size": 16, "text_hidden_size": 32,
                        "merge_kernel_size": [2, 2]},
      "media_placeholder_token_id": 100, "pad_token_id": None, "bos_token_id": 0, "eos_token_id": 1,
      "tie_word_embeddings": False, "torch_dtype": "float32",
      "transformers_version": transformers.__version__,
  }
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  _check_wrapper(path, model, tokens, logits)
  _save_reference(path, tokens, logits)
  meta = dict(name=name, versions=_versions(), seed=spec["seed"], batch=B, seq_len=spec["seq"],
              set_config=dict(COMMON, **spec["cfg"]), bias_mean=spec["bias_mean"], attn_implementation="eager",
              note="hand-written kimi_k25 wrapper; logits from the underlying DeepseekV3ForCausalLM",
              sensitivity=sensitivity(model, tokens, logits))
  with open(os.path.join(path, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
  return meta


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="tests/fixtures/hf")
  ap.add_argument("--only", default="", help="comma-separated fixture names (default: all)")
  args = ap.parse_args()
  torch.set_num_threads(1)
  os.makedirs(args.out, exist_ok=True)
  only = set(filter(None, args.only.split(",")))
  for name, spec in FIXTURES.items():
    if not only or name in only:
      meta = make_fixture(args.out, name, spec)
      print(name, f"{_dir_size(os.path.join(args.out, name)) / 1024:.0f} KB", json.dumps(meta["sensitivity"]))
  if not only or WRAPPER["name"] in only:
    meta = make_wrapper_fixture(args.out, WRAPPER)
    print(WRAPPER["name"], f"{_dir_size(os.path.join(args.out, WRAPPER['name'])) / 1024:.0f} KB",
          json.dumps(meta["sensitivity"]))
  print("versions:", _versions())


if __name__ == "__main__":
  main()
