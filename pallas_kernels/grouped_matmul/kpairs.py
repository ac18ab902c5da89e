"""INT4 K-packed with each bf16 pair's two nibbles 16 bits apart: a cheaper exact dequantise.

`Tuning.int4_k_interleaved` (with `int4_k_packed`: 32-bit loads, kpack.py). In the WGMMA register
layout a thread's register i of a [64, 64] chunk holds logical columns 8i + 2l + e (l = lane % 4,
e = 0, 1) as one bf16x2 pair. kpack.pack_int4_k stores the pair's two nibbles side by side
(bits 8j and 8j + 4 of the thread's 32-bit word, j = i % 4), and Mosaic's i4 -> bf16 moves them
16 bits apart with a PRMT per pair (and a shift per word). Here storage column
p = 32h + 8l + 4e + j (h = i // 4) holds logical column 32h + 8j + 2l + e: nibble slot j of the
word is the pair's low value and slot j + 4 its high one, so `(word >> 4j) & 0x000F000F` already
has them at bits 0-3 and 16-19. Per pair, with c = 0x43084308:

  v = ((word >> 4j) & 0x000F000F) ^ c     one LOP3 (+ a shift for j > 0: 3 per word)
  n = v - 136                             one HADD2.BF16 (sub.bf16x2 by c's value)

and the scale product as before. Exact: the nibble t is n's two's complement; bit 3 XOR 1
gives m = n + 8 in [0, 15]; 0x4300 | m is the bf16 of 2^7 (1 + m / 2^7) = 128 + m (exponent
134, m in the low mantissa bits; the mask leaves c's 0x4300 bits zero, so XOR is OR there);
128 + m and 136 are integers below 2^8, so the bf16 subtraction is exact and gives n. The
dequantised value n * scale is the same bf16 product, rounded once, that `q.astype(bf16) *
scale` gives. Per 64-column chunk and thread (16 pairs, 4 words): 16 LOP3 + 12 SHF + 16 HADD2
vs Mosaic's 16 PRMT + 16 LOP3 + 4 SHF + 16 HADD2. bf16 only (the magic is bf16's).

The permutation stays inside each 32-column scale group (h). `pack_int4_k_pairs` is done once
where weights are loaded; `unpack_int4_k_pairs` undoes it (it is not its own inverse).
Interpret mode (`emulate`) loads in storage order and takes the logical columns with a
reshape-transpose, then the same bit formula on whole arrays (`pair_bits`).
"""

import numpy as np
import jax.numpy as jnp
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm

from pallas_kernels.grouped_matmul import kpack

CHUNK = 64
MASK = 0x000F000F  # a pair's two nibbles at bits 0-3 and 16-19
MAGIC = 0x43084308  # bf16x2 (136, 136): 0x4300 = 128.0 with the nibble's bit 3 flip (0x0008)
BIAS = 136.0  # 128 (0x4300's value) + 8 (the two's complement -> offset-binary flip)
# logical axes (h, j, l, e) of a 64-column block, their sizes; storage order is (h, l, e, j)
_LOGICAL_SIZES = (2, 4, 4, 2)
_STORAGE_SIZES = (2, 4, 2, 4)


def _logical_column(p: int) -> int:
  """The logical K column stored at column p = 32h + 8l + 4e + j of a 64-column block."""
  h, l, e, j = p // 32, (p % 32) // 8, (p % 8) // 4, p % 4
  return 32 * h + 8 * j + 2 * l + e


# STORED_COLUMN[p]: the original column stored at column p of each 64-column block
STORED_COLUMN = np.array([_logical_column(p) for p in range(CHUNK)])


def _blocks(q, sizes):
  """q [..., K] as int8 [..., K / 64, *sizes] (int4 is neither gathered nor transposed by XLA)."""
  k = q.shape[-1]
  if k % CHUNK:
    raise ValueError(f"K={k} must be a multiple of {CHUNK}")
  return q.astype(jnp.int8).reshape(*q.shape[:-1], k // CHUNK, *sizes)


def pack_int4_k_pairs(q):
  """q [..., K] int4 in K order -> the stack `Tuning.int4_k_interleaved` reads: in each 64-column
  block, logical column 32h + 8j + 2l + e stored at 32h + 8l + 4e + j."""
  v = _blocks(q, _LOGICAL_SIZES)
  n = v.ndim  # axes [..., h, j, l, e] -> [..., h, l, e, j]
  v = jnp.moveaxis(v, n - 3, n - 1)
  return v.reshape(q.shape).astype(q.dtype)


def unpack_int4_k_pairs(q):
  """The inverse of pack_int4_k_pairs: a packed stack [..., K] back in K order."""
  v = _blocks(q, _STORAGE_SIZES)
  n = v.ndim  # axes [..., h, l, e, j] -> [..., h, j, l, e]
  v = jnp.moveaxis(v, n - 1, n - 3)
  return v.reshape(q.shape).astype(q.dtype)


def pair_bits(nibbles):
  """Nibbles (any int dtype, two's complement in the low 4 bits) -> their exact bf16 values by
  the kernel's formula, element-wise: bf16 bits ((t & 0xF) ^ 0x4308), minus 136."""
  t = nibbles.astype(jnp.int32) & 0xF
  bits = (t ^ (MAGIC & 0xFFFF)).astype(jnp.uint16)
  return lax.bitcast_convert_type(bits, jnp.bfloat16) - jnp.bfloat16(BIAS)


def logical_order(q):
  """[BN, 64] in storage order -> logical order (a reshape-transpose: no array constant)."""
  bn = q.shape[0]
  return q.reshape(bn, *_STORAGE_SIZES).transpose(0, 1, 4, 2, 3).reshape(bn, CHUNK)


def load_chunk(chunk_ref, interpret: bool):
  """A pair-packed chunk [BN, 64] of an SMEM ref -> its exact integer values as bf16 in the
  WGMMA layout, logical K order (the caller multiplies by the scales)."""
  if interpret:  # the emulation: loads in storage order, the logical columns, the same bits
    q = plgpu.load(chunk_ref, layout=plgpu.Layout.WGMMA, optimized=False)
    return pair_bits(logical_order(q))
  q = plgpu.load(chunk_ref, layout=plgpu.Layout.WGMMA_UPCAST_4X, optimized=False)
  return _dequantise(q)


def _dequantise(q):
  return kpack.on_upcast_registers(q, dequantise_registers, jnp.bfloat16)


def _pair(word_i32, j: int):
  """bf16x2 (n_lo, n_hi) of nibble slots j and j + 4 of a 32-bit word (PTX: shift, LOP3, sub)."""
  shift = f"shr.u32 t, $1, {4 * j};" if j else "mov.b32 t, $1;"
  i32 = ir.IntegerType.get_signless(32)
  out = llvm.inline_asm(
      i32, [word_i32],
      f"""
      {{
      .reg .b32 t, v, b;
      {shift}
      lop3.b32 v, t, {MASK:#010x}, {MAGIC:#010x}, 0x6a;
      mov.b32 b, {MAGIC:#010x};
      sub.bf16x2 $0, v, b;
      }}
      """,
      "=r,r")
  return mgpu_utils.bitcast(out, ir.VectorType.get((2,), ir.BF16Type.get()))


def dequantise_registers(words: "mgpu.FragmentedArray") -> "mgpu.FragmentedArray":
  """UPCAST_4X int4 registers (vector<8 x i4>, one word per row and 32-column half h) -> WGMMA
  bf16 registers (vector<2 x bf16>): register i is pair i % 4 of word i // 4 (0x6a = the LUT
  of (a & b) ^ c). Both layouts tile rows alike; only the column-tile index (dim 1) changes."""
  shape = fa.WGMMA_LAYOUT.registers_shape(words.shape)
  src = words.registers
  if src.shape[:1] + src.shape[2:] != shape[:1] + shape[2:] or shape[1] != 4 * src.shape[1]:
    raise ValueError(f"unexpected register shapes {src.shape} -> {shape}")
  i32 = ir.IntegerType.get_signless(32)
  as_i32 = {}
  regs = np.empty(shape, dtype=object)
  for idx in np.ndindex(*shape):
    key = (idx[0], idx[1] // 4) + idx[2:]
    if key not in as_i32:
      as_i32[key] = mgpu_utils.bitcast(src[key], i32)
    regs[idx] = _pair(as_i32[key], idx[1] % 4)
  return mgpu.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)


def reference_words(words: np.ndarray) -> np.ndarray:
  """The kernel's PTX on uint32 words, in numpy (for tests): [..., 4] bf16x2 pairs per word as
  float32 [..., 4, 2] (pair j: low half, high half), by the same shift / mask / xor / subtract."""
  words = np.asarray(words, np.uint32)
  out = []
  for j in range(4):
    v = ((words >> np.uint32(4 * j)) & np.uint32(MASK)) ^ np.uint32(MAGIC)
    halves = np.stack([v & 0xFFFF, v >> 16], axis=-1).astype(np.uint32)
    as_f32 = (halves << 16).view(np.float32)  # bf16 bits -> the same value in f32
    out.append(as_f32 - np.float32(BIAS))  # exact: integers below 2^8
  return np.stack(out, axis=-2)
