"""kdtree-jax: speculative decoding (DFlash draft + DDTree verify) for Kimi K2.6-shaped models.

Dimension letters used in names and einsums across the package:
  B batch, S/T tokens, L cache rows (max_len), D hidden, H heads, R kv_lora_rank (latent),
  P rope dim, C = R + P latent cache width, E routed experts, F ffn width, V vocab,
  N tree nodes, K top-k, A accepted tokens.
"""

from kdtree_jax.api import forward, load_hf_checkpoint
from kdtree_jax.cache import LatentCache
from kdtree_jax.config import ModelConfig, load_hf_config

__all__ = ["forward", "load_hf_checkpoint", "LatentCache", "ModelConfig", "load_hf_config"]
