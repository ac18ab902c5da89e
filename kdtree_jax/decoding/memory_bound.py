"""A lower bound on the memory a traced program needs, checked before it is compiled.

bound = inputs (params, prompts) + max(outputs (caches, decode state), the largest single
intermediate any equation of the program makes, nested loops and branches included), divided
evenly over the devices. Every term is live at some point of any schedule, so a program whose
bound exceeds the device's memory cannot run: failing here saves the compile (45 s at budget
100000 before an out-of-memory error). The bound can be low; it is never too high.
"""

import dataclasses
import os

import jax
import jax.extend.core as jcore
import numpy as np

from kdtree_jax.cli import UsageError

GB = 1e9


def _nbytes(aval) -> int:
  """Bytes of one array: sub-byte dtypes packed (INT4 experts are 4 bits each: XLA packs two per
  byte on the GPU, where a byte per element would double K2.6's 76 GB one-GPU share)."""
  shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  count = int(np.prod(shape, dtype=np.int64))
  try:
    return (count * jax.dtypes.itemsize_bits(dtype) + 7) // 8
  except (TypeError, ValueError):  # PRNG key dtypes: numpy cannot read them, jax has an itemsize
    return count * (getattr(dtype, "itemsize", None) or np.dtype(dtype).itemsize)


def tree_bytes(tree) -> int:
  """Bytes of every array (or ShapeDtypeStruct) leaf of a pytree, as `_nbytes` counts them."""
  return sum(_nbytes(leaf) for leaf in jax.tree.leaves(tree))


def largest_intermediate(jaxpr) -> tuple[int, str]:
  """(bytes, 'dtype[shape] from primitive') of the largest equation output, sub-jaxprs included."""
  best = (0, "")
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      size = _nbytes(var.aval)
      if size > best[0]:
        best = (size, f"{var.aval.str_short()} from {eqn.primitive.name}")
    for sub in jcore.jaxprs_in_params(eqn.params):
      best = max(best, largest_intermediate(sub), key=lambda b: b[0])
  return best


@dataclasses.dataclass(frozen=True)
class MemoryBound:
  inputs: int
  outputs: int
  largest: int
  largest_what: str
  devices: int

  @property
  def per_device(self) -> float:
    return (self.inputs + max(self.outputs, self.largest)) / self.devices

  def describe(self) -> str:
    return (f"at least {self.per_device / GB:.2f} GB per device (inputs {self.inputs / GB:.2f} "
            f"GB + the larger of caches/state {self.outputs / GB:.2f} GB and the largest "
            f"intermediate {self.largest / GB:.2f} GB, {self.largest_what}; over "
            f"{self.devices} device(s))")


def bound_of(traced, devices: int) -> MemoryBound:
  """The bound of a `jax.jit(...).trace(...)` result."""
  inputs, outputs = tree_bytes(traced.in_avals), tree_bytes(traced.out_avals)
  largest, what = largest_intermediate(traced.jaxpr)
  return MemoryBound(inputs, outputs, largest, what, max(devices, 1))


def device_memory_bytes(limit_gb: float = 0.0) -> tuple[float, str]:
  """(bytes, where the figure came from): the limit given, the device's, or the host's free RAM."""
  if limit_gb > 0:
    return limit_gb * GB, "--config.memory_limit_gb"
  stats = jax.local_devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):
    return float(stats["bytes_limit"]), f"{jax.local_devices()[0].device_kind} memory"
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    return float(info["MemAvailable"].split()[0]) * 1024, "available host memory"
  except (OSError, KeyError, ValueError):
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "host memory"


def check_fits(traced, devices: int, limit_gb: float, field: str):
  """UsageError naming `field` when the bound exceeds what one device holds."""
  bound = bound_of(traced, devices)
  have, source = device_memory_bytes(limit_gb)
  if bound.per_device > have:
    raise UsageError(field, f"this run needs {bound.describe()}, but {source} is "
                     f"{have / GB:.2f} GB; lower --config.budget, --config.max_len or "
                     "--config.max_new_tokens, or shard it with --config.mesh")
  return bound


def check_weights_fit(weights, what: str, remedy: str, limit_gb: float = 0.0) -> float:
  """`weights` (arrays or ShapeDtypeStructs) -> their bytes, or SystemExit naming `what`, the
  device's figure and `remedy` when they alone exceed one device's memory: seconds before the
  allocation that would otherwise fail (the allocator retries for minutes before it gives up)."""
  need = tree_bytes(weights)
  have, source = device_memory_bytes(limit_gb)
  if need > have:
    raise SystemExit(f"error: {what} needs {need / GB:.3g} GB of weights alone, but {source} is "
                     f"{have / GB:.3g} GB; {remedy}")
  return need
