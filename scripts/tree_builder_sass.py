"""The DDTree builder kernel's machine code for an H200, compiled on a machine WITHOUT a GPU:
registers, spilled bytes (stack frame), SASS instructions and local-memory loads / stores per
(budget, warps), before any device time is spent.

XLA:GPU's own compiler (kdtree_jax.deviceless) compiles `ddtree_build.build_from_topk` for a
compile-only H200 with `xla_gpu_kernel_cache_file` set, which makes it write every kernel's
cubin, uncompressed, to that file; the `_kernel` cubin's .nv.info gives registers
(EIATTR_REGCOUNT) and the frame (EIATTR_FRAME_SIZE: bytes of spilled registers per thread),
and nvdisasm (.deviceless/nvidia/cu13/bin: `pip install --target .deviceless
nvidia-cuda-nvdisasm`) its static SASS (counts of the code, not of executed instructions). A
frame > 0 (LDL / STL) is the register spilling that made the removed rank-counting kernel 8x
slower past Cp 128 (notes/tree_builder.md):

  python scripts/tree_builder_sass.py --budgets 15,31,47,63 --num_warps 4,8

~5-50 s per program on 2 CPU cores.
"""

import collections
import functools
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kdtree_jax import deviceless  # pylint: disable=wrong-import-position

_BUDGETS = flags.DEFINE_list("budgets", ["15", "31", "47", "63"], "Tree budgets n (K = n).")
_WARPS = flags.DEFINE_list("num_warps", ["4", "8"], "Triton warps.")
_DEPTHS = flags.DEFINE_integer("depths", 15, "Draft depths J (block - 1).")
_NVDISASM = flags.DEFINE_string(
    "nvdisasm", deviceless.NVDISASM,
    "nvdisasm binary ('' = registers and frame only).")

_EIATTR = {0x2f: "regs", 0x11: "frame"}   # EIATTR_REGCOUNT, EIATTR_FRAME_SIZE (EIFMT_SVAL)


def cubins(blob: bytes):
  """The ELF images in `blob` (each cut at the end of its section / program headers)."""
  for m in re.finditer(rb"\x7fELF\x02", blob):
    s = m.start()
    try:
      phoff, shoff = struct.unpack_from("<QQ", blob, s + 0x20)
      phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", blob, s + 0x36)
    except struct.error:
      continue
    if shentsize == 64 and shoff <= len(blob):
      yield blob[s:s + max(shoff + shentsize * shnum, phoff + phentsize * phnum)]


def _sections(elf: bytes):
  """{name: bytes} of an ELF64 image."""
  shoff, = struct.unpack_from("<Q", elf, 0x28)
  shnum, shstrndx = struct.unpack_from("<HH", elf, 0x3C)
  heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + 64 * i) for i in range(shnum)]
  names = heads[shstrndx][4]
  name = lambda off: elf[names + off:elf.index(b"\0", names + off)].decode()
  return {name(h[0]): elf[h[4]:h[4] + h[5]] for h in heads}


def nv_info(elf: bytes) -> dict:
  """{regs, frame} from the .nv.info sections' EIFMT_SVAL records [fmt, attr, size, sym, value]."""
  out = {}
  for name, data in _sections(elf).items():
    i = 0
    while name.startswith(".nv.info") and i + 4 <= len(data):
      fmt, attr, size = data[i], data[i + 1], struct.unpack_from("<H", data, i + 2)[0]
      if fmt == 4 and attr in _EIATTR:
        out[_EIATTR[attr]] = struct.unpack_from("<I", data, i + 8)[0]
      i += 4 if fmt in (1, 2, 3) else 4 + size
  return out


def sass_counts(elf: bytes, nvdisasm: str) -> collections.Counter:
  """Static SASS instructions and local (LDL / STL), shared (LDS / STS) and barrier ops."""
  counts = collections.Counter()
  if not nvdisasm:
    return counts
  with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(elf)
    f.flush()
    text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                          check=True).stdout
  for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text):
    counts["sass"] += 1
    if op in ("LDL", "STL", "LDS", "STS", "BAR"):
      counts[op] += 1
  return counts


def compile_kernel(target, n, warps, depths, cache_file):
  """Compiles the builder (top-k log-probs [J, n] in) for the target; returns compile seconds."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from pallas_kernels import ddtree_build  # pylint: disable=import-outside-toplevel
  fn = jax.jit(functools.partial(ddtree_build.build_from_topk, n=n, num_warps=warps))
  args = deviceless.on(target, (jax.ShapeDtypeStruct((depths, n), jnp.float32),
                                jax.ShapeDtypeStruct((depths, n), jnp.int32)))
  t0 = time.perf_counter()
  with deviceless.gpu_kernels():
    lowered = fn.lower(*args)
  lowered.compile(compiler_options={"xla_gpu_kernel_cache_file": cache_file})
  return time.perf_counter() - t0


def kernel_row(target, n, warps, depths, nvdisasm):
  """One program's row: the Triton `_kernel`'s registers, frame and SASS counts."""
  from pallas_kernels import ddtree_build  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as tmp:
    cache = os.path.join(tmp, "kernels.bin")
    secs = compile_kernel(target, n, warps, depths, cache)
    with open(cache, "rb") as f:
      blob = f.read()
  for elf in cubins(blob):
    if b".text._kernel" in elf:
      return dict(budget=n, warps=warps,
                  cp=ddtree_build.padded_candidates(n, n), compile_s=secs, **nv_info(elf),
                  **sass_counts(elf, nvdisasm))
  raise RuntimeError("no _kernel cubin in XLA's kernel cache")


def main(_):
  import jax  # pylint: disable=import-outside-toplevel
  target = deviceless.h200()
  jax.config.update("jax_enable_compilation_cache", False)   # compile, do not load
  nvdisasm = _NVDISASM.value if os.path.exists(_NVDISASM.value) else ""
  print(f"{'budget':>6} {'Cp':>4} {'warps':>5} {'regs':>4} {'frame B':>7} "
        f"{'SASS':>6} {'LDL':>5} {'STL':>5} {'BAR':>4} {'comp s':>6}   (H200, deviceless)")
  for n in [int(b) for b in _BUDGETS.value]:
    for w in [int(x) for x in _WARPS.value]:
      r = kernel_row(target, n, w, _DEPTHS.value, nvdisasm)
      print(f"{n:>6} {r['cp']:>4} {w:>5} {r.get('regs', '-'):>4} "
            f"{r.get('frame', '-'):>7} {r.get('sass', '-'):>6} {r.get('LDL', 0):>5} "
            f"{r.get('STL', 0):>5} {r.get('BAR', 0):>4} {r['compile_s']:6.1f}", flush=True)


if __name__ == "__main__":
  app.run(main)
