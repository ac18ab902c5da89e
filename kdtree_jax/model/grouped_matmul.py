"""Grouped (ragged) matmul for the routed experts: rows sorted by expert, one matrix per expert.

On an H200, XLA's `jax.lax.ragged_dot` runs as a dense matmul against every expert (measured:
the MoE of a 65-token verify step took 3x its weight-streaming floor), so on GPU the bf16 path
uses JAX's Mosaic GPU grouped GEMM (`ragged_dot_mgpu`, wgmma + TMA, persistent over SMs).
INT4 expert stacks are dequantised in front of the matmul.
"""

import os

import jax

from kdtree_jax.model.int4 import Int4Weight, dequantize

IMPLS = ("auto", "xla", "mosaic")
# Escape hatch for benchmarks: force "xla" or "mosaic" where callers leave impl="auto".
AUTO_OVERRIDE = os.environ.get("KDTREE_GROUPED_MATMUL", "auto")
MOSAIC_BLOCKS = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)


def mosaic_supports(x_mk, w_gkn) -> bool:
  """The Mosaic kernel needs bf16/f16 operands of one dtype, K % 64 == 0 and N % 128 == 0."""
  return (jax.default_backend() == "gpu" and x_mk.dtype == w_gkn.dtype
          and x_mk.dtype.itemsize == 2 and w_gkn.shape[1] % MOSAIC_BLOCKS["block_k"] == 0
          and w_gkn.shape[2] % MOSAIC_BLOCKS["block_n"] == 0)


def grouped_matmul(x_mk, w_gkn, group_sizes, impl="auto"):
  """out[rows of group g] = x[rows of group g] @ w[g]; rows of x are sorted by group."""
  if impl not in IMPLS:
    raise ValueError(f"{impl=} must be one of {IMPLS}")
  if isinstance(w_gkn, Int4Weight):
    w_gkn = dequantize(w_gkn, x_mk.dtype)
  if impl == "auto":
    impl = AUTO_OVERRIDE
  if impl == "auto":
    impl = "mosaic" if mosaic_supports(x_mk, w_gkn) else "xla"
  if impl == "mosaic":
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # pylint: disable=import-outside-toplevel
    return ragged_dot_mgpu.ragged_dot(x_mk, w_gkn, group_sizes=group_sizes, **MOSAIC_BLOCKS)
  return jax.lax.ragged_dot(x_mk, w_gkn, group_sizes)
