"""kdtree-jax: speculative decoding (DFlash draft + DDTree verify) for Kimi K2.6-shaped models.

Dimension letters used in names and einsums across the package:
  B batch, S/T tokens, L cache rows (max_len), D hidden, H heads, R kv_lora_rank (latent),
  P rope dim, C = R + P latent cache width, E routed experts, F ffn width, V vocab,
  N tree nodes, K top-k, A accepted tokens, W commit width.
"""

from kdtree_jax.api import forward, load_hf_checkpoint
from kdtree_jax.target.cache import LatentCache
from kdtree_jax.target.config import ModelConfig, load_hf_config
from kdtree_jax.decoding.loop import GenerationResult, generate
from kdtree_jax.decoding.sampling import SamplingConfig
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.draft.checkpoint import load_dflash_checkpoint, save_dflash_checkpoint
from kdtree_jax.draft.config import DraftConfig
from kdtree_jax.tree import accept_walk, build_chain, build_ddtree

__all__ = [
    "forward", "load_hf_checkpoint", "LatentCache", "ModelConfig", "load_hf_config",
    "GenerationResult", "generate", "SamplingConfig", "SpecConfig", "load_dflash_checkpoint",
    "save_dflash_checkpoint", "DraftConfig", "accept_walk", "build_chain", "build_ddtree",
]
