"""A small, strict safetensors reader/writer over numpy memory maps.

Reads bf16 and float8_e4m3fn through ml_dtypes, validates the header against the file size
(truncated files fail with a clear error), and never loads a whole file into memory.
"""

import json
import os
import struct

import ml_dtypes
import numpy as np

from kdtree_jax.cli import DataError

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I16": np.int16,
    "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class SafetensorsFile:
  """Lazy access to the tensors of one .safetensors file."""

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise DataError(path, f"truncated safetensors file ({size} bytes, no header)")
      (n,) = struct.unpack("<Q", head)
      if 8 + n > size:
        raise DataError(path, f"truncated safetensors file (header says {n} bytes, file has "
                        f"{size}); download or convert it again")
      try:
        header = json.loads(f.read(n))
      except json.JSONDecodeError as e:
        raise DataError(path, f"corrupt safetensors header: {e}") from e
    self.metadata = header.pop("__metadata__", None)
    self.header = header
    self.data_start = 8 + n
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if self.data_start + end > size:
      raise DataError(path, f"truncated safetensors file: tensors need "
                      f"{self.data_start + end} bytes, file has {size}; download or convert it "
                      "again")

  def keys(self):
    return self.header.keys()

  def dtype(self, name: str) -> str:
    return self.header[name]["dtype"]

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.header[name]["shape"])

  def get(self, name: str) -> np.ndarray:
    """The tensor as a read-only numpy array backed by a memory map."""
    info = self.header[name]
    if info["dtype"] not in DTYPES:
      raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    dt = np.dtype(DTYPES[info["dtype"]])
    start, end = info["data_offsets"]
    count = int(np.prod(info["shape"], dtype=np.int64))
    if end - start != count * dt.itemsize:
      raise ValueError(f"{self.path}: tensor {name!r} byte range does not match {info['shape']} "
                       f"{info['dtype']}")
    arr = np.memmap(self.path, dtype=dt, mode="r", offset=self.data_start + start,
                    shape=(count,))
    return arr.reshape(info["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None):
  """Writes tensors (numpy, incl. ml_dtypes bf16/fp8) in safetensors format, atomically."""
  header, offset, blobs = {}, 0, []
  for name, arr in tensors.items():
    arr = np.ascontiguousarray(arr)
    if arr.dtype not in NAMES:
      raise ValueError(f"cannot save {name!r}: dtype {arr.dtype} has no safetensors name")
    blob = arr.tobytes()
    header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + len(blob)]}
    blobs.append(blob)
    offset += len(blob)
  if metadata:
    header["__metadata__"] = metadata
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for blob in blobs:
      f.write(blob)
  os.replace(tmp, path)


class CheckpointDir:
  """All tensors of a HF checkpoint directory (one file, several files, with or without index)."""

  INDEX = "model.safetensors.index.json"

  def __init__(self, path: str):
    if not os.path.isdir(path):
      raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    self.path = path
    self.files: dict[str, SafetensorsFile] = {}
    self.where: dict[str, str] = {}
    index = os.path.join(path, self.INDEX)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      for fname in sorted(set(weight_map.values())):
        fpath = os.path.join(path, fname)
        if not os.path.exists(fpath):
          raise FileNotFoundError(f"{self.INDEX} lists shard {fname!r}, which is missing from {path}")
        self.files[fname] = SafetensorsFile(fpath)
      for name, fname in weight_map.items():
        if name not in self.files[fname].header:
          raise ValueError(f"{self.INDEX} puts {name!r} in {fname}, but that file does not hold it")
        self.where[name] = fname
    else:
      names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
      if not names:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
      for fname in names:
        self.files[fname] = SafetensorsFile(os.path.join(path, fname))
        for name in self.files[fname].keys():
          self.where[name] = fname

  def __contains__(self, name: str) -> bool:
    return name in self.where

  def keys(self):
    return self.where.keys()

  def get(self, name: str) -> np.ndarray:
    return self.files[self.where[name]].get(name)

  def dtype(self, name: str) -> str:
    return self.files[self.where[name]].dtype(name)

  def shape(self, name: str) -> tuple[int, ...]:
    return self.files[self.where[name]].shape(name)
