"""Per-device memory plan of a sharded run: parameters, caches, verify-step activations.

  python scripts/plan_memory.py --config configs/kimi_k2_6.py --mesh tensor=8
  python scripts/plan_memory.py --config configs/kimi_k2_6.py --mesh all --max_len 131072
  python scripts/plan_memory.py --config configs/bench_k26_full.py --mesh data=1  # one GPU's share

Abstract only (`jax.eval_shape` + the sharding rules over an AbstractMesh): no memory is
allocated and any machine can plan for 8 x H200. Parameters in the config's dtype, and with
INT4 routed experts (4 bits + a bf16 scale per 32 weights, compressed-tensors; a config whose
params already hold INT4 stacks is counted as it is, int4 at half a byte). Caches: the
target latent cache (per layer [B, max_len + N, C]) and the draft cache, in the config's dtype.
"""

import json
import math
import os

import jax
from absl import flags

from kdtree_jax import cli, loader, runtime, sharding
from kdtree_jax.target.cache import LatentCache
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.draft import model as draft_model

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "kimi_k2_6.py")
_CONFIG = cli.define_config(DEFAULT_CONFIG, "Run config (configs/*.py).")
_MESH = flags.DEFINE_string("mesh", None, "'AXIS=N,...', or 'all' (tensor=8, expert=8, "
                            "tensor=2,expert=4); default: the config's mesh.")
_MAX_LEN = flags.DEFINE_integer("max_len", None, "Context length (default: the config's).")
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences decoded together.")
_DRAFT = flags.DEFINE_string("draft_preset", "bench_k26", "Draft preset when the config has none.")
_HBM = flags.DEFINE_float("hbm_gb", 141.0, "Device memory, GB (1e9 bytes): H200 = 141.")
_HEADROOM = flags.DEFINE_float("headroom", 0.10, "Fraction of HBM kept free (XLA scratch, "
                               "fragmentation, CUDA context).")
_JSON = flags.DEFINE_string("json_out", None, "Write the plan as JSON here.")
runtime.define_flags()

GB = 1e9
INT4_BYTES = 0.5 + 2 / 32  # per weight: a nibble + one bf16 scale per group of 32
ROUTED = ("layers/moe/gate", "layers/moe/up", "layers/moe/down")


def per_device_bytes(tree, axes_fn, mesh, routed_bytes=None):
  """Sum over leaves of one device's shard bytes (routed experts at `routed_bytes` per weight)."""
  total = 0.0
  for path, x in jax.tree.flatten_with_path(tree)[0]:
    spec = sharding.spec(axes_fn(path, x.ndim), x.shape, mesh)
    count = math.prod(jax.sharding.NamedSharding(mesh, spec).shard_shape(x.shape))
    routed = routed_bytes is not None and sharding.path_key(path) in ROUTED
    total += count * (routed_bytes if routed else jax.dtypes.itemsize_bits(x.dtype) / 8)
  return total


class _Section(dict):
  """Attribute access over a dict (stands in for a ConfigDict section)."""

  __getattr__ = dict.__getitem__


def abstract_models(c, dtype):
  """(tcfg, dcfg, target params, draft params), the params as ShapeDtypeStructs."""
  box = {}
  draft = c.draft
  if not (draft.preset or draft.checkpoint):
    draft = _Section(draft, preset=_DRAFT.value)

  def build():
    box["tcfg"], tp = loader.load_target(c.target, dtype)
    box["dcfg"], dp = loader.load_draft(draft, box["tcfg"], dtype)
    return tp, dp

  tp, dp = jax.eval_shape(build)
  return box["tcfg"], box["dcfg"], tp, dp


def activation_bytes(tcfg, dcfg, spec, batch, max_len, mesh):
  """Peak live activations of one verify step, per device (a documented estimate, not measured).

  Largest of: one layer of the XLA-reference tree attention (f32 copy of the layer's cache
  [B, L, C] + scores and probabilities [B, N, H_l, L] f32; the Pallas kernel needs neither),
  one MoE layer ([T*K, D] gathered tokens and f32 outputs, [T*K, F_l] x3); plus the f32 logits
  [B, N, V] (sharded and gathered), the taps and a few [T, D] f32 residuals.
  """
  sizes = dict(mesh.shape)
  b = max(1, batch // sizes["data"])
  n, length, t = spec.verify_width, max_len + spec.verify_width, b * spec.verify_width
  h_l = max(1, tcfg.num_attention_heads // (sizes["expert"] * sizes["tensor"]))
  attn = 4 * b * length * tcfg.cache_dim + 2 * 4 * b * n * h_l * length
  k, d = tcfg.num_experts_per_tok, tcfg.hidden_size
  moe = t * k * (d * 2 + d * 4 + 3 * 4 * tcfg.moe_intermediate_size // sizes["tensor"])
  logits = 2 * 4 * t * tcfg.vocab_size
  taps = 4 * t * d * dcfg.n_taps
  return max(attn, moe) + logits + taps + 8 * 4 * t * d


def runtime_bytes(c, tcfg, dcfg, mesh, max_len):
  """Per-device target latent cache, draft cache and activations at `max_len`."""
  dtype, b = loader.DTYPES[c.dtype], _BATCH.value
  spec = SpecConfig(mode=c.mode, budget=c.budget, block_size=dcfg.block_size)
  lat = jax.eval_shape(lambda: LatentCache.zeros(tcfg, b, max_len + spec.verify_width, dtype))
  dc = jax.eval_shape(lambda: draft_model.init_draft_cache(dcfg, b, max_len + spec.commit_width,
                                                           dtype))
  return {"target_cache": per_device_bytes(lat, sharding.state_axes, mesh),
          "draft_cache": per_device_bytes(dc, sharding.state_axes, mesh),
          "activations": activation_bytes(tcfg, dcfg, spec, b, max_len, mesh)}


def longest_context(c, tcfg, dcfg, mesh, params, usable):
  """Largest max_len (a multiple of 1024, <= max_position_embeddings) that fits; 0 if none."""
  lo, hi = 0, tcfg.max_position_embeddings // 1024
  while lo < hi:
    mid = (lo + hi + 1) // 2
    fits = params + sum(runtime_bytes(c, tcfg, dcfg, mesh, mid * 1024).values()) <= usable
    lo, hi = (mid, hi) if fits else (lo, mid - 1)
  return lo * 1024


def token_capacity(c, tcfg, dcfg, mesh, params, usable):
  """Context rows that fit per sequence ignoring max_position_embeddings (linear in max_len)."""
  r0, r1 = (sum(runtime_bytes(c, tcfg, dcfg, mesh, n).values()) for n in (0, 1 << 20))
  return max(0, int((usable - params - r0) / ((r1 - r0) / (1 << 20))))


def plan(c, models_abstract, mesh_spec, max_len):
  """One mesh's per-device plan (bytes), fit verdicts and longest context."""
  tcfg, dcfg, tp, dp = models_abstract
  mesh = sharding.abstract_mesh(mesh_spec)
  pax = lambda p, _: sharding.param_axes(p)
  row = {"mesh": mesh_spec, "max_len": max_len, "batch": _BATCH.value,
         "target_params": per_device_bytes(tp, pax, mesh),
         "target_params_int4": per_device_bytes(tp, pax, mesh, INT4_BYTES),
         "draft_params": per_device_bytes(dp, pax, mesh),
         **runtime_bytes(c, tcfg, dcfg, mesh, max_len)}
  usable = _HBM.value * GB * (1 - _HEADROOM.value)
  runtime = row["target_cache"] + row["draft_cache"] + row["activations"]
  for name, key in (("bf16", "target_params"), ("int4", "target_params_int4")):
    params = row[key] + row["draft_params"]
    row[f"total_{name}"] = params + runtime
    row[f"fits_{name}"] = params + runtime <= usable
    row[f"max_len_{name}"] = longest_context(c, tcfg, dcfg, mesh, params, usable)
    row[f"kv_tokens_{name}"] = token_capacity(c, tcfg, dcfg, mesh, params, usable)
  row["usable"] = usable
  return row


def print_table(rows):
  cols = [("mesh", "mesh", "s"), ("target_params", "params bf16", "g"),
          ("target_params_int4", "params int4", "g"), ("draft_params", "draft", "g"),
          ("target_cache", "latent cache", "g"), ("draft_cache", "draft cache", "g"),
          ("activations", "activ.", "g"), ("total_bf16", "total bf16", "g"),
          ("total_int4", "total int4", "g"), ("max_len_bf16", "max ctx bf16", "d"),
          ("max_len_int4", "max ctx int4", "d"), ("kv_tokens_int4", "rows int4", "d")]
  print(" | ".join(f"{h:>12}" for _, h, _ in cols))
  for r in rows:
    cells = [f"{r[k]:>12}" if t == "s" else f"{r[k]:>12d}" if t == "d" else f"{r[k] / GB:>10.2f}GB"
             for k, _, t in cols]
    print(" | ".join(cells))


def main(argv):
  del argv
  c = cli.load_config(_CONFIG, "configs/kimi_k2_6.py")
  max_len = _MAX_LEN.value or c.max_len
  mesh = _MESH.value or c.get("mesh", "") or "tensor=8"
  meshes = ["tensor=8", "expert=8", "tensor=2,expert=4"] if mesh == "all" else [mesh]
  abstract = abstract_models(c, loader.DTYPES[c.dtype])
  rows = [plan(c, abstract, m, max_len) for m in meshes]
  usable = rows[0]["usable"]
  print(f"per-device bytes, batch={_BATCH.value} max_len={max_len} dtype={c.dtype} "
        f"mode={c.mode} budget={c.budget}; usable {usable / GB:.1f} of {_HBM.value:.0f} GB "
        f"({_HEADROOM.value:.0%} headroom)")
  print_table(rows)
  for r in rows:
    print(f"{r['mesh']}: bf16 {'fits' if r['fits_bf16'] else 'does NOT fit'}, "
          f"int4 experts {'fit' if r['fits_int4'] else 'do NOT fit'} at max_len={max_len}")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
