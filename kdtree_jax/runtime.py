"""Process-wide runtime setup that every script does first: XLA flags and the compilation cache.

* Persistent compilation cache, on by default: the folder JAX is already configured with
  (jax_compilation_cache_dir), else `DEFAULT_CACHE_DIR` (~/.cache/kdtree_jax/xla). A program
  compiled once (e.g. the 61-layer decode loop) is read back from disk by the next process with
  the same program, jax/jaxlib and device. `compile_cache_dir=""` turns it off.
* XLA GPU command buffers (CUDA graphs) for fusions, cuBLAS, cuDNN, FFI custom calls (Mosaic
  kernels), dynamic-slice fusions and while / conditional: ON by default, with
  --xla_gpu_graph_min_graph_size=1. At XLA's default minimum (5) the decode loop's program (a
  kernel and the while at its top level) formed NO graph (notes/runtime.md); at 1 the whole
  61-layer loop is one graph, the while a conditional node: one graph launch per call, no host
  work per iteration. Measured on an H200 (2026-12-01, K2.6's 61-layer share at 46k, one run):
  ar 9.04 -> 5.21 ms/step, DDTree 15 20.45 -> 9.71 (11.6 without graphs on another machine);
  the trained pair's ar 4453 -> 5129 tok/s (WORKSPACE.md). `command_buffers=False`
  (`--nocommand_buffers`) sets --xla_gpu_enable_command_buffer= empty, so XLA's own default set
  is off too (`COMMAND_BUFFER_OPTIONS` compiles one program with them, for an A/B;
  `command_buffer_options` also dumps XLA's thunks, which show what became graphs). CPU runs
  ignore the flags.
* The graph's nodes ordered by their buffer dependencies (`command_buffer_scheduling`
  "CONCURRENT", --xla_gpu_command_buffer_scheduling_mode) instead of XLA's default LHS, which
  chains every node to the one before (notes/runtime.md): independent kernels (the q and kv
  paths, shared vs routed experts, the draft beside nothing) may run side by side. Measured on
  an H200 (2026-12-05, K2.6's 61-layer share at 46k, the loop with and without in one run,
  results/h200/2026-12-05/s11_k26_conc.log): ar 5.186 -> 4.944 ms/step, DDTree 15 9.857 ->
  9.369; tokens per step unchanged (1.00 / 2.00).

XLA reads its flags once, when the backend initialises: `setup` must run before anything creates
an array or asks for a device. Scripts call `define_flags()` at import; absl then runs `setup`
after parsing the command line and before `main` (`--compile_cache_dir`, `--command_buffers`,
`--command_buffer_scheduling`).
"""

import dataclasses
import os

import jax
from jax._src import xla_bridge

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "kdtree_jax", "xla")
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"
# XLA's own default set (jax 0.11.2: FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN,
# DYNAMIC_SLICE_FUSION) plus WHILE and CONDITIONAL: a thunk of a type left out cannot join a
# graph, and one such thunk in a loop's body keeps the whole loop out of one (notes/runtime.md).
COMMAND_BUFFER_TYPES = ("FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,"
                        "CONDITIONAL")
MIN_GRAPH_FLAG = "--xla_gpu_graph_min_graph_size"
# XLA keeps a run of fewer convertible thunks than this out of graphs, counting the run's own
# thunks only (a while counts 1, however large its body): the decode loop's program is 2 thunks
# at the top (a kernel and the while), so XLA's default of 5 kept the WHOLE loop out of graphs,
# every iteration host-driven with command buffers on or off (notes/runtime.md).
COMMAND_BUFFER_MIN_GRAPH_SIZE = 1
SCHEDULING_FLAG = "--xla_gpu_command_buffer_scheduling_mode"
# XLA's CommandBufferSchedulingMode names (jax 0.11.2; XLA's default is LHS, an unknown name
# aborts XLA at start-up): how a graph's nodes depend on each other.
SCHEDULING_MODES = ("CONCURRENT", "LHS", "SERIALIZE")
COMMAND_BUFFER_SCHEDULING = "CONCURRENT"
# compiler_options of one program compiled WITH command buffers whatever the process runs with
# (`lowered.compile(compiler_options=...)`; XLA splits the repeated field's value at commas).
COMMAND_BUFFER_OPTIONS = {"xla_gpu_enable_command_buffer": COMMAND_BUFFER_TYPES,
                          "xla_gpu_graph_min_graph_size": COMMAND_BUFFER_MIN_GRAPH_SIZE,
                          "xla_gpu_command_buffer_scheduling_mode": COMMAND_BUFFER_SCHEDULING}


def command_buffer_options(dump_dir: str | None = None) -> dict:
  """COMMAND_BUFFER_OPTIONS, and with `dump_dir` XLA's dump of the compile into that folder:
  among its files the thunk sequence after the command-buffer conversion (profiling_hlo.
  thunk_report reads it), the only place that shows which thunks joined graphs: XLA forms
  command buffers from thunks, after the optimised HLO. A cache hit compiles nothing, so dumps
  nothing (the dump folder is not part of JAX's cache key)."""
  return dict(COMMAND_BUFFER_OPTIONS, **({"xla_dump_to": dump_dir} if dump_dir else {}))


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
  """compile_cache_dir: persistent compilation cache folder ("" = off; None = JAX's configured
  folder, else DEFAULT_CACHE_DIR).
  command_buffers: XLA GPU command buffers for every program, the decode loop included (on by
  default: the module docstring says why).
  command_buffer_scheduling: how a graph's nodes depend on each other (SCHEDULING_MODES;
  "CONCURRENT": by buffer conflicts, measured faster than XLA's default "LHS" chain)."""

  compile_cache_dir: str | None = None
  command_buffers: bool = True
  command_buffer_scheduling: str = COMMAND_BUFFER_SCHEDULING

  def __post_init__(self):
    if self.command_buffer_scheduling not in SCHEDULING_MODES:
      raise ValueError(f"command_buffer_scheduling={self.command_buffer_scheduling!r} must be "
                       f"one of {SCHEDULING_MODES}")


def xla_flags_with(flags: str, command_buffers: bool,
                   scheduling: str = COMMAND_BUFFER_SCHEDULING) -> str:
  """XLA_FLAGS with the command-buffer flag set as asked, and with command buffers on the
  minimum graph size that lets the decode loop become one and the graph's scheduling mode
  (explicit earlier values replaced)."""
  replaced = (COMMAND_BUFFER_FLAG + "=",) + (
      (MIN_GRAPH_FLAG + "=", SCHEDULING_FLAG + "=") if command_buffers else ())
  kept = [f for f in flags.split() if not f.startswith(replaced)]
  if not command_buffers:
    return " ".join(kept + [f"{COMMAND_BUFFER_FLAG}="])
  return " ".join(kept + [f"{COMMAND_BUFFER_FLAG}={COMMAND_BUFFER_TYPES}",
                          f"{MIN_GRAPH_FLAG}={COMMAND_BUFFER_MIN_GRAPH_SIZE}",
                          f"{SCHEDULING_FLAG}={scheduling}"])


def setup(cfg: RuntimeConfig = RuntimeConfig()) -> RuntimeConfig:
  """Applies `cfg` to this process. Raises if the XLA backend is already running (too late for
  XLA flags): call it before the first array or device query."""
  if xla_bridge.backends_are_initialized():
    raise RuntimeError("runtime.setup() ran after the JAX backend initialised, so XLA flags "
                       "(command buffers) cannot apply; call it first in the script (scripts: "
                       "runtime.define_flags() at import)")
  os.environ["XLA_FLAGS"] = xla_flags_with(os.environ.get("XLA_FLAGS", ""), cfg.command_buffers,
                                           cfg.command_buffer_scheduling)
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
  _APPLIED.append(dataclasses.replace(cfg, compile_cache_dir=folder))
  return _APPLIED[-1]


_APPLIED: list[RuntimeConfig] = []


def define_flags():
  """absl flags --compile_cache_dir / --command_buffers, applied by `setup` right after the
  command line is parsed (before `main`). Call once, at a script's import time."""
  from absl import app, flags  # pylint: disable=import-outside-toplevel
  cache = flags.DEFINE_string("compile_cache_dir", None, "Persistent XLA compilation cache "
                              f"folder ('' = off; default: JAX's configured one, else "
                              f"{DEFAULT_CACHE_DIR}).")
  cbuf = flags.DEFINE_bool("command_buffers", RuntimeConfig.command_buffers, "XLA GPU command "
                           "buffers (CUDA graphs) for fusions, cuBLAS, custom calls, while and "
                           "conditional (on by default: the whole decode loop is one graph).")
  sched = flags.DEFINE_enum("command_buffer_scheduling", COMMAND_BUFFER_SCHEDULING,
                            SCHEDULING_MODES, "How a CUDA graph's nodes depend on each other: "
                            "CONCURRENT (by buffer conflicts) or XLA's LHS / SERIALIZE chains.")
  app.call_after_init(lambda: setup(RuntimeConfig(cache.value, cbuf.value, sched.value)))


def applied() -> RuntimeConfig | None:
  """The RuntimeConfig this process was set up with (`setup`, e.g. by `define_flags`), or None."""
  return _APPLIED[-1] if _APPLIED else None


def command_buffers_on() -> bool:
  """Whether this process compiles with command buffers: as `setup` applied them; a process never
  set up runs XLA's own default (on for fusions, cuBLAS and custom calls)."""
  return applied().command_buffers if applied() is not None else True
