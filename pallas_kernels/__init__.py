"""Pallas kernels for kdtree-jax: one folder per op (kernel, XLA reference, tuning, bench)."""

from pallas_kernels.tree_verify import tree_verify_attention, tree_verify_attention_reference

__all__ = ["tree_verify_attention", "tree_verify_attention_reference"]
