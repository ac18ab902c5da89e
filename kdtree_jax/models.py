"""Builds the (target, draft, tokenizer) triple a run config names: checkpoints or random presets."""

import dataclasses
import os

import jax
import jax.numpy as jnp

from kdtree_jax import config as model_config
from kdtree_jax import sharding
from kdtree_jax.checkpoint.hf import load_hf_checkpoint
from kdtree_jax.draft.checkpoint import load_dflash_checkpoint
from kdtree_jax.draft.config import DraftConfig
from kdtree_jax.draft.model import init_draft_params
from kdtree_jax.model.params import init_params
from kdtree_jax.tokenizer import ByteTokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Models:
  tcfg: model_config.ModelConfig
  tparams: dict
  dcfg: DraftConfig | None
  dparams: dict | None
  tokenizer: object


def _dtype(name: str):
  if name not in DTYPES:
    raise ValueError(f"dtype {name!r} must be one of {list(DTYPES)}")
  return DTYPES[name]


def _init(init_fn, mesh, key):
  """init_fn(key), born sharded by the rules when a mesh is given (never whole on one device)."""
  return init_fn(key) if mesh is None else sharding.init_sharded(init_fn, mesh, key)


def load_target(c, dtype, mesh=None):
  """A HF checkpoint directory, or a random-init preset (`tiny`, `kimi_k2_6`); sharded on `mesh`."""
  if c.checkpoint:
    if not os.path.isdir(c.checkpoint):
      raise FileNotFoundError(f"target checkpoint {c.checkpoint!r} does not exist")
    put = None if mesh is None else sharding.loader_put(mesh, dtype)
    return load_hf_checkpoint(c.checkpoint, dtype=dtype, put=put)
  if c.preset not in model_config.PRESETS:
    raise ValueError(f"unknown target preset {c.preset!r}; choose from {list(model_config.PRESETS)}")
  kw = {"layers": c.layers} if "layers" in c else {}
  cfg = model_config.PRESETS[c.preset](**kw)
  init = lambda key: init_params(key, cfg, dtype, std=0.02)
  return cfg, _init(init, mesh, jax.random.key(c.seed))


def load_draft(c, tcfg, dtype, mesh=None):
  """A DFlash checkpoint directory, a random `tiny` draft sized for the target, or none."""
  if c.checkpoint:
    if not os.path.isdir(c.checkpoint):
      raise FileNotFoundError(f"draft checkpoint {c.checkpoint!r} does not exist")
    dcfg, dparams = load_dflash_checkpoint(c.checkpoint, dtype=dtype)
    if mesh is not None:  # the draft is small: loaded whole, then placed by the rules
      dparams = sharding.shard(dparams, sharding.param_shardings(dparams, mesh))
    return dcfg, dparams
  if not c.preset:
    return None, None
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
    raise ValueError(f"unknown draft preset {c.preset!r}; use a checkpoint, 'tiny' or 'bench_k26'")
  init = lambda key: init_draft_params(key, dcfg, tcfg.hidden_size, dcfg.n_taps, dtype)
  return dcfg, _init(init, mesh, jax.random.key(c.seed))


def load_models(config, mesh=None) -> Models:
  dtype = _dtype(config.dtype)
  tcfg, tparams = load_target(config.target, dtype, mesh)
  dcfg, dparams = load_draft(config.draft, tcfg, dtype, mesh)
  if config.tokenizer != "bytes":
    raise ValueError(f"tokenizer {config.tokenizer!r} is not available yet (only 'bytes')")
  return Models(tcfg, tparams, dcfg, dparams, ByteTokenizer())
