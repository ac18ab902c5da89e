"""Public entry point: dispatches to the Mosaic GPU kernel, its interpret mode, or the XLA reference."""

import jax

from pallas_kernels.tree_verify.reference import tree_verify_attention_reference

BACKENDS = ("auto", "pallas", "interpret", "xla")


def _check_shapes(q, cache, lengths, tree_mask):
  if q.ndim != 4 or cache.ndim != 3:
    raise ValueError(f"expected q [B, N, H, C] and cache [B, L, C]; got {q.shape=} {cache.shape=}")
  b, n, _, c = q.shape
  if cache.shape[0] != b or cache.shape[2] != c:
    raise ValueError(f"q {q.shape} and cache {cache.shape} disagree on batch or latent width")
  if lengths.shape != (b,):
    raise ValueError(f"{lengths.shape=} must be ({b},)")
  if tree_mask.shape != (b, n, n):
    raise ValueError(f"{tree_mask.shape=} must be ({b}, {n}, {n})")


def kernel_supports(q, value_dim=None) -> bool:
  """Whether the Mosaic GPU kernel handles this latent / value width (K2: 576 / 512)."""
  c = q.shape[-1]
  r = value_dim if value_dim is not None else c - 64
  return c % 64 == 0 and r % 128 == 0 and r // 2 <= 256


def resolve_backend(backend, q, value_dim=None) -> str:
  """'auto' -> 'pallas' on a GPU when the kernel supports the shapes, else 'xla'."""
  if backend not in BACKENDS:
    raise ValueError(f"{backend=} must be one of {BACKENDS}")
  if backend == "auto":
    return "pallas" if jax.default_backend() == "gpu" and kernel_supports(q, value_dim) else "xla"
  return backend


def tree_verify_attention(q, cache, lengths, tree_mask, *, scale, backend="auto", value_dim=None,
                          return_lse=False, tuning=None):
  """Absorbed-MLA attention of N tree nodes against a dense cache.

  q [B, N, H, C] (C = R + P, e.g. 512 + 64), cache [B, L, C] (values = first R columns),
  lengths [B] int32 committed prefix (the nodes' own rows sit at [len, len + N)),
  tree_mask [B, N, N] bool (node i sees node j). Returns out [B, N, H, R] (and lse [B, N, H]).
  tuning: optional tuning.Tuning for the kernel backends (default: tuning.default_tuning).
  """
  _check_shapes(q, cache, lengths, tree_mask)
  backend = resolve_backend(backend, q, value_dim)
  if backend == "xla":
    out, lse = tree_verify_attention_reference(q, cache, lengths, tree_mask, scale=scale,
                                               value_dim=value_dim)
  else:
    from pallas_kernels.tree_verify import kernel  # pylint: disable=import-outside-toplevel
    out, lse = kernel.tree_verify_attention_mgpu(q, cache, lengths, tree_mask, scale=scale,
                                                 interpret=backend == "interpret",
                                                 value_dim=value_dim, tuning=tuning)
  return (out, lse) if return_lse else out
