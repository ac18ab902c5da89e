"""Grouped (per-expert) matmul with weight-only INT4 experts, dequantised inside the kernel."""

from pallas_kernels.int4_matmul.api import int4_grouped_matmul, int4_grouped_matmul_reference

__all__ = ["int4_grouped_matmul", "int4_grouped_matmul_reference"]
