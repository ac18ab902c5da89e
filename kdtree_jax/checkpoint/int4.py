"""INT4 routed experts kept packed in device memory; dequantised inside the expert matmul.

Layout (for x @ W with the logical W [E, in, out]): `packed` is a jnp.int4 array [E, out, in]
(output-major like HF's `weight_packed`; XLA stores two values per byte), `scale` bf16
[E, in/Q, out] per group of Q = 32 input rows. 4.5 bits per weight instead of 16: K2.6's routed
experts take ~520 GB, not 2 TB. On a GPU the grouped matmul dequantises inside the Mosaic kernel
(pallas_kernels/grouped_matmul: the [out, in] tile is the wgmma register operand); elsewhere the
XLA reference dequantises in front of the matmul.
HF compressed-tensors stores `weight_packed` int32 [out, in/8] (low nibble first, value - 8)
with `weight_scale` bf16 [out, in/32]; `from_hf` converts one expert.
K layouts (`k_layout`, static; made by `pack_k` where decode weights are laid out): "plain"
(K order, as loaded and saved), "kpack" (`packed`'s columns permuted inside each 64-column block,
`kpack.pack_int4_k`, its own inverse: the kernel reads a thread's 8 values with one 32-bit load)
or "kpairs" (`kpairs.pack_int4_k_pairs`: the same 32-bit loads with each bf16 pair's two nibbles
16 bits apart, the kernel's PRMT-free dequantise, `Tuning.int4_k_interleaved`). Either K-packed
layout only permutes columns inside each 32-column scale group: the logical weight and the
scales are unchanged, and `dequantize` undoes the permutation exactly.
"""

import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kdtree_jax.checkpoint import quant
from pallas_kernels.grouped_matmul import kpack, kpairs
from pallas_kernels.grouped_matmul import reference as kernel_reference


K_LAYOUTS = ("plain", "kpack", "kpairs")


@flax.struct.dataclass
class Int4Weight:
  """Int4 expert stack: packed int4 [E, out, in], scale [E, in/Q, out]; `shape` is [E, in, out].
  k_layout: the order of `packed`'s in-columns, one of K_LAYOUTS (static: the kernel's tuning
  follows it, `target.grouped_matmul.k_layout`)."""

  packed: jax.Array
  scale: jax.Array
  k_layout: str = flax.struct.field(pytree_node=False, default="plain")

  def __post_init__(self):
    if self.k_layout not in K_LAYOUTS:
      raise ValueError(f"Int4Weight.k_layout={self.k_layout!r} must be one of {K_LAYOUTS}")

  @property
  def k_packed(self) -> bool:
    """Stored K-packed for the kernel's 32-bit loads ("kpack" or "kpairs"): Tuning.int4_k_packed."""
    return self.k_layout != "plain"

  @property
  def shape(self):
    e, dout, din = self.packed.shape
    return (e, din, dout)

  @property
  def group(self) -> int:
    return self.shape[1] // self.scale.shape[1]


def quantize(w_eio, group=32) -> Int4Weight:
  """Symmetric per-group int4 of a float [E, in, out] stack (numpy; for tests and conversion)."""
  w = np.asarray(w_eio, np.float32)
  e, din, dout = w.shape
  g = w.reshape(e, din // group, group, dout)
  scale = np.abs(g).max(axis=2) / 7.0
  safe = np.where(scale > 0, scale, 1.0)
  q = np.clip(np.round(g / safe[:, :, None, :]), -8, 7).astype(np.int8).reshape(e, din, dout)
  return pack(q, scale)


def pack_numpy(q_eio, scale) -> tuple[np.ndarray, np.ndarray]:
  """int values in [-8, 7] [E, in, out] + scale [E, in/Q, out] -> (int4 [E, out, in], bf16 scale)."""
  q = np.asarray(q_eio)
  if q.size and (q.min() < -8 or q.max() > 7):
    raise ValueError(f"int4 values must lie in [-8, 7], got [{q.min()}, {q.max()}]")
  return (np.ascontiguousarray(np.swapaxes(q, 1, 2)).astype(ml_dtypes.int4),
          np.asarray(scale, np.float32).astype(ml_dtypes.bfloat16))


def pack(q_eio, scale) -> Int4Weight:
  """int values in [-8, 7] [E, in, out] + scale [E, in/Q, out] -> Int4Weight on device."""
  packed, s = pack_numpy(q_eio, scale)
  return Int4Weight(jnp.asarray(packed), jnp.asarray(s))


def from_hf(weight_packed, weight_scale, shape) -> tuple[np.ndarray, np.ndarray]:
  """One HF expert matrix (int32 [out, in/8], bf16 [out, in/Q]) -> (int8 q [in, out], scale [in/Q, out])."""
  q = quant.unpack_int4(np.asarray(weight_packed), int(shape[1]))
  return q.T, np.asarray(weight_scale, np.float32).T


def k_order(packed, layout: str):
  """int4 [..., in] stored in `layout` -> the same columns in K order (the permutation undone)."""
  if layout == "kpack":
    return kpack.pack_int4_k(packed)  # its own inverse
  if layout == "kpairs":
    return kpairs.unpack_int4_k_pairs(packed)
  if layout != "plain":
    raise ValueError(f"unknown K layout {layout!r}; known: {K_LAYOUTS}")
  return packed


def dequantize(w: Int4Weight, dtype=jnp.bfloat16):
  """[E, in, out] in dtype: q * scale, rounded once to dtype (as the kernel does in registers)."""
  return kernel_reference.dequantize(k_order(w.packed, w.k_layout), w.scale, dtype)


def _relaid(packed, source: str, layout: str):
  """int4 [..., in] stored in `source` -> stored in `layout` (one jitted pass)."""
  q = k_order(packed, source)
  if layout == "kpack":
    return kpack.pack_int4_k(q)
  return kpairs.pack_int4_k_pairs(q) if layout == "kpairs" else q


_RELAID_DONATED = jax.jit(_relaid, static_argnums=(1, 2), donate_argnums=0)


def k_packable(w: Int4Weight) -> bool:
  """Whether the K-packed layouts take w: its in-dim a multiple of their 64-column block."""
  return w.packed.shape[-1] % kpack.CHUNK == 0


def pack_k(w: Int4Weight, donate: bool = False, layout: str = "kpack") -> Int4Weight:
  """The same weight stored in K layout `layout` (default "kpack": the kernel's 32-bit loads,
  `Tuning.int4_k_packed`; "kpairs": pair-interleaved as well, `Tuning.int4_k_interleaved`;
  "plain": K order). A stack already in `layout`, or whose in-dim is not a multiple of the
  packs' 64-column block, is returned as it is (a stack in the other K-packed layout is
  re-laid). donate: w.packed's buffer goes to the copy (deleted), so a loaded model is not held
  twice."""
  if layout not in K_LAYOUTS:
    raise ValueError(f"unknown K layout {layout!r}; known: {K_LAYOUTS}")
  if w.k_layout == layout or not k_packable(w):
    return w
  if donate:
    packed = _RELAID_DONATED(w.packed, w.k_layout, layout)
  else:
    packed = _relaid(w.packed, w.k_layout, layout)
  return Int4Weight(packed, w.scale, k_layout=layout)


def random_int4(key, shape_eio, std, group=32, zero_mean=False) -> Int4Weight:
  """Random INT4 stack of logical shape [E, in, out] whose dequantised values have std ~ `std`.

  q uniform in [-8, 7] (std 4.61; every code, for the kernels' tests), or with `zero_mean` in
  [-7, 7] (std 4.32) as a quantised trained weight is: the full range's mean is -0.5, an offset of
  -0.11 std shared by every weight. In a model that offset is a rank-one part of each expert
  (gate/up and down all lean on the all-ones direction), fed back layer after layer: the random
  K2.6-share model's tokens converged onto it with depth (WORKSPACE, twenty-fifth and
  twenty-sixth sessions).
  One scale per group = std / q's std (times a +-10% jitter).
  """
  e, din, dout = shape_eio
  kq, ks = jax.random.split(key)
  lo, q_std = (-7, (224 / 12) ** 0.5) if zero_mean else (-8, (255 / 12) ** 0.5)
  q = jax.random.randint(kq, (e, dout, din), lo, 8, jnp.int8).astype(jnp.int4)
  jitter = jax.random.uniform(ks, (e, din // group, dout), jnp.float32, 0.9, 1.1)
  return Int4Weight(q, (jitter * std / q_std).astype(jnp.bfloat16))
