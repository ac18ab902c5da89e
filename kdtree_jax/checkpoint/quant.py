"""Dequantisation of the Hugging Face Kimi formats: FP8 block-scaled and INT4 pack-quantized."""

import numpy as np

SUPPORTED_QUANT = ("fp8", "compressed-tensors")


def check_quant_config(qc: dict | None) -> dict | None:
  """Validates a `quantization_config` stanza; returns it (None for unquantized checkpoints)."""
  if not qc:
    return None
  method = qc.get("quant_method")
  if method not in SUPPORTED_QUANT:
    raise ValueError(f"unknown quant_method {method!r}; supported: {SUPPORTED_QUANT} (or none)")
  if method == "compressed-tensors":
    fmt = qc.get("format")
    if fmt != "pack-quantized":
      raise ValueError(f"compressed-tensors format {fmt!r} unsupported; expected 'pack-quantized'")
    for group in qc.get("config_groups", {}).values():
      w = group.get("weights", {})
      if w.get("num_bits", 4) != 4 or w.get("type", "int") != "int" or not w.get("symmetric", True):
        raise ValueError(f"only symmetric int4 group quantization is supported; got {w}")
  return qc


def group_size(qc: dict) -> int:
  for group in qc.get("config_groups", {}).values():
    return int(group.get("weights", {}).get("group_size", 32))
  return 32


def dequant_fp8(w_fp8: np.ndarray, scale_inv: np.ndarray, block=(128, 128)) -> np.ndarray:
  """W[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128] (partial edge blocks included)."""
  rows, cols = w_fp8.shape
  br, bc = block
  want = (-(-rows // br), -(-cols // bc))
  if scale_inv.shape != want:
    raise ValueError(f"FP8 scale shape {scale_inv.shape} does not match weight {w_fp8.shape} "
                     f"with blocks {block}: expected {want}")
  s = np.repeat(np.repeat(scale_inv.astype(np.float32), br, axis=0), bc, axis=1)[:rows, :cols]
  return w_fp8.astype(np.float32) * s


def unpack_int4(packed: np.ndarray, cols: int) -> np.ndarray:
  """int32 [out, in/8] -> int8 [out, in] in [-8, 7]; nibble k of each word is (v >> 4k) & 0xF."""
  u = packed.astype(np.uint32)
  nib = np.stack([(u >> (4 * k)) & 0xF for k in range(8)], axis=-1)
  return (nib.reshape(packed.shape[0], -1)[:, :cols].astype(np.int8) - 8)


def pack_int4(q: np.ndarray) -> np.ndarray:
  """Inverse of `unpack_int4` (q int in [-8, 7], in % 8 == 0), for writing test checkpoints."""
  rows, cols = q.shape
  if cols % 8:
    raise ValueError(f"int4 packing needs in % 8 == 0, got {cols}")
  nib = (q.astype(np.int32) + 8).astype(np.uint32).reshape(rows, cols // 8, 8)
  words = np.zeros((rows, cols // 8), np.uint32)
  for k in range(8):
    words |= nib[..., k] << (4 * k)
  return words.view(np.int32)


def dequant_int4(packed: np.ndarray, scale: np.ndarray, shape, gsize: int = 32) -> np.ndarray:
  """W = (nibble - 8) * scale[row, col // group] in f32."""
  rows, cols = int(shape[0]), int(shape[1])
  if packed.shape != (rows, cols // 8):
    raise ValueError(f"weight_packed shape {packed.shape} does not match weight_shape "
                     f"{(rows, cols)} (expected {(rows, cols // 8)})")
  if scale.shape != (rows, cols // gsize):
    raise ValueError(f"weight_scale shape {scale.shape} does not match {(rows, cols // gsize)}")
  q = unpack_int4(packed, cols).astype(np.float32)
  return q * np.repeat(scale.astype(np.float32), gsize, axis=1)
