"""Tree-verify attention for absorbed MLA over a dense latent cache."""

from pallas_kernels.tree_verify.api import tree_verify_attention
from pallas_kernels.tree_verify.masks import PackedTreeMask, pack_tree_mask
from pallas_kernels.tree_verify.reference import tree_verify_attention_reference

__all__ = ["tree_verify_attention", "tree_verify_attention_reference", "PackedTreeMask",
           "pack_tree_mask"]
