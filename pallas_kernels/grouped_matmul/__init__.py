"""Grouped (per-expert) matmul for routed experts, bf16 or INT4 weights (dequantised in the kernel)."""

from pallas_kernels.grouped_matmul.api import expert_mlp, gated_grouped_matmul, grouped_matmul
from pallas_kernels.grouped_matmul.reference import (grouped_matmul_reference,
                                                     int4_grouped_matmul_reference)
from pallas_kernels.grouped_matmul.tuning import Tuning

__all__ = ["expert_mlp", "gated_grouped_matmul", "grouped_matmul", "grouped_matmul_reference",
           "int4_grouped_matmul_reference", "Tuning"]
