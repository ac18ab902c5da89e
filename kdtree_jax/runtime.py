"""Process-wide runtime setup that every script does first: XLA flags and the compilation cache.

* Persistent compilation cache, on by default: the folder JAX is already configured with
  (jax_compilation_cache_dir), else `DEFAULT_CACHE_DIR` (~/.cache/kdtree_jax/xla). A program
  compiled once (e.g. the 61-layer decode loop) is read back from disk by the next process with
  the same program, jax/jaxlib and device. `compile_cache_dir=""` turns it off.
* XLA GPU command buffers (CUDA graphs) for fusions, cuBLAS, custom calls (Pallas / Mosaic
  kernels) and while / conditional, on by default: the device loop's body then launches as one
  graph instead of one host launch per kernel (measured on an H200: per-step host gap
  540 us -> ~0). `command_buffers=False` turns them off. CPU runs ignore the flag.

XLA reads its flags once, when the backend initialises: `setup` must run before anything creates
an array or asks for a device. Scripts call `define_flags()` at import; absl then runs `setup`
after parsing the command line and before `main` (`--compile_cache_dir`, `--command_buffers`).
"""

import dataclasses
import os

import jax
from jax._src import xla_bridge

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "kdtree_jax", "xla")
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"
COMMAND_BUFFER_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
  """compile_cache_dir: persistent compilation cache folder ("" = off; None = JAX's configured
  folder, else DEFAULT_CACHE_DIR).
  command_buffers: XLA GPU command buffers for every program, the decode loop included."""

  compile_cache_dir: str | None = None
  command_buffers: bool = True


def xla_flags_with(flags: str, command_buffers: bool) -> str:
  """XLA_FLAGS with the command-buffer flag set as asked (an explicit earlier value replaced)."""
  kept = [f for f in flags.split() if not f.startswith(COMMAND_BUFFER_FLAG + "=")]
  value = COMMAND_BUFFER_TYPES if command_buffers else ""
  return " ".join(kept + [f"{COMMAND_BUFFER_FLAG}={value}"])


def setup(cfg: RuntimeConfig = RuntimeConfig()) -> RuntimeConfig:
  """Applies `cfg` to this process. Raises if the XLA backend is already running (too late for
  XLA flags): call it before the first array or device query."""
  if xla_bridge.backends_are_initialized():
    raise RuntimeError("runtime.setup() ran after the JAX backend initialised, so XLA flags "
                       "(command buffers) cannot apply; call it first in the script (scripts: "
                       "runtime.define_flags() at import)")
  os.environ["XLA_FLAGS"] = xla_flags_with(os.environ.get("XLA_FLAGS", ""), cfg.command_buffers)
  folder = cfg.compile_cache_dir
  if folder is None:
    folder = jax.config.jax_compilation_cache_dir or DEFAULT_CACHE_DIR
  if folder:
    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      min(0.5, jax.config.jax_persistent_cache_min_compile_time_secs))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_enable_compilation_cache", bool(folder))
  return dataclasses.replace(cfg, compile_cache_dir=folder)


_APPLIED: list[RuntimeConfig] = []


def define_flags():
  """absl flags --compile_cache_dir / --command_buffers, applied by `setup` right after the
  command line is parsed (before `main`). Call once, at a script's import time."""
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  cache = flags.DEFINE_string("compile_cache_dir", None, "Persistent XLA compilation cache "
                              f"folder ('' = off; default: JAX's configured one, else "
                              f"{DEFAULT_CACHE_DIR}).")
  cbuf = flags.DEFINE_bool("command_buffers", True, "XLA GPU command buffers (CUDA graphs) for "
                           "fusions, cuBLAS, custom calls, while and conditional.")
  app.call_after_init(lambda: _APPLIED.append(setup(RuntimeConfig(cache.value, cbuf.value))))


def applied() -> RuntimeConfig | None:
  """The RuntimeConfig this process was set up with by `define_flags`, or None."""
  return _APPLIED[-1] if _APPLIED else None
