"""Finds the copies that a compiled program makes of large buffers (e.g. the KV cache).

A decode step must touch the cache only where it reads attention rows and writes new ones; a
`copy` of a cache-sized buffer inside the loop body costs the whole cache's bytes every step
(the failure this project exists to avoid: a step that moves far more than its roofline bytes).
Reads XLA's optimized HLO text, so it works on any backend (the copies come from XLA's
buffer assignment / copy insertion, which the CPU and GPU compilers share).
"""

import dataclasses
import re

_BITS = re.compile(r"[a-z]+(\d+)")  # HLO element types: s4, bf16, f32, f8e4m3fn, c64, ...
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_COPY = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\][^=]*?\s(copy|copy-start)\(")


@dataclasses.dataclass(frozen=True)
class Copy:
  name: str
  computation: str
  shape: tuple[int, ...]
  nbytes: int

  @property
  def fused(self) -> bool:
    """A copy inside a fusion: a relayout the fused kernel does while it computes (it costs bytes
    only when the fusion's output is that relayout, e.g. a transposed K for a dot), not a
    buffer copy that XLA inserted to keep an old value alive."""
    return self.computation.startswith(("fused_computation", "wrapped_"))


def large_copies(hlo_text: str, min_bytes: int, *, skip_entry=True) -> list[Copy]:
  """`copy` instructions of at least min_bytes; by default only those outside the ENTRY
  computation (loop bodies and other nested computations: they run every step)."""
  out, comp, in_entry = [], "", False
  for line in hlo_text.splitlines():
    m = _COMP.match(line)
    if m and not line.startswith(" "):
      comp, in_entry = m.group(1), line.startswith("ENTRY")
      continue
    c = _COPY.match(line)
    if not c or (skip_entry and in_entry):
      continue
    dtype, dims = c.group(2), c.group(3)
    shape = tuple(int(d) for d in dims.split(",") if d)
    n = _bits(dtype)
    for d in shape:
      n *= d
    n //= 8
    if n >= min_bytes:
      out.append(Copy(c.group(1), comp, shape, n))
  return out


def _bits(hlo_type: str) -> int:
  """Bits per element of an HLO element type (pred is stored as a byte)."""
  return 8 if hlo_type == "pred" else int(_BITS.match(hlo_type).group(1))
