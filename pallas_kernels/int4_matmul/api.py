"""Public entry point: the Mosaic GPU kernel, its interpret mode, or the XLA reference."""

import jax

from pallas_kernels.int4_matmul.reference import int4_grouped_matmul_reference

BACKENDS = ("auto", "pallas", "interpret", "xla")


def _check(x_mk, q_gkn, scale_gsn, group_sizes):
  if x_mk.ndim != 2 or q_gkn.ndim != 3 or scale_gsn.ndim != 3:
    raise ValueError(f"expected x [M, K], q [G, K, N], scale [G, K/S, N]; got "
                     f"{x_mk.shape=} {q_gkn.shape=} {scale_gsn.shape=}")
  g, k, n = q_gkn.shape
  if x_mk.shape[1] != k:
    raise ValueError(f"x {x_mk.shape} and q {q_gkn.shape} disagree on K")
  if scale_gsn.shape[0] != g or scale_gsn.shape[2] != n or k % scale_gsn.shape[1]:
    raise ValueError(f"scale {scale_gsn.shape} does not group q {q_gkn.shape}")
  if q_gkn.dtype != jax.numpy.int4:
    raise ValueError(f"q must be int4, got {q_gkn.dtype}")
  if group_sizes.shape != (g,):
    raise ValueError(f"{group_sizes.shape=} must be ({g},)")


def int4_grouped_matmul(x_mk, q_gkn, scale_gsn, group_sizes, *, backend="auto", block_n=128):
  """out[rows of group g] = x[rows of group g] @ (q[g] * scale[g]); rows of x sorted by group.

  x [M, K] (bf16 for the kernel), q int4 [G, K, N], scale [G, K/S, N], group_sizes [G] int32
  (sum <= M; rows past the sum are left 0 by the reference and undefined by the kernel).
  backend: "pallas" (GPU), "interpret" (the kernel on CPU), "xla", or "auto".
  """
  _check(x_mk, q_gkn, scale_gsn, group_sizes)
  if backend not in BACKENDS:
    raise ValueError(f"{backend=} must be one of {BACKENDS}")
  from pallas_kernels.int4_matmul import kernel  # pylint: disable=import-outside-toplevel
  if backend == "auto":
    ok = jax.default_backend() == "gpu" and kernel.supports(x_mk, q_gkn, scale_gsn, block_n)
    backend = "pallas" if ok else "xla"
  if backend == "xla":
    return int4_grouped_matmul_reference(x_mk, q_gkn, scale_gsn, group_sizes)
  return kernel.int4_grouped_matmul_mgpu(x_mk, q_gkn, scale_gsn, group_sizes, block_n=block_n,
                                         interpret=backend == "interpret")
