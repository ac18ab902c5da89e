"""Pallas kernels for kdtree-jax: one folder per op (kernel, XLA reference, tuning, bench)."""

from pallas_kernels.int4_matmul import int4_grouped_matmul, int4_grouped_matmul_reference
from pallas_kernels.tree_verify import tree_verify_attention, tree_verify_attention_reference

__all__ = ["int4_grouped_matmul", "int4_grouped_matmul_reference", "tree_verify_attention",
           "tree_verify_attention_reference"]
