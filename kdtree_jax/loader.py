"""Loads what a run config names: the target + draft `Pair` (checkpoints or random presets) and
the tokenizer."""

import dataclasses
import os

import jax
import jax.numpy as jnp

from kdtree_jax.target import config as model_config
from kdtree_jax import bench_models, sharding
from kdtree_jax import orbax_io
from kdtree_jax.target.checkpoint import load_hf_checkpoint
from kdtree_jax.cli import DataError, UsageError
from kdtree_jax.draft.checkpoint import load_dflash_checkpoint
from kdtree_jax.draft.config import DraftConfig
from kdtree_jax.draft.model import init_draft_params, pack_for_decode
from kdtree_jax.pair import Pair
from kdtree_jax.target.pack import pack_for_decode as pack_target
from kdtree_jax.target.params import init_params
from kdtree_jax.tokenizer import ByteTokenizer, load_tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve_checkpoint(path: str, kind: str) -> str:
  """A checkpoint dir as given, or relative to the repo root (shipped `checkpoints/...`)."""
  for cand in (path, os.path.join(REPO_ROOT, path)):
    if os.path.isdir(cand):
      return cand
  for cand in (path, os.path.join(REPO_ROOT, path)):
    if os.path.exists(cand):
      raise DataError(cand, f"is a file, not a directory; --config.{kind}.checkpoint names the "
                      "checkpoint directory (config.json + *.safetensors, or orbax)")
  raise DataError(path, f"{kind} checkpoint directory does not exist (looked in the current "
                  f"directory and in {REPO_ROOT}); fix --config.{kind}.checkpoint")


def check_checkpoint_dir(path: str, kind: str) -> str:
  """A directory that looks like a HF (config.json + *.safetensors) or orbax checkpoint."""
  names = os.listdir(path)
  if orbax_io.is_orbax_dir(path):
    return path
  if not names:
    raise DataError(path, f"{kind} checkpoint directory is empty; --config.{kind}.checkpoint "
                    "needs config.json + *.safetensors (HF) or an orbax directory from "
                    "scripts/convert_checkpoint.py")
  if orbax_io.PARAMS_DIR in names and "config.json" not in names:
    raise DataError(path, f"has {orbax_io.PARAMS_DIR}/ but no {orbax_io.MARKER}: an orbax save "
                    "that did not finish; convert it again with scripts/convert_checkpoint.py")
  weights = [n for n in names if n.endswith(".safetensors")]
  missing = [want for want, ok in (("config.json", "config.json" in names),
                                   ("*.safetensors", bool(weights))) if not ok]
  if missing:
    raise DataError(path, f"{kind} checkpoint directory has no {' and no '.join(missing)} "
                    f"(it holds {sorted(names)[:5]}); --config.{kind}.checkpoint needs a HF "
                    "or orbax checkpoint directory")
  return path


def _dtype(name: str):
  if name not in DTYPES:
    raise UsageError("dtype", f"{name!r} must be one of {', '.join(DTYPES)}")
  return DTYPES[name]


def _init(init_fn, mesh, key):
  """init_fn(key), born sharded by the rules when a mesh is given (never whole on one device)."""
  return init_fn(key) if mesh is None else sharding.init_sharded(init_fn, mesh, key)


def _restore_orbax(path, kind, dtype, mesh):
  """(config, params) of an orbax directory written by scripts/convert_checkpoint.py."""
  found = orbax_io.read_marker(path)["kind"]
  if found != kind:
    raise ValueError(f"{path!r} holds a {found} checkpoint but is configured as the {kind}")
  return orbax_io.restore_params(path, mesh=mesh, dtype=dtype)


def load_target_for_decode(c, dtype, mesh=None):
  """load_target, the params in target.pack's decode layout without a mesh (one dot for q_a |
  kv_a, gate | up, router | shared gate | up per layer); per-layer weights under a mesh."""
  tcfg, tparams = load_target(c, dtype, mesh)
  return tcfg, tparams if mesh is not None else pack_target(tcfg, tparams, donate_experts=True)


def load_target(c, dtype, mesh=None):
  """A HF or orbax checkpoint dir, or a random-init preset (`tiny`, `kimi_k2_6`); on `mesh`."""
  if c.checkpoint:
    path = resolve_checkpoint(c.checkpoint, "target")
    if orbax_io.is_orbax_dir(path):
      return _restore_orbax(path, "target", dtype, mesh)
    put = None if mesh is None else sharding.loader_put(mesh, dtype)
    return load_hf_checkpoint(path, dtype=dtype, put=put)
  if c.preset in bench_models.TARGET_PRESETS:  # one GPU's share of K2.6 (benchmarks)
    return bench_models.load_target(c, dtype, mesh)
  if c.preset not in model_config.PRESETS:
    raise UsageError("target.preset", f"unknown preset {c.preset!r}; choose one of "
                     f"{', '.join(model_config.PRESETS)} or set --config.target.checkpoint")
  kw = {"layers": c.layers} if "layers" in c else {}
  cfg = model_config.PRESETS[c.preset](**kw)
  init = lambda key: init_params(key, cfg, dtype, std=0.02)
  return cfg, _init(init, mesh, jax.random.key(c.seed))


def load_draft(c, tcfg, dtype, mesh=None):
  """A DFlash (HF or orbax) checkpoint directory, a random `tiny` draft for the target, or none."""
  if c.checkpoint:
    path = resolve_checkpoint(c.checkpoint, "draft")
    if orbax_io.is_orbax_dir(path):
      return _restore_orbax(path, "draft", dtype, mesh)
    dcfg, dparams = load_dflash_checkpoint(path, dtype=dtype)
    if mesh is not None:  # the draft is small: loaded whole, then placed by the rules
      dparams = sharding.shard(dparams, sharding.param_shardings(dparams, mesh))
    return dcfg, dparams
  if not c.preset:
    return None, None
  if c.preset in bench_models.DRAFT_PRESETS:
    return bench_models.load_draft(c, tcfg, dtype, mesh)
  n = tcfg.num_hidden_layers
  taps = tuple(sorted({0, n // 2, n - 1}))
  if c.preset == "tiny":
    dcfg = DraftConfig.tiny(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                            mask_token_id=ByteTokenizer.mask_id, num_target_layers=n,
                            target_layer_ids=taps, block_size=8)
  elif c.preset == "bench_k26":  # a Qwen3-8B-DFlash-sized draft at K2.6 width
    dcfg = DraftConfig.tiny(hidden_size=tcfg.hidden_size, num_hidden_layers=3,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            intermediate_size=12288, vocab_size=tcfg.vocab_size,
                            mask_token_id=tcfg.vocab_size - 1, num_target_layers=n,
                            target_layer_ids=taps, block_size=16,
                            layer_types=("full_attention",) * 3)
  else:
    raise UsageError("draft.preset", f"unknown preset {c.preset!r}; use 'tiny', 'bench_k26', "
                     "or set --config.draft.checkpoint")
  init = lambda key: init_draft_params(key, dcfg, tcfg.hidden_size, dcfg.n_taps, dtype)
  return dcfg, _init(init, mesh, jax.random.key(c.seed))


TOKENIZERS = ("auto", "bytes", "tiktoken", "none")


def make_tokenizer(name: str, target):
  """config.tokenizer -> a tokenizer: 'auto' picks what the target checkpoint (or preset) has."""
  if name not in TOKENIZERS:
    raise UsageError("tokenizer", f"{name!r} must be one of {', '.join(TOKENIZERS)}")
  if name in ("bytes", "none"):
    return ByteTokenizer() if name == "bytes" else None
  if target.checkpoint:
    tok = load_tokenizer(resolve_checkpoint(target.checkpoint, "target"))
    if name == "tiktoken" and isinstance(tok, ByteTokenizer):
      raise ValueError(f"config.tokenizer='tiktoken' but {target.checkpoint!r} has no "
                       "tiktoken.model")
    return tok
  preset = model_config.PRESETS.get(target.preset)
  vocab = preset().vocab_size if preset else None
  if name == "auto" and vocab == ByteTokenizer.vocab_size:
    return ByteTokenizer()
  raise ValueError(f"config.tokenizer={name!r} needs a target checkpoint directory holding "
                   f"tiktoken.model (preset {target.preset!r} has vocab {vocab}); "
                   "set --config.target.checkpoint or use --config.tokenizer=bytes")


def load_pair(config, mesh=None) -> tuple[Pair, object]:
  """(target + draft pair, tokenizer) of a run config, params placed on `mesh` (if any); without
  a mesh the target in target.pack's decode layout and the draft in
  draft.model.pack_for_decode's (no weight concatenation at run time)."""
  dtype = _dtype(config.dtype)
  for kind in ("target", "draft"):  # checkpoint dirs first: an empty one is not a tokenizer error
    if config[kind].checkpoint:
      check_checkpoint_dir(resolve_checkpoint(config[kind].checkpoint, kind), kind)
  tokenizer = make_tokenizer(config.tokenizer, config.target)  # fails fast, before the weights
  tcfg, tparams = load_target_for_decode(config.target, dtype, mesh)
  dcfg, dparams = load_draft(config.draft, tcfg, dtype, mesh)
  if dparams is not None and mesh is None:  # one device: the draft's decode layout
    dparams = pack_for_decode(dparams)
  return Pair(tcfg, tparams, dcfg, dparams), tokenizer
