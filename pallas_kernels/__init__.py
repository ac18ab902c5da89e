"""Pallas kernels for kdtree-jax: one folder per op (kernel, XLA reference, tuning, bench)."""

from pallas_kernels.grouped_matmul import (expert_mlp, gated_grouped_matmul, grouped_matmul,
                                           grouped_matmul_reference,
                                           int4_grouped_matmul_reference)
from pallas_kernels.tree_verify import tree_verify_attention, tree_verify_attention_reference

__all__ = ["expert_mlp", "gated_grouped_matmul", "grouped_matmul", "grouped_matmul_reference",
           "int4_grouped_matmul_reference", "tree_verify_attention",
           "tree_verify_attention_reference"]
