"""The stable public API used by notebooks and external checks."""

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.target.checkpoint import load_hf_checkpoint as _load
from kdtree_jax.target.config import TargetConfig
from kdtree_jax.target import transformer


def load_hf_checkpoint(path: str, dtype=jnp.float32):
  """(config, params) from a Hugging Face checkpoint directory (bf16 / f32 / FP8 / INT4)."""
  return _load(path, dtype=dtype)


def check_tokens(tokens, vocab_size: int):
  """Raises ValueError for ids outside [0, vocab) (concrete arrays only)."""
  if isinstance(tokens, jax.core.Tracer):
    return
  t = np.asarray(tokens)
  if t.size and (t.min() < 0 or t.max() >= vocab_size):
    raise ValueError(f"token ids must be in [0, {vocab_size}); got min {t.min()}, max {t.max()}")


@jax.jit(static_argnums=0)
def _forward(cfg, params, tokens):
  return transformer.prefill(cfg, params, None, tokens)[0]


def forward(config: TargetConfig, params, tokens):
  """Causal prefill from position 0: int32 [B, S] -> f32 logits [B, S, V]."""
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [B, S]; got shape {tokens.shape}")
  check_tokens(tokens, config.vocab_size)
  return _forward(config, params, tokens.astype(jnp.int32))
