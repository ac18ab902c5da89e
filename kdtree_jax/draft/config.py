"""DFlash draft configuration: a frozen dataclass built from a DFlash config.json or a preset.

Reads both published formats: z-lab DFlash (`dflash_config` holds target_layer_ids,
mask_token_id, block_size; transformers v5 may put rope_theta under `rope_parameters`) and
SpecForge (top-level block_size / num_target_layers, `dflash_config` optional; target_layer_ids
default to `build_target_layer_ids`).

Attention fields follow the reference (z-lab dflash/model.py on transformers 4.57.1, see
notes/dflash_reference.md): the window is transformers' Qwen3Config rule (`sliding_window` only
when `use_sliding_window`; missing `layer_types` derived from `max_window_layers`), and every
layer is non-causal inside the block unless config.json sets `is_causal: true`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
  """SpecForge/z-lab default taps: round(1 + i*(n_t-4)/(n_d-1)), or [n_t//2] for one layer."""
  if num_draft_layers == 1:
    return (num_target_layers // 2,)
  span = num_target_layers - 4
  return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DraftConfig:
  """DFlash draft shape. Letters: D hidden, H heads, G kv heads, F ffn, V vocab."""

  hidden_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  intermediate_size: int
  rms_norm_eps: float
  rope_theta: float
  vocab_size: int
  block_size: int
  target_layer_ids: tuple[int, ...]
  mask_token_id: int | None
  layer_types: tuple[str, ...]
  sliding_window: int | None
  num_target_layers: int
  is_causal: bool | None = None  # None / False: non-causal in-block (the reference); True: causal
  output_multiplier: float = 1.0
  final_logit_softcapping: float | None = None

  def __post_init__(self):
    bad = sorted(set(self.layer_types) - {FULL, SLIDING})
    if bad:
      raise ValueError(f"unsupported draft layer_types {bad}; supported: {FULL}, {SLIDING}")
    if len(self.layer_types) != self.num_hidden_layers:
      raise ValueError(f"{len(self.layer_types)=} != {self.num_hidden_layers=}")
    if self.sliding_window is not None and self.sliding_window <= 0:
      raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"{self.num_attention_heads=} not a multiple of {self.num_key_value_heads=}")

  @property
  def n_taps(self) -> int:
    """Number of tapped target layers (fc input = n_taps * hidden_size)."""
    return len(self.target_layer_ids)

  def window(self, layer: int) -> int | None:
    """Sliding window w of one layer: keys with |q_pos - k_pos| < w (None: full attention).

    A sliding_attention layer without a window (use_sliding_window false) attends fully, as
    Qwen3DFlashAttention does when Qwen3Config drops the window.
    """
    return self.sliding_window if self.layer_types[layer] == SLIDING else None

  def causal(self, layer: int) -> bool:
    """Whether block queries see only earlier block keys in this layer.

    The reference sets is_causal=False in every layer (z-lab dflash/model.py:194, and
    dflash_generate passes is_causal=False, :118); only an explicit `is_causal: true` in
    config.json makes the block causal, in every layer alike.
    """
    del layer  # the same rule in every layer
    return bool(self.is_causal)

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any]) -> "DraftConfig":
    """Build from a parsed DFlash config.json (z-lab or SpecForge)."""
    arch = " ".join(d.get("architectures") or [])
    dc = d.get("dflash_config") or {}
    if "DFlash2" in arch or "conv_kernel_size" in dc:
      raise ValueError(f"DFlash2 drafts ({arch or 'conv/selector config'}) are not supported")
    get = lambda k, default=None: dc.get(k, d.get(k, default))
    n_layers = int(d["num_hidden_layers"])
    heads = int(d["num_attention_heads"])
    n_target = get("num_target_layers")
    ids = get("target_layer_ids")
    if ids is None:
      if n_target is None:
        raise ValueError("draft config needs target_layer_ids or num_target_layers")
      ids = build_target_layer_ids(int(n_target), n_layers)
    _warn_unused_window(d)
    return cls(
        hidden_size=int(d["hidden_size"]),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads", heads)),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
        intermediate_size=int(d["intermediate_size"]),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(d),
        vocab_size=int(d["vocab_size"]),
        block_size=int(get("block_size", 16)),
        target_layer_ids=tuple(int(i) for i in ids),
        mask_token_id=None if get("mask_token_id") is None else int(get("mask_token_id")),
        layer_types=_layer_types(d, n_layers),
        sliding_window=_qwen3_window(d),
        num_target_layers=int(n_target if n_target is not None else max(ids) + 1),
        is_causal=d.get("is_causal"),
        output_multiplier=float(get("output_multiplier", 1.0)),
        final_logit_softcapping=get("final_logit_softcapping"),
    )

  @classmethod
  def from_json(cls, path: str) -> "DraftConfig":
    """Read `config.json` (a file, or a directory holding it)."""
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    with open(path) as f:
      return cls.from_hf_dict(json.load(f))

  def to_hf_dict(self) -> dict[str, Any]:
    """config.json in the z-lab layout (also readable by SpecForge)."""
    d = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3",
        hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
        num_attention_heads=self.num_attention_heads,
        num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
        intermediate_size=self.intermediate_size, hidden_act="silu",
        rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, vocab_size=self.vocab_size,
        attention_bias=False, tie_word_embeddings=False,
        block_size=self.block_size, num_target_layers=self.num_target_layers,
        layer_types=list(self.layer_types), sliding_window=self.sliding_window,
        use_sliding_window=self.sliding_window is not None,
        dflash_config=dict(target_layer_ids=list(self.target_layer_ids),
                           mask_token_id=self.mask_token_id, block_size=self.block_size),
    )
    if self.is_causal is not None:
      d["is_causal"] = self.is_causal
    if self.output_multiplier != 1.0:
      d["dflash_config"]["output_multiplier"] = self.output_multiplier
    if self.final_logit_softcapping is not None:
      d["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
    return d

  @classmethod
  def tiny(cls, **overrides) -> "DraftConfig":
    """Small preset for CPU tests."""
    base = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0,
        vocab_size=64, block_size=4, target_layer_ids=(0, 2, 3), mask_token_id=63,
        layer_types=(FULL, FULL), sliding_window=None, num_target_layers=4,
    )
    base.update(overrides)
    return cls(**base)


def _qwen3_window(d: dict[str, Any]) -> int | None:
  """transformers 4.57.1 Qwen3Config: sliding_window (default 4096) only if use_sliding_window."""
  if not d.get("use_sliding_window", False):
    return None
  window = d.get("sliding_window", 4096)
  return None if window is None else int(window)


def _warn_unused_window(d: dict[str, Any]) -> None:
  """Sliding layers + a sliding_window the reference ignores (use_sliding_window false)."""
  if SLIDING in (d.get("layer_types") or ()) and d.get("sliding_window") and _qwen3_window(d) is None:
    warnings.warn(f"draft config has sliding_attention layers and sliding_window="
                  f"{d['sliding_window']} but use_sliding_window is false: like the reference "
                  "(transformers Qwen3Config) these layers attend without a window; set "
                  "use_sliding_window: true in config.json to apply it")


def _layer_types(d: dict[str, Any], n_layers: int) -> tuple[str, ...]:
  """config layer_types, else Qwen3Config's: sliding from max_window_layers (28) on, if windowed."""
  if d.get("layer_types"):
    return tuple(d["layer_types"])
  first_sliding = int(d.get("max_window_layers", 28))
  windowed = _qwen3_window(d) is not None
  return tuple(SLIDING if windowed and i >= first_sliding else FULL for i in range(n_layers))


def _rope_theta(d: dict[str, Any]) -> float:
  """rope_theta from the top level or `rope_parameters`; only the default rope is supported."""
  rp = d.get("rope_parameters") or {}
  rs = d.get("rope_scaling") or {}
  kind = rs.get("rope_type", rs.get("type")) or rp.get("rope_type") or "default"
  if kind != "default":
    raise ValueError(f"draft rope_type {kind!r} is not supported (only 'default')")
  return float(d.get("rope_theta", rp.get("rope_theta", 10000.0)))
