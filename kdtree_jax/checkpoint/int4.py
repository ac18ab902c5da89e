"""INT4 routed experts kept packed in device memory; dequantised inside the expert matmul.

Layout (for x @ W with the logical W [E, in, out]): `packed` is a jnp.int4 array [E, out, in]
(output-major like HF's `weight_packed`; XLA stores two values per byte), `scale` bf16
[E, in/Q, out] per group of Q = 32 input rows. 4.5 bits per weight instead of 16: K2.6's routed
experts take ~520 GB, not 2 TB. On a GPU the grouped matmul dequantises inside the Mosaic kernel
(pallas_kernels/grouped_matmul: the [out, in] tile is the wgmma register operand); elsewhere the
XLA reference dequantises in front of the matmul.
HF compressed-tensors stores `weight_packed` int32 [out, in/8] (low nibble first, value - 8)
with `weight_scale` bf16 [out, in/32]; `from_hf` converts one expert.
K-packed stacks (`k_packed`, made by `pack_k` where decode weights are laid out): `packed`'s
columns permuted inside each 64-column block (`kpack.pack_int4_k`, its own inverse) so the
kernel reads a thread's 8 values with one 32-bit load; the logical weight is unchanged.
"""

import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kdtree_jax.checkpoint import quant
from pallas_kernels.grouped_matmul import kpack
from pallas_kernels.grouped_matmul import reference as kernel_reference


@flax.struct.dataclass
class Int4Weight:
  """Int4 expert stack: packed int4 [E, out, in], scale [E, in/Q, out]; `shape` is [E, in, out].
  k_packed: `packed`'s in-columns are in kpack's order (static: the kernel's tuning follows it)."""

  packed: jax.Array
  scale: jax.Array
  k_packed: bool = flax.struct.field(pytree_node=False, default=False)

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


def dequantize(w: Int4Weight, dtype=jnp.bfloat16):
  """[E, in, out] in dtype: q * scale, rounded once to dtype (as the kernel does in registers)."""
  packed = kpack.pack_int4_k(w.packed) if w.k_packed else w.packed  # the permutation undone
  return kernel_reference.dequantize(packed, w.scale, dtype)


_PACK_K_DONATED = jax.jit(kpack.pack_int4_k, donate_argnums=0)


def pack_k(w: Int4Weight, donate: bool = False) -> Int4Weight:
  """The same weight K-packed for the kernel's 32-bit loads (`Tuning.int4_k_packed`); a stack
  already K-packed, or whose in-dim is not a multiple of kpack.CHUNK, is returned as it is.
  donate: w.packed's buffer goes to the copy (deleted), so a loaded model is not held twice."""
  if w.k_packed or w.packed.shape[-1] % kpack.CHUNK:
    return w
  packed = (_PACK_K_DONATED if donate else kpack.pack_int4_k)(w.packed)
  return Int4Weight(packed, w.scale, k_packed=True)


def random_int4(key, shape_eio, std, group=32) -> Int4Weight:
  """Random INT4 stack of logical shape [E, in, out] whose dequantised values have std ~ `std`.

  q uniform in [-8, 7] (std ~4.6), one scale per group = std / 4.6 (times a +-10% jitter).
  """
  e, din, dout = shape_eio
  kq, ks = jax.random.split(key)
  q = jax.random.randint(kq, (e, dout, din), -8, 8, jnp.int8).astype(jnp.int4)
  jitter = jax.random.uniform(ks, (e, din // group, dout), jnp.float32, 0.9, 1.1)
  return Int4Weight(q, (jitter * std / 4.6).astype(jnp.bfloat16))
