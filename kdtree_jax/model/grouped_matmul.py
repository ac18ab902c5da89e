"""Grouped (ragged) matmul for the routed experts: rows sorted by expert, one matrix per expert.

On an H200, XLA's `jax.lax.ragged_dot` runs as a dense matmul against every expert (measured:
the MoE of a 65-token verify step took 3x its weight-streaming floor), so on GPU the bf16 path
uses JAX's Mosaic GPU grouped GEMM (`ragged_dot_mgpu`, wgmma + TMA, persistent over SMs).
INT4 expert stacks: impl="mosaic" runs our kernel that dequantises inside the matmul
(`pallas_kernels.int4_matmul`, weights read at 4.5 bits); "auto" still dequantises them in front of
the bf16 grouped matmul (the path measured on the H200) until the fused kernel has been run and
timed on a GPU (KDTREE_INT4_FUSED=1 makes "auto" pick it).
"""

import os

import jax

from kdtree_jax.model.int4 import Int4Weight, dequantize
from pallas_kernels.int4_matmul import int4_grouped_matmul

IMPLS = ("auto", "xla", "mosaic", "interpret")
# Escape hatch for benchmarks: force "xla" or "mosaic" where callers leave impl="auto".
AUTO_OVERRIDE = os.environ.get("KDTREE_GROUPED_MATMUL", "auto")
INT4_FUSED_AUTO = os.environ.get("KDTREE_INT4_FUSED") == "1"
MOSAIC_BLOCKS = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)


def mosaic_supports(x_mk, w_gkn) -> bool:
  """The Mosaic kernel needs bf16/f16 operands of one dtype, K % 64 == 0 and N % 128 == 0."""
  return (jax.default_backend() == "gpu" and x_mk.dtype == w_gkn.dtype
          and x_mk.dtype.itemsize == 2 and w_gkn.shape[1] % MOSAIC_BLOCKS["block_k"] == 0
          and w_gkn.shape[2] % MOSAIC_BLOCKS["block_n"] == 0)


def _int4(x_mk, w: Int4Weight, group_sizes, impl):
  """INT4 experts: the fused kernel ("mosaic" on GPU, "interpret" on CPU) or dequantise first."""
  if impl == "auto" and INT4_FUSED_AUTO:
    impl = "mosaic" if jax.default_backend() == "gpu" else "xla"
  if impl in ("mosaic", "interpret"):
    backend = "pallas" if impl == "mosaic" else "interpret"
    return int4_grouped_matmul(x_mk, w.packed, w.scale, group_sizes, backend=backend)
  return grouped_matmul(x_mk, dequantize(w, x_mk.dtype), group_sizes, impl)


def grouped_matmul(x_mk, w_gkn, group_sizes, impl="auto"):
  """out[rows of group g] = x[rows of group g] @ w[g]; rows of x are sorted by group.

  impl: "xla" (ragged_dot), "mosaic" (Mosaic GPU kernel; for INT4 weights the fused-dequant one),
  "interpret" (the INT4 kernel on CPU, tests), "auto" (Mosaic on a GPU when the shapes suit it,
  else XLA; KDTREE_GROUPED_MATMUL overrides).
  """
  if impl not in IMPLS:
    raise ValueError(f"{impl=} must be one of {IMPLS}")
  if impl == "auto":
    impl = AUTO_OVERRIDE
  if isinstance(w_gkn, Int4Weight):
    return _int4(x_mk, w_gkn, group_sizes, impl)
  if impl == "interpret":
    raise ValueError("impl='interpret' is for INT4 experts only")
  if impl == "auto":
    impl = "mosaic" if mosaic_supports(x_mk, w_gkn) else "xla"
  if impl == "mosaic":
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # pylint: disable=import-outside-toplevel
    return ragged_dot_mgpu.ragged_dot(x_mk, w_gkn, group_sizes=group_sizes, **MOSAIC_BLOCKS)
  return jax.lax.ragged_dot(x_mk, w_gkn, group_sizes)
