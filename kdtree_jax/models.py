"""Builds the (target, draft, tokenizer) triple a run config names: checkpoints or random presets."""

import dataclasses
import os

import jax
import jax.numpy as jnp

from kdtree_jax import config as model_config
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


def load_target(c, dtype):
  """A HF checkpoint directory, or a random-init preset (`tiny`, `kimi_k2_6`)."""
  if c.checkpoint:
    if not os.path.isdir(c.checkpoint):
      raise FileNotFoundError(f"target checkpoint {c.checkpoint!r} does not exist")
    return load_hf_checkpoint(c.checkpoint, dtype=dtype)
  if c.preset not in model_config.PRESETS:
    raise ValueError(f"unknown target preset {c.preset!r}; choose from {list(model_config.PRESETS)}")
  cfg = model_config.PRESETS[c.preset]()
  return cfg, init_params(jax.random.key(c.seed), cfg, dtype, std=0.1)


def load_draft(c, tcfg, dtype):
  """A DFlash checkpoint directory, a random `tiny` draft sized for the target, or none."""
  if c.checkpoint:
    if not os.path.isdir(c.checkpoint):
      raise FileNotFoundError(f"draft checkpoint {c.checkpoint!r} does not exist")
    return load_dflash_checkpoint(c.checkpoint, dtype=dtype)
  if not c.preset:
    return None, None
  if c.preset != "tiny":
    raise ValueError(f"unknown draft preset {c.preset!r}; use a checkpoint or 'tiny'")
  n = tcfg.num_hidden_layers
  dcfg = DraftConfig.tiny(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                          mask_token_id=ByteTokenizer.mask_id, num_target_layers=n,
                          target_layer_ids=tuple(sorted({0, n // 2, n - 1})), block_size=8)
  return dcfg, init_draft_params(jax.random.key(c.seed), dcfg, tcfg.hidden_size, dcfg.n_taps, dtype)


def load_models(config) -> Models:
  dtype = _dtype(config.dtype)
  tcfg, tparams = load_target(config.target, dtype)
  dcfg, dparams = load_draft(config.draft, tcfg, dtype)
  if config.tokenizer != "bytes":
    raise ValueError(f"tokenizer {config.tokenizer!r} is not available yet (only 'bytes')")
  return Models(tcfg, tparams, dcfg, dparams, ByteTokenizer())
