"""Writes DFlash draft fixtures: random-weight checkpoints + the reference's block logits.

The reference is z-lab's published inference code (github.com/z-lab/dflash, dflash/model.py:
`DFlashDraftModel.forward` driven by `dflash_generate`, on transformers 4.57.1 as its
pyproject pins, through the flash-attention path its benchmark picks on a GPU). This script
holds a small torch port of that forward written here (see notes/dflash_reference.md for the
line-by-line rules it follows): per draft call, K/V = [cached ctx ; new ctx ; block], the cache
cropped back to the block start after the call, `is_causal=False` in every layer, and the
sliding window applied the way flash-attn applies transformers' `window_size=(w-1, w-1)`
(bottom-right aligned, both sides), only in layers whose Qwen3Config window is set.

Each fixture directory holds config.json + model.safetensors (the exact z-lab/HF layout: the
torch module names are the reference's) and reference.npz:
  embed [V, D], lm_head [V, D] (the target's, HF [out, in]), taps [B, N, n_taps*D],
  prompt_len [B], counts [K, B] (ctx tokens each draft call adds; counts[0] = prompt_len),
  bonus [K, B], logits [K, B, S, V] (float64 forward, stored float32) for all S block positions.
Plus meta.json: versions, and how far the logits move under the earlier rules (causal sliding
layers, left-only window), to show the fixtures tell them apart.

Needs torch + numpy + safetensors (not transformers):
  .venv311/bin/python scripts/make_dflash_fixtures.py --out tests/fixtures/dflash
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import safetensors
import torch
from safetensors.torch import save_file
from torch import nn

TAPS = 3
BASE = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=32,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
            hidden_act="silu", rms_norm_eps=1e-6, vocab_size=64, attention_bias=False,
            tie_word_embeddings=False, num_target_layers=8)

# name -> config.json overrides, row prompt lengths, per-step accepted counts (per row), seed
FIXTURES = {
    "full_b8": dict(cfg=dict(num_hidden_layers=2, rope_theta=10000.0, block_size=8,
                             layer_types=["full_attention"] * 2),
                    prompts=[11, 6], steps=[[3, 8], [1, 5], [8, 2]], seed=1),
    "mixed_window5_b16": dict(
        cfg=dict(num_hidden_layers=3, num_key_value_heads=1, block_size=16,
                 rope_parameters=dict(rope_type="default", rope_theta=50000.0),
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 use_sliding_window=True, sliding_window=5),
        prompts=[20, 9], steps=[[4, 16], [1, 3], [16, 7]], seed=2),
    "derived_window12_b8": dict(  # no layer_types: Qwen3Config derives them from max_window_layers
        cfg=dict(num_hidden_layers=2, rope_theta=1e6, block_size=8, use_sliding_window=True,
                 sliding_window=12, max_window_layers=1),
        prompts=[17, 13], steps=[[2, 8], [5, 1], [8, 8]], seed=3),
    "sliding_unused_b16": dict(  # layer_types say sliding, use_sliding_window false: no window
        cfg=dict(num_hidden_layers=2, rope_theta=10000.0, block_size=16,
                 layer_types=["sliding_attention"] * 2, use_sliding_window=False, sliding_window=4),
        prompts=[10, 14], steps=[[6, 2], [3, 16]], seed=4),
}


def qwen3_windows(cfg: dict) -> list:
  """Per-layer window as transformers 4.57.1 Qwen3Config + Qwen3DFlashAttention resolve it."""
  window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
  types = cfg.get("layer_types") or [
      "sliding_attention" if window is not None and i >= cfg.get("max_window_layers", 28)
      else "full_attention" for i in range(cfg["num_hidden_layers"])]
  return [window if t == "sliding_attention" else None for t in types]


def rope_theta(cfg: dict) -> float:
  return cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))


class RMSNorm(nn.Module):
  """Qwen3RMSNorm: variance in f32, weight times the input-dtype normalised x."""

  def __init__(self, dim, eps):
    super().__init__()
    self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

  def forward(self, x):
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * y.to(x.dtype)


def rotate_half(x):
  half = x.shape[-1] // 2
  return torch.cat([-x[..., half:], x[..., :half]], -1)


def cos_sin(pos, head_dim, theta, dtype):
  """Default rope tables [1, L, E] for integer positions (cat(freqs, freqs) layout)."""
  inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
  ang = pos.to(torch.float64)[:, None] * inv[None]
  emb = torch.cat([ang, ang], -1)
  return emb.cos().to(dtype)[None], emb.sin().to(dtype)[None]


def flash_window_mask(s, l, window, flags):
  """Visible [S, L] for flash-attn, non-causal, window_size (w-1, w-1), bottom-right aligned.

  transformers passes window_size only when L > w; flash-attn keeps key j for query i when
  i + L - S - (w-1) <= j <= i + L - S + (w-1). `flags` re-creates earlier rules for meta.json.
  """
  i = torch.arange(s)[:, None] + (l - s)
  j = torch.arange(l)[None, :]
  ok = torch.ones(s, l, dtype=torch.bool)
  if window is not None and l > window:
    ok &= j >= i - (window - 1)
    if not flags.get("left_only"):
      ok &= j <= i + (window - 1)
  if window is not None and flags.get("causal_sliding"):
    ok &= j <= i
  return ok


class Attention(nn.Module):
  """Qwen3DFlashAttention: q from the block, k/v from [ctx ; block], k_norm on both, rope."""

  def __init__(self, cfg, window):
    super().__init__()
    D, H, G, E = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                  cfg["head_dim"])
    self.q_proj, self.o_proj = nn.Linear(D, H * E, bias=False), nn.Linear(H * E, D, bias=False)
    self.k_proj, self.v_proj = nn.Linear(D, G * E, bias=False), nn.Linear(D, G * E, bias=False)
    self.q_norm, self.k_norm = RMSNorm(E, cfg["rms_norm_eps"]), RMSNorm(E, cfg["rms_norm_eps"])
    self.H, self.G, self.E, self.window = H, G, E, window

  def forward(self, x, ctx, cos, sin, cache, flags):
    B, S, _ = x.shape
    q = self.q_norm(self.q_proj(x).view(B, S, self.H, self.E)).transpose(1, 2)
    src = torch.cat([ctx, x], 1)
    k = self.k_norm(self.k_proj(src).view(B, src.shape[1], self.G, self.E)).transpose(1, 2)
    v = self.v_proj(src).view(B, src.shape[1], self.G, self.E).transpose(1, 2)
    q = q * cos[:, None, -S:] + rotate_half(q) * sin[:, None, -S:]
    k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
    cache[0], cache[1] = k, v
    k = k.repeat_interleave(self.H // self.G, 1)
    v = v.repeat_interleave(self.H // self.G, 1)
    scores = q @ k.transpose(2, 3) * self.E ** -0.5
    ok = flash_window_mask(S, k.shape[2], self.window, flags)
    p = torch.softmax(scores.masked_fill(~ok, float("-inf")), -1)
    return self.o_proj((p @ v).transpose(1, 2).reshape(B, S, self.H * self.E))


class MLP(nn.Module):
  def __init__(self, cfg):
    super().__init__()
    D, F = cfg["hidden_size"], cfg["intermediate_size"]
    self.gate_proj, self.up_proj = nn.Linear(D, F, bias=False), nn.Linear(D, F, bias=False)
    self.down_proj = nn.Linear(F, D, bias=False)

  def forward(self, x):
    return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
  """Qwen3DFlashDecoderLayer: pre-norm attention over [ctx ; block], pre-norm MLP."""

  def __init__(self, cfg, window):
    super().__init__()
    eps = cfg["rms_norm_eps"]
    self.self_attn, self.mlp = Attention(cfg, window), MLP(cfg)
    self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
    self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)

  def forward(self, x, ctx, cos, sin, cache, flags):
    x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, cache, flags)
    return x + self.mlp(self.post_attention_layernorm(x))


class Draft(nn.Module):
  """DFlashDraftModel: fc + hidden_norm on the taps, the layers, the final norm."""

  def __init__(self, cfg):
    super().__init__()
    D, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    self.layers = nn.ModuleList(Layer(cfg, w) for w in qwen3_windows(cfg))
    self.fc = nn.Linear(TAPS * D, D, bias=False)
    self.hidden_norm, self.norm = RMSNorm(D, eps), RMSNorm(D, eps)
    self.cfg = cfg

  def forward(self, positions, noise, taps, caches, flags):
    """positions cover [new ctx ; block], as dflash_generate passes them."""
    ctx = self.hidden_norm(self.fc(taps))
    cos, sin = cos_sin(positions, self.cfg["head_dim"], rope_theta(self.cfg), noise.dtype)
    x = noise
    for layer, cache in zip(self.layers, caches):
      x = layer(x, ctx, cos, sin, cache, flags)
    return self.norm(x)


def generate_row(model, embed, head, taps, prompt_len, counts, bonus, flags):
  """dflash_generate's draft calls for one row: ctx grows by counts[k], cache cropped to start."""
  S = model.cfg["block_size"]
  mask_id = model.cfg["dflash_config"]["mask_token_id"]
  caches = [[taps.new_zeros(1, model.cfg["num_key_value_heads"], 0, model.cfg["head_dim"])] * 2
            for _ in model.layers]
  start, out = 0, []
  for k, count in enumerate(counts):
    new = taps[None, start:start + count]
    start += count
    block = torch.full((1, S), mask_id, dtype=torch.long)
    block[0, 0] = int(bonus[k])
    positions = torch.arange(start - count, start + S)
    hidden = model(positions, embed[block], new, caches, flags)
    out.append((hidden @ head.T)[0])
    for cache in caches:  # past_key_values_draft.crop(start)
      cache[0], cache[1] = cache[0][:, :, :start], cache[1][:, :, :start]
  assert start == prompt_len + sum(counts[1:])
  return torch.stack(out)


def randomize(model, rng):
  """Linears N(0, 1/fan_in), norm weights 1 + N(0, 0.2); rounded to f32 (what gets stored)."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      std = 0.2 if name.endswith("norm.weight") else p.shape[-1] ** -0.5
      base = 1.0 if name.endswith("norm.weight") else 0.0
      p.copy_(torch.from_numpy(base + std * rng.standard_normal(p.shape).astype(np.float32)))


def row_counts(spec):
  """[K, B] ctx tokens each call adds: the prompt first, then accepted + 1 per step."""
  return np.array([spec["prompts"]] + spec["steps"], np.int32)


def reference_logits(model, arrays, flags=None):
  """[K, B, S, V] float64 logits of the reference port for every row."""
  f64 = lambda a: torch.from_numpy(np.asarray(a, np.float64))
  embed, head = f64(arrays["embed"]), f64(arrays["lm_head"])
  rows = [generate_row(model, embed, head, f64(arrays["taps"][b]), int(arrays["prompt_len"][b]),
                       [int(c) for c in arrays["counts"][:, b]], arrays["bonus"][:, b], flags or {})
          for b in range(arrays["taps"].shape[0])]
  return torch.stack(rows, 1).numpy()


def make_inputs(cfg, spec, rng):
  counts = row_counts(spec)
  D, V = cfg["hidden_size"], cfg["vocab_size"]
  n = int(counts.sum(0).max())
  return dict(
      embed=rng.standard_normal((V, D)).astype(np.float32),
      lm_head=(rng.standard_normal((V, D)) * D ** -0.5).astype(np.float32),
      taps=rng.standard_normal((counts.shape[1], n, TAPS * D)).astype(np.float32),
      prompt_len=counts[0].copy(), counts=counts,
      bonus=rng.integers(0, V - 1, size=counts.shape).astype(np.int32))


def check_one_shot(model, arrays, logits):
  """The last call, redone with the whole ctx at once and no cache, gives the same logits."""
  f64 = lambda a: torch.from_numpy(np.asarray(a, np.float64))
  counts = arrays["counts"]
  for b in range(counts.shape[1]):
    total = int(counts[:, b].sum())
    one = generate_row(model, f64(arrays["embed"]), f64(arrays["lm_head"]), f64(arrays["taps"][b]),
                       total, [total], arrays["bonus"][-1:, b], {})
    assert np.abs(one[0].numpy() - logits[-1, b]).max() < 1e-9 * np.abs(logits).max()


def windows_ignoring_flag(model, arrays):
  """Logits if `sliding_window` applied to sliding layers even without use_sliding_window."""
  cfg = model.cfg
  for layer, kind in zip(model.layers, cfg.get("layer_types") or []):
    if kind == "sliding_attention":
      layer.self_attn.window = cfg.get("sliding_window")
  logits = reference_logits(model, arrays)
  for layer, window in zip(model.layers, qwen3_windows(cfg)):
    layer.self_attn.window = window
  return logits


def rel_l2(a, b):
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def build(name, spec, out_root):
  """Writes one fixture directory; returns its meta dict."""
  rng = np.random.default_rng(spec["seed"])
  cfg = dict(BASE, **spec["cfg"])
  cfg["dflash_config"] = dict(target_layer_ids=[1, 4, 6], mask_token_id=cfg["vocab_size"] - 1,
                              block_size=cfg["block_size"])
  model = Draft(cfg)
  randomize(model, rng)
  out = os.path.join(out_root, name)
  os.makedirs(out, exist_ok=True)
  save_file({k: v.contiguous() for k, v in model.state_dict().items()},
            os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
  arrays = make_inputs(cfg, spec, rng)
  model = model.double()
  logits = reference_logits(model, arrays)
  np.savez_compressed(os.path.join(out, "reference.npz"), logits=logits.astype(np.float32), **arrays)
  check_one_shot(model, arrays, logits)
  sens = {k: rel_l2(reference_logits(model, arrays, {k: True}), logits)
          for k in ("causal_sliding", "left_only")}
  sens["window_without_use_sliding_window"] = rel_l2(windows_ignoring_flag(model, arrays), logits)
  meta = dict(name=name, windows=qwen3_windows(cfg), sensitivity=sens,
              versions=dict(torch=torch.__version__, numpy=np.__version__,
                            safetensors=safetensors.__version__),
              reference="github.com/z-lab/dflash dflash/model.py @ 44947fb, transformers 4.57.1 "
                        "flash_attention_2 path (see notes/dflash_reference.md)")
  with open(os.path.join(out, "meta.json"), "w") as f:
    json.dump(meta, f, indent=2)
  return meta


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="tests/fixtures/dflash")
  ap.add_argument("--only", default="", help="one fixture name")
  args = ap.parse_args()
  torch.set_grad_enabled(False)
  for name, spec in FIXTURES.items():
    if args.only in ("", name):
      meta = build(name, spec, args.out)
      print(name, "windows", meta["windows"], "sensitivity", meta["sensitivity"])


if __name__ == "__main__":
  main()
