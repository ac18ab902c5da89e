"""Public entry point of the grouped expert matmul: the Mosaic GPU kernel, interpret mode, or XLA."""

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import reference
from pallas_kernels.grouped_matmul.tuning import Tuning, default_tuning

BACKENDS = ("auto", "pallas", "interpret", "xla")


def _check(x_mk, weights, group_sizes):
  if x_mk.ndim != 2 or any(w.ndim != 3 for w in weights):
    raise ValueError(f"expected x [M, K] and 3-d weights; got {x_mk.shape=} "
                     f"{[w.shape for w in weights]}")
  if len(weights) == 2:
    q, s = weights
    g, n, k = q.shape
    if q.dtype != jnp.int4:
      raise ValueError(f"INT4 weights must be int4 [G, N, K], got {q.dtype}")
    if s.shape[0] != g or s.shape[2] != n or k % s.shape[1]:
      raise ValueError(f"scale {s.shape} does not group q {q.shape} (want [G, K/S, N])")
  else:
    g, k, n = weights[0].shape
  if x_mk.shape[1] != k:
    raise ValueError(f"x {x_mk.shape} and weights {weights[0].shape} disagree on K={k}")
  if group_sizes.shape != (g,):
    raise ValueError(f"{group_sizes.shape=} must be ({g},)")
  return k, n


def _reference(x_mk, weights, group_sizes):
  if len(weights) == 2:
    return reference.int4_grouped_matmul_reference(x_mk, *weights, group_sizes)
  return reference.grouped_matmul_reference(x_mk, weights[0], group_sizes)


def grouped_matmul(x_mk, weights, group_sizes, *, backend="auto", tuning: Tuning | None = None):
  """out[rows of expert g] = x[rows of g] @ W[g]; rows of x sorted by expert.

  weights: (w [G, K, N],) bf16 / f16, or (q int4 [G, N, K], scale [G, K/S, N]) for INT4 experts.
  group_sizes [G] int32 (sum <= M; rows past the sum are 0 in the reference, unwritten by the
  kernel). backend: "pallas" (GPU), "interpret" (the kernel on CPU), "xla", or "auto" (the kernel
  on a GPU when the shapes suit it). An expert with no rows costs the kernel no weight bytes.
  """
  weights = tuple(weights)
  k, n = _check(x_mk, weights, group_sizes)
  if backend not in BACKENDS:
    raise ValueError(f"{backend=} must be one of {BACKENDS}")
  from pallas_kernels.grouped_matmul import kernel  # pylint: disable=import-outside-toplevel
  tuning = tuning or default_tuning(x_mk.shape[0], weights[0].shape[0], k, n, len(weights) == 2,
                                    interpret=backend == "interpret")
  group = k // weights[1].shape[1] if len(weights) == 2 else None
  if backend == "auto":
    ok = jax.default_backend() == "gpu" and kernel.supports(x_mk, k, n, group, tuning)
    backend = "pallas" if ok else "xla"
  if backend == "xla":
    return _reference(x_mk, weights, group_sizes)
  return kernel.grouped_matmul_mgpu(x_mk, weights, group_sizes, tuning=tuning,
                                    interpret=backend == "interpret")
