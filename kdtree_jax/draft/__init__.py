"""DFlash block-diffusion draft: config, forward, checkpoints."""

from kdtree_jax.draft.checkpoint import load_dflash_checkpoint, save_dflash_checkpoint
from kdtree_jax.draft.config import DraftConfig, build_target_layer_ids
from kdtree_jax.draft.model import (DraftCache, context_feature, draft_block, draft_train_forward,
                                    init_draft_cache, init_draft_params, make_block,
                                    materialize_context)

__all__ = [
    "DraftCache", "DraftConfig", "build_target_layer_ids", "context_feature", "draft_block",
    "draft_train_forward", "init_draft_cache", "init_draft_params", "load_dflash_checkpoint",
    "make_block", "materialize_context", "save_dflash_checkpoint",
]
