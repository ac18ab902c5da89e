"""Decode state: everything the device loop carries between speculative steps."""

from typing import Any

import flax.struct
import jax

from kdtree_jax.target.cache import LatentCache


@flax.struct.dataclass
class DecodeState:
  """Per-row decode state. Letters: B batch, W commit width, Z tapped features, M output buffer.

  cache: target latent cache; rows [0, len) committed, [len, len + N) tree scratch.
  draft_cache: DFlash context K/V (None in 'ar' mode); its ctx_len trails `cache.lengths` by the
    `pending_count` committed tokens whose tapped hidden states are not materialised yet.
  bonus [B]: the last emitted token; not in the cache yet (it is the next tree's root).
  pending_taps [B, W, Z], pending_count [B]: taps of the last committed tokens (None in 'ar').
  out [B, M], n_out [B]: emitted tokens; done [B]: row finished (EOS, max tokens, cache full).
  steps []: steps taken; accepted [max_new_tokens, B]: tokens committed per step (0 once done).
  capacity []: logical max_len; rows are committed up to it in every mode (the cache has N
    more physical rows of tree scratch, rounded up to a multiple of 64 for the kernel's tiles).
  widths [max_new_tokens]: tree nodes verified per step (budget='auto' only; None otherwise).
  """

  cache: LatentCache
  draft_cache: Any
  bonus: jax.Array
  pending_taps: Any
  pending_count: jax.Array
  out: jax.Array
  n_out: jax.Array
  done: jax.Array
  key: jax.Array
  steps: jax.Array
  accepted: jax.Array
  capacity: jax.Array
  widths: Any = None
