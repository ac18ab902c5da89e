"""INT4 weights with K packed per thread: 32-bit tile loads straight into the wgmma A layout.

In Mosaic's WGMMA register layout a thread holds, of a [64, 64] chunk, rows a and a + 8 of its
warp's 16 and columns 8i + 2l + e (i = 0..7, l = lane % 4, e = 0, 1): 2-value pieces 8 columns
apart, so a tile stored in K order is read with 16 one-byte loads per thread and chunk. The
WGMMA_UPCAST_4X layout holds the same rows and columns 32h + 8l + m (h = 0, 1, m = 0..7): one
32-bit word per row and 32-column half. Relabelling that register as the WGMMA registers
i = 4h + m // 2 (pieces e = m % 2) moves no data; it reads storage column
p = 32h + 8l + m as logical column c = 8(4h + m // 2) + 2l + m % 2. `pack_int4_k` stores original
column c at p (within every 64-column block; a permutation inside each 32-column half, so the
32-column scale groups are unchanged), and the kernel then sees the weights in K order against
an x tile in K order. The relabel is `inline_mgpu` code (the compiled kernel only); interpret
mode takes the same columns with a gather (`emulate`).
"""

import numpy as np
import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

CHUNK = 64


def _logical_column(p: int) -> int:
  """The logical K column the relabelled WGMMA layout gives storage column p of a chunk."""
  h, l, m = p // 32, (p % 32) // 8, p % 8
  return 8 * (4 * h + m // 2) + 2 * l + m % 2


# STORED_COLUMN[p]: the original column stored at column p of each 64-column block
STORED_COLUMN = np.array([_logical_column(p) for p in range(CHUNK)])
# STORAGE_OF[c]: where logical column c of a chunk is stored (the inverse permutation)
STORAGE_OF = np.argsort(STORED_COLUMN)


def pack_int4_k(q):
  """q [..., K] (int4, K a multiple of 64) -> the packed-K stack `Tuning.int4_k_packed` reads.

  Column 32h + 8j + 2l + e of each 64-column block goes to 32h + 8l + 2j + e: the (j, l) axes
  swapped (its own inverse, = `logical_order`), by a transpose through int8 (no int4 gather or
  transpose asked of XLA)."""
  k = q.shape[-1]
  if k % CHUNK:
    raise ValueError(f"K={k} must be a multiple of {CHUNK}")
  lead = q.shape[:-1]
  v = q.astype(jnp.int8).reshape(*lead, k // CHUNK, 2, 4, 4, 2)
  n = v.ndim
  v = jnp.swapaxes(v, n - 3, n - 2)
  return v.reshape(*lead, k).astype(q.dtype)


def load_chunk(chunk_ref, interpret: bool):
  """A packed chunk [BN, 64] of an SMEM ref -> int4 in the WGMMA layout, in logical K order."""
  if interpret:  # the emulation: loads in storage order, then the logical columns
    q = plgpu.load(chunk_ref, layout=plgpu.Layout.WGMMA, optimized=False)
    return logical_order(q)
  q = plgpu.load(chunk_ref, layout=plgpu.Layout.WGMMA_UPCAST_4X, optimized=False)
  return _relabel(q)


def logical_order(q):
  """[BN, 64] in storage order -> logical order: storage column 32h + 8l + 2j + e holds logical
  column 8(4h + j) + 2l + e, so swap the (l, j) axes (reshape and transpose: no array
  constant, which a kernel body cannot close over)."""
  bn = q.shape[0]
  return q.reshape(bn, 2, 4, 4, 2).transpose(0, 1, 3, 2, 4).reshape(bn, CHUNK)


def _relabel(q):
  return on_upcast_registers(q, relabel_registers, q.dtype)


def on_upcast_registers(q, registers_fn, dtype):
  """registers_fn applied to a WGMMA_UPCAST_4X-loaded chunk's registers (Mosaic fragmented
  arrays, inline_mgpu), the result an array of `dtype` in the WGMMA layout."""
  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA_UPCAST_4X,),
      return_type=plgpu.ShapeDtypeStruct(q.shape, dtype, layout=plgpu.Layout.WGMMA))
  def apply(_, words):
    return registers_fn(words)
  return apply(q)


def relabel_registers(words: "mgpu.FragmentedArray") -> "mgpu.FragmentedArray":
  """UPCAST_4X registers (vector<8 x i4>, [.., h, .., r, ..]) -> WGMMA registers (vector<2 x
  i4>, [.., i, .., r, ..]): register i is piece i % 4 of word i // 4. Both layouts tile rows
  alike (dims other than 1 agree), so only the column-tile index (dim 1) and the piece change."""
  wgmma = fa.WGMMA_LAYOUT
  shape = wgmma.registers_shape(words.shape)
  src = words.registers
  if src.shape[:1] + src.shape[2:] != shape[:1] + shape[2:] or shape[1] != 4 * src.shape[1]:
    raise ValueError(f"unexpected register shapes {src.shape} -> {shape}")
  regs = np.empty(shape, dtype=object)
  for idx in np.ndindex(*shape):
    i = idx[1]
    word = src[(idx[0], i // 4) + idx[2:]]
    regs[idx] = mgpu_utils.vector_slice(word, slice(2 * (i % 4), 2 * (i % 4) + 2))
  return mgpu.FragmentedArray(_registers=regs, _layout=wgmma, _is_signed=words.is_signed)
