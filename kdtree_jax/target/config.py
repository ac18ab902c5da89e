"""The target's architecture: `TargetConfig`, a frozen dataclass built from a Hugging Face
config.json or a preset.

Every rope / eps / routing field is read from the file; nothing is a module-level constant.
Supported files: Kimi K2 / DeepSeek-V3 (`model_type` "kimi_k2" or "deepseek_v3") and the
K2.5 / K2.6 wrapper (`model_type` "kimi_k25", text model under `text_config`, weights
prefixed `language_model.`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("kimi_k2", "deepseek_v3")
WRAPPER_MODEL_TYPES = ("kimi_k25",)


@dataclasses.dataclass(frozen=True)
class YarnScaling:
  """YaRN rope scaling, exactly the fields of HF `rope_scaling` (type "yarn")."""

  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None  # None when the file leaves it out (HF semantics differ from 0)
  mscale_all_dim: float | None = None

  @property
  def cos_sin_factor(self) -> float:
    """HF `attention_factor`: multiplies cos and sin (1.0 for every Kimi config)."""
    if self.mscale and self.mscale_all_dim:
      return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
    return yarn_mscale(self.factor)


@dataclasses.dataclass(frozen=True)
class TargetConfig:
  """Kimi K2 / DeepSeek-V3 decoder shape. Letters: D hidden, H heads, R kv_lora_rank, P rope dim."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  moe_intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  q_lora_rank: int | None
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  n_routed_experts: int
  num_experts_per_tok: int
  n_shared_experts: int
  n_group: int
  topk_group: int
  norm_topk_prob: bool
  routed_scaling_factor: float
  first_k_dense_replace: int
  rms_norm_eps: float
  rope_theta: float
  rope_scaling: YarnScaling | None
  max_position_embeddings: int
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  pad_token_id: int | None = None
  # q_a_layernorm / kv_a_layernorm eps: HF and DeepSeek's reference build these with a fixed
  # 1e-6, not rms_norm_eps (config.json has no field for it).
  lora_norm_eps: float = 1e-6
  # Where the text model's weights live in the checkpoint ("" for K2, "language_model." for K2.5/6).
  weight_prefix: str = ""
  # Not in config.json: how this process holds and runs the routed experts.
  # num_local_experts: hold only experts [0, num_local_experts) of the n_routed_experts the router
  # scores (one GPU's share of an expert-parallel deployment, for benchmarks; pairs routed to other
  # experts contribute nothing here). None = all.
  num_local_experts: int | None = None
  # expert_backend: the grouped expert matmul: "auto" (our Mosaic kernel on a GPU where the shapes
  # suit it, else XLA), "pallas", "interpret" (the kernel on CPU), "xla".
  expert_backend: str = "auto"
  # moe_glue: the routing-to-kernel glue of a single-device MoE layer: "sorted" (top-k ids, pairs
  # sorted by comparisons, a gather-combine over K) or "dense" (one [T, E] selection mask; row
  # positions, work list and combine from it in fewer dependent reductions; small T only, else
  # "sorted" runs), or "auto": dense at one token (ar), sorted above (the faster of the two on
  # the H200 at each T). Same routing decisions either way.
  moe_glue: str = "auto"
  # lean_glue: above one token, the same glue's values in fewer launches and bytes (experts.py
  # `_lean_expert_ffn`: one index reduction less, the split-partial passes and the combine read
  # the live rows only); False keeps the fifth session's glue for the A/B. Measured on the H200
  # (one K2.6-share MoE layer, `gpu_measure.sh moe_layer`, results/h200/2026-12-01/
  # s6_moe_layer.log): T=16 235.5 vs 240.1 us with the routing kernel; at one token it was 1 us
  # slower (43.8 vs 42.8), so one token keeps the plain path whatever this says.
  lean_glue: bool = True
  # align_expert_rows_from: from this many tokens T (None: never), with lean_glue and where the
  # expert calls run R 8 work windows (the INT4 T=9 and T=65 classes), the sorted (token,
  # expert) rows are laid out with each expert's first row 8-aligned (`experts.aligned_rows`):
  # an expert of <= 8 rows is then one work item, not two where its rows would straddle a window
  # boundary (one dequantise of its weights less), for a larger x gather (up to 7 gap rows per
  # expert) and two more index kernels. Same values (bitwise). H100, one MoE layer of the K2.6
  # share in the decode layout (results/h100/2026-12-06/s21_align_layer.log): T=65 404.8 vs
  # 420.6 us (81 pairs on 36 experts: 36 items, not 41); T=9 128.5 vs 117.2 (its ~1 row per
  # expert never straddles; measured with a looser item bound than `work.num_items_aligned`).
  # Off by default (None) since the step disagreed: the 32-layer DDTree 64 graph loop at 46k
  # (every verify T=65), the two loops timed in alternation in one process (H100,
  # results/h100/2026-12-07/s25_row11_paired.log): aligned from T=33 13.189 ms/step vs None
  # 13.024 (median of 8 rounds; None faster in 8 of 8, ratio 0.987-0.993), on the collapsed
  # random model; on the zero-mean one (s27, s27_row17.log) aligned 18.308 vs None 18.348
  # (0.9979, inside an A/A's +-1.5%). A/B again:
  # `bench_k26_full --ab_loop_bench=target.align_expert_rows_from=33`.
  align_expert_rows_from: int | None = None
  # router_impl: the routing after the router logits (sigmoid, bias, top-k, weights): "xla" (a
  # few fused reductions), "pallas" (one Pallas kernel, `target/route_kernel.py`, where
  # n_group == 1 and T is small; elsewhere "xla" runs) or "auto": "pallas" on a GPU, else "xla"
  # (the kernel's interpret mode would only slow CPU runs). Same routing decisions either way;
  # H200 (s6_moe_layer.log): one MoE layer T=1 42.8 vs 46.8 us, T=16 240.1 vs 248.9; H100
  # (s20_route65.log) T=65 427.4 vs 443.2.
  router_impl: str = "auto"
  # shared_intermediate_size: the shared experts' FFN width held here (None = all of it,
  # moe_intermediate_size * n_shared_experts; a 1/S slice for one GPU's share in benchmarks).
  shared_intermediate_size: int | None = None
  # fold_norm_weights: target/pack.py's decode layout folds three RMSNorm gains into the one dot
  # that reads each norm (`pack.fold_norm_gains`): attn_norm into q_a | kv_a ("qkv_a_t_folded"),
  # the q LoRA norm into q_b ("q_b_t_folded") and the dense layer's mlp_norm into gate | up
  # ("gate_up_t_folded"); the forward then scales the dot's OUTPUT rows by the norm's
  # rsqrt(mean square + eps) instead of materialising the normalised input (a one-token step:
  # one elementwise kernel less per norm). A MoE layer's mlp_norm stays (its INT4 experts read
  # the normalised x; at one token see one_token_rows_first). Not the kv LoRA norm (its output
  # is the cache) nor the final norm (the lm_head is shared with the draft). The folds are pack
  # time (per-layer params unaffected). Not promoted (H200 s11 fused step, with the rows-first
  # MoE below then part of this flag: ar -1.4%, DDTree 15 +1.1%).
  fold_norm_weights: bool = False
  # one_token_rows_first: at one token (the MoE's one-token path) the experts' k rows of the
  # normalised x are broadcast FIRST and the router | shared dot reads row 0
  # (`moe._one_token_moe`): the normalise then has the broadcast as its only consumer and fuses
  # into it, where the normalise and the broadcast were two kernels (H100 s26 ar step: the
  # broadcast alone 2.6 us a MoE layer). The same values, so the same routing. Runtime (no
  # pack-time change). Until s27 part of fold_norm_weights. Default since s29 (H100 s28, the
  # 32-layer ar graph loop, paired rounds: 3.084 -> 3.072 ms/step, ratio 0.9950 [0.9847,
  # 0.9988], faster in 8 of 8; results/h100/2026-12-07/s27_rows_first_cmd.sh).
  one_token_rows_first: bool = True
  # mosaic_pdl: decode's Mosaic kernels (tree-verify attention, both INT4 expert calls) whose
  # tuning their API picks are built with Tuning.pdl (programmatic dependent launch:
  # griddepcontrol.wait before the first input read, launch_dependents after the last load;
  # pallas_kernels/pdl.py). Same values. Default off until a GPU A/B (notes/runtime.md, "PDL:
  # who waits": in XLA's graph the custom call is a traced child node, which may void it).
  mosaic_pdl: bool = False
  # expert_variants: overrides of the INT4 expert calls' promoted tunings in decode (verify and
  # ar steps; prefill keeps the defaults), by class: 'BOUND=GATED|DOWN;...' with BOUND a
  # `tuning.DEFAULT_VARIANTS` max_rows (8: T=1, 263: T=2..32, 520: T=33..65, none: more) and
  # the variants `tuning.apply_variant` names ('': none).
  # Runtime (no pack-time change): the in-step A/B of an expert-call form, e.g.
  # `bench_k26_full --ab_loop_bench='target.expert_variants=8=once+ismem+cat+il+a2+k128+p8|...'`.
  expert_variants: str = ""
  # int4_k_interleaved: target/pack.py's decode layout stores the INT4 routed stacks
  # pair-interleaved ("kpairs", `kpairs.pack_int4_k_pairs`) instead of K-packed ("kpack"), and
  # the expert calls then run the kernel's PRMT-free dequantise (Tuning.int4_k_interleaved,
  # variant `kpi`: the same bf16 values, -8 SASS per 64-column chunk and thread; deviceless).
  # The tuning follows the weights' layout (target/grouped_matmul.py). Pack time (per-layer
  # params are unaffected). On by default since the H200 A/B of 2026-12-05 (one run,
  # results/h200/2026-12-05/s11_moe_tune.log, the expert FFN's gated + down calls): T=65 (36
  # experts) 298.0 -> 286.8 us, 72.7 -> 75.6% of copy; T=16 53.3 -> 53.2, T=1 22.7 -> 22.8
  # (unchanged); bit-equal to kpack on the GPU (test_grouped_matmul_small_t, 4 cases).
  int4_k_interleaved: bool = True

  def __post_init__(self):
    if self.first_k_dense_replace > self.num_hidden_layers:
      raise ValueError(f"{self.first_k_dense_replace=} exceeds {self.num_hidden_layers=}")
    if self.n_routed_experts % self.n_group:
      raise ValueError(f"{self.n_routed_experts=} is not divisible by {self.n_group=}")
    if not 1 <= self.topk_group <= self.n_group:
      raise ValueError(f"{self.topk_group=} must be in [1, {self.n_group=}]")
    if self.num_experts_per_tok > self.n_routed_experts:
      raise ValueError(f"{self.num_experts_per_tok=} exceeds {self.n_routed_experts=}")
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"{self.qk_rope_head_dim=} must be even (rope rotates pairs)")
    if self.num_local_experts is not None and not 1 <= self.num_local_experts <= self.n_routed_experts:
      raise ValueError(f"{self.num_local_experts=} must be in [1, {self.n_routed_experts=}] or None")
    if self.expert_backend not in ("auto", "pallas", "interpret", "xla"):
      raise ValueError(f"{self.expert_backend=} must be one of auto, pallas, interpret, xla")
    if self.moe_glue not in ("auto", "sorted", "dense"):
      raise ValueError(f"{self.moe_glue=} must be 'auto', 'sorted' or 'dense'")
    if self.router_impl not in ("auto", "xla", "pallas"):
      raise ValueError(f"{self.router_impl=} must be 'auto', 'xla' or 'pallas'")
    if self.expert_variants:  # a typo fails here, not at the first trace on a GPU
      from pallas_kernels.grouped_matmul import tuning  # pylint: disable=import-outside-toplevel
      try:
        tuning.parse_overrides(self.expert_variants)
      except ValueError as ex:
        raise ValueError(f"{self.expert_variants=}: {ex}") from ex

  # ---- derived shapes -------------------------------------------------------------------
  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def cache_dim(self) -> int:
    """Width of one latent cache row: normalized c_kv (R) + rotated k_pe (P); 576 for K2."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def experts_held(self) -> int:
    """Routed experts in this process's parameter stacks (E_l of the stacked [E_l, D, F])."""
    return self.num_local_experts or self.n_routed_experts

  @property
  def num_dense_layers(self) -> int:
    return self.first_k_dense_replace

  @property
  def num_moe_layers(self) -> int:
    return self.num_hidden_layers - self.first_k_dense_replace

  @property
  def softmax_scale(self) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (as HF and DeepSeek)."""
    scale = self.qk_head_dim ** -0.5
    ys = self.rope_scaling
    if ys is not None and ys.mscale_all_dim:
      m = yarn_mscale(ys.factor, ys.mscale_all_dim)
      scale *= m * m
    return scale

  def replace(self, **kw) -> "TargetConfig":
    return dataclasses.replace(self, **kw)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """DeepSeek's `yarn_get_mscale`: 0.1 * mscale * ln(factor) + 1 for factor > 1, else 1."""
  if factor <= 1:
    return 1.0
  return 0.1 * mscale * math.log(factor) + 1.0


# ---- Hugging Face config.json -----------------------------------------------------------
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
    "rms_norm_eps", "max_position_embeddings",
)


def _opt_float(v) -> float | None:
  return None if v is None else float(v)


def _parse_rope(d: dict[str, Any]) -> tuple[float, YarnScaling | None]:
  """Reads rope_theta and rope_scaling (transformers v4 names) or rope_parameters (v5 names)."""
  params = d.get("rope_parameters") or {}
  scaling = d.get("rope_scaling") or (params if params.get("rope_type") not in (None, "default") else None)
  theta = d.get("rope_theta", params.get("rope_theta"))
  if theta is None:
    raise ValueError("config.json has no rope_theta (nor rope_parameters.rope_theta)")
  if not scaling:
    return float(theta), None
  kind = scaling.get("type", scaling.get("rope_type"))
  if kind != "yarn":
    raise ValueError(f"unsupported rope_scaling type {kind!r}; only 'yarn' (DeepSeek/Kimi) is implemented")
  for key in ("factor", "original_max_position_embeddings"):
    if key not in scaling:
      raise ValueError(f"rope_scaling is missing {key!r}: {scaling}")
  ys = YarnScaling(
      factor=float(scaling["factor"]),
      original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
      beta_fast=float(scaling.get("beta_fast", 32.0)),
      beta_slow=float(scaling.get("beta_slow", 1.0)),
      mscale=_opt_float(scaling.get("mscale")),
      mscale_all_dim=_opt_float(scaling.get("mscale_all_dim")),
  )
  return float(theta), ys


def config_from_hf_dict(raw: dict[str, Any]) -> TargetConfig:
  """Builds a TargetConfig from the parsed contents of a Hugging Face config.json."""
  model_type = raw.get("model_type")
  prefix = ""
  d = raw
  if model_type in WRAPPER_MODEL_TYPES:
    if "text_config" not in raw:
      raise ValueError(f"model_type {model_type!r} needs a 'text_config' section")
    d = raw["text_config"]
    prefix = "language_model."
    model_type = d.get("model_type", "deepseek_v3")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(
        f"unsupported model_type {raw.get('model_type')!r}; expected one of "
        f"{SUPPORTED_MODEL_TYPES + WRAPPER_MODEL_TYPES}")
  missing = [k for k in _REQUIRED if k not in d]
  if missing:
    raise ValueError(f"config.json is missing required fields: {missing}")
  if d.get("tie_word_embeddings", False):
    raise ValueError("tie_word_embeddings=True is not a Kimi/DeepSeek-V3 layout (untied lm_head expected)")
  if d.get("scoring_func", "sigmoid") != "sigmoid":
    raise ValueError(f"scoring_func {d['scoring_func']!r} unsupported; Kimi/DeepSeek-V3 use 'sigmoid'")
  if d.get("topk_method", "noaux_tc") != "noaux_tc":
    raise ValueError(f"topk_method {d['topk_method']!r} unsupported; expected 'noaux_tc'")
  theta, ys = _parse_rope(d)
  eos = d.get("eos_token_id", raw.get("eos_token_id"))
  if isinstance(eos, list):
    eos = eos[0]
  return TargetConfig(
      vocab_size=int(d["vocab_size"]),
      hidden_size=int(d["hidden_size"]),
      intermediate_size=int(d["intermediate_size"]),
      moe_intermediate_size=int(d["moe_intermediate_size"]),
      num_hidden_layers=int(d["num_hidden_layers"]),
      num_attention_heads=int(d["num_attention_heads"]),
      q_lora_rank=None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
      kv_lora_rank=int(d["kv_lora_rank"]),
      qk_nope_head_dim=int(d["qk_nope_head_dim"]),
      qk_rope_head_dim=int(d["qk_rope_head_dim"]),
      v_head_dim=int(d["v_head_dim"]),
      n_routed_experts=int(d["n_routed_experts"]),
      num_experts_per_tok=int(d["num_experts_per_tok"]),
      n_shared_experts=int(d.get("n_shared_experts") or 0),
      n_group=int(d.get("n_group") or 1),
      topk_group=int(d.get("topk_group") or 1),
      norm_topk_prob=bool(d.get("norm_topk_prob", True)),
      routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
      first_k_dense_replace=int(d.get("first_k_dense_replace", 0)),
      rms_norm_eps=float(d["rms_norm_eps"]),
      rope_theta=theta,
      rope_scaling=ys,
      max_position_embeddings=int(d["max_position_embeddings"]),
      bos_token_id=d.get("bos_token_id", raw.get("bos_token_id")),
      eos_token_id=eos,
      pad_token_id=d.get("pad_token_id", raw.get("pad_token_id")),
      weight_prefix=prefix,
  )


def load_hf_config(path: str) -> TargetConfig:
  """Reads `config.json` from a checkpoint directory (or the file itself)."""
  fname = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.exists(fname):
    raise FileNotFoundError(f"no config.json at {fname}")
  with open(fname) as f:
    return config_from_hf_dict(json.load(f))


def to_hf_dict(cfg: TargetConfig) -> dict[str, Any]:
  """The DeepSeek-V3 style config.json for `cfg` (used to write small test checkpoints)."""
  ys = cfg.rope_scaling
  return {
      "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
      "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
      "num_key_value_heads": cfg.num_attention_heads, "q_lora_rank": cfg.q_lora_rank,
      "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
      "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
      "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
      "n_shared_experts": cfg.n_shared_experts, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
      "norm_topk_prob": cfg.norm_topk_prob, "routed_scaling_factor": cfg.routed_scaling_factor,
      "first_k_dense_replace": cfg.first_k_dense_replace, "moe_layer_freq": 1,
      "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
      "rope_scaling": None if ys is None else {
          "type": "yarn", **{k: v for k, v in dataclasses.asdict(ys).items() if v is not None}},
      "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
      "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
      "pad_token_id": cfg.pad_token_id,
  }


# ---- presets ----------------------------------------------------------------------------
def kimi_k2_6() -> TargetConfig:
  """Kimi K2.6 text model (K2.5 `text_config` values; read the real config.json when you have it)."""
  return TargetConfig(
      vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
      num_hidden_layers=61, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384,
      num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
      routed_scaling_factor=2.827, first_k_dense_replace=1, rms_norm_eps=1e-5, rope_theta=50000.0,
      rope_scaling=YarnScaling(factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0,
                               beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
      max_position_embeddings=262144, bos_token_id=163584, eos_token_id=163585,
      pad_token_id=163839, weight_prefix="language_model.")


def tiny(**overrides) -> TargetConfig:
  """A few-layer model of the K2 architecture for tests and CPU demos (byte vocabulary)."""
  base = dict(
      vocab_size=264, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
      num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
      num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=True,
      routed_scaling_factor=2.5, first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=50000.0,
      rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=32, beta_fast=32.0,
                               beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
      max_position_embeddings=512, bos_token_id=256, eos_token_id=257, pad_token_id=258)
  base.update(overrides)
  return TargetConfig(**base)


def bench_k26(layers: int = 4) -> TargetConfig:
  """One GPU's share of K2.6 under 8-way TP/EP (8 heads, 48 experts, V/8, F/8), `layers` deep."""
  full = kimi_k2_6()
  return full.replace(num_hidden_layers=layers, num_attention_heads=8, n_routed_experts=48,
                      vocab_size=full.vocab_size // 8, intermediate_size=full.intermediate_size // 8,
                      weight_prefix="")


PRESETS = {"kimi_k2_6": kimi_k2_6, "tiny": tiny, "bench_k26": bench_k26}
