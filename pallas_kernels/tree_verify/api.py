"""Public entry point: dispatches to the Mosaic GPU kernel, its interpret mode, or the XLA reference."""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import pdl
from pallas_kernels.tree_verify import masks
from pallas_kernels.tree_verify.reference import tree_verify_attention_reference
from pallas_kernels.tree_verify.tuning import BLOCK_M, default_tuning

BACKENDS = ("auto", "pallas", "interpret", "xla")


def _check_shapes(q, cache, lengths, tree_mask):
  if q.ndim != 4 or cache.ndim != 3:
    raise ValueError(f"expected q [B, N, H, C] and cache [B, L, C]; got {q.shape=} {cache.shape=}")
  b, n, h, c = q.shape
  if cache.shape[0] != b or cache.shape[2] != c:
    raise ValueError(f"q {q.shape} and cache {cache.shape} disagree on batch or latent width")
  if lengths.shape != (b,):
    raise ValueError(f"{lengths.shape=} must be ({b},)")
  if isinstance(tree_mask, masks.PackedTreeMask):
    if (tree_mask.num_nodes, tree_mask.heads) != (n, h) or tree_mask.words.shape[0] != b:
      raise ValueError(f"packed mask for {tree_mask.num_nodes=} {tree_mask.heads=} does not "
                       f"match {q.shape=}; pack it with pack_tree_mask(mask, heads={h})")
  elif tree_mask.shape != (b, n, n):
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


def _round_up(x, k):
  return -(-x // k) * k


def kernel_rows(n, h):
  """Rows of the kernel's q / outputs: N*H rounded up to 8 (Mosaic's GMEM row tiling) when that
  is below 64 (one row tile, TMA windows of exactly those rows), else to whole 64-row tiles (every
  64-row TMA window stays inside its own batch row and split; kernel._check_windows)."""
  m = _round_up(n * h, 8)
  return m if m < BLOCK_M else _round_up(m, BLOCK_M)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "value_dim", "tuning"))
def tree_verify_attention_mgpu(q, cache, lengths, tree_mask, *, scale, interpret=False,
                               value_dim=None, tuning=None):
  """The kernel path: out [B, N, H, R] in q.dtype and natural lse [B, N, H].

  XLA work around the kernel: q's free reshape to rows, the tree mask's bit words (one tiny
  fusion), and for several splits the merge. Copies only where the TMA cannot address the
  array: q rows when N*H is not kernel_rows (q is tiny; none at N*H = 8, 16, .., 56 or 64k), the
  cache when L % 8 != 0 (never in the model, whose caches have a multiple of 64 rows)."""
  # pylint: disable-next=import-outside-toplevel
  from pallas_kernels.tree_verify import combine, kernel, kernel_swap, merge_triton
  b, n, h, c = q.shape
  l = cache.shape[1]
  r = value_dim if value_dim is not None else c - 64
  t = tuning if tuning is not None else default_tuning(b, n, h, l)
  m = kernel_rows(n, h)
  q_rows = q.reshape(b, n * h, c)
  if m != n * h:
    q_rows = jnp.pad(q_rows, ((0, 0), (0, m - n * h), (0, 0)))
  if l % 8:
    cache = jnp.pad(cache, ((0, 0), (0, _round_up(l, 8) - l), (0, 0)))
  if isinstance(tree_mask, masks.PackedTreeMask):
    words = tree_mask.words
  else:
    words = masks.tree_mask_words(tree_mask, h, _round_up(m, BLOCK_M))
  attention_kernel = kernel_swap.attention_kernel if t.swap_ab else kernel.attention_kernel
  out, lse = attention_kernel(q_rows, cache, lengths.astype(jnp.int32), words, n=n,
                                     scale=scale, tuning=t, value_dim=r, cache_rows=l,
                                     interpret=interpret)
  if t.num_splits > 1 and t.merge == "triton":
    out, lse = merge_triton.merge_splits_triton(out, lse, n * h, q.dtype, interpret=interpret,
                                                cols=t.merge_cols,
                                                loads_first=t.merge_loads_first)
  elif t.num_splits > 1:
    out, lse = combine.merge_splits(out, lse, n * h, q.dtype)
  elif m != n * h:
    out, lse = out[:, :n * h], lse[:, :n * h]
  return out.reshape(b, n, h, r), lse.reshape(b, n, h)


def tree_verify_attention(q, cache, lengths, tree_mask, *, scale, backend="auto", value_dim=None,
                          return_lse=False, tuning=None):
  """Absorbed-MLA attention of N tree nodes against a dense cache.

  q [B, N, H, C] (C = R + P, e.g. 512 + 64), cache [B, L, C] (values = first R columns),
  lengths [B] int32 committed prefix (the nodes' own rows sit at [len, len + N)),
  tree_mask [B, N, N] bool (node i sees node j), or for the kernel backends a
  masks.PackedTreeMask (pack_tree_mask(tree_mask, H): pack once, reuse over layers).
  Returns out [B, N, H, R] (and lse [B, N, H]).
  tuning: optional tuning.Tuning for the kernel backends (default: tuning.default_tuning).
  """
  _check_shapes(q, cache, lengths, tree_mask)
  backend = resolve_backend(backend, q, value_dim)
  if tuning is None and backend != "xla" and pdl.model_default_on():  # TargetConfig.mosaic_pdl
    tuning = pdl.with_model_default(default_tuning(q.shape[0], q.shape[1], q.shape[2],
                                                   cache.shape[1]))
  if backend == "xla":
    if isinstance(tree_mask, masks.PackedTreeMask):
      raise ValueError("the xla backend takes the bool tree mask, not a PackedTreeMask")
    out, lse = tree_verify_attention_reference(q, cache, lengths, tree_mask, scale=scale,
                                               value_dim=value_dim)
  else:
    out, lse = tree_verify_attention_mgpu(q, cache, lengths, tree_mask, scale=scale,
                                          interpret=backend == "interpret",
                                          value_dim=value_dim, tuning=tuning)
  return (out, lse) if return_lse else out
