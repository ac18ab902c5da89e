"""Compile for an H200 on a machine without a GPU: XLA:GPU's own compiler, no device.

The GPU image's `jax-cuda13-pjrt` / `jax-cuda13-plugin` 0.11.2 (PyPI) compile for a described GPU
on a CPU-only machine (jax's `test_deviceless_aot_compile` does the same): the plugin gives
compile-only CUDA devices of a topology built from a GpuTargetConfigProto, and
`jax.jit(f).lower(args on those devices).compile()` runs XLA:GPU's full pipeline (fusion, Triton
and Mosaic kernels, command-buffer conversion, the thunk sequence). What the compiled program
holds (kernels per step, graphs, copies) is then the H200's program, without autotuning: a few
GEMMs may be Triton where the GPU would pick cuBLAS (notes/runtime.md compares the counts with
CUPTI's on the H200: they match).

The wheels are not a dependency of the package (they would make jax look for a GPU): install
them into a folder of their own once,

  pip install --no-deps --target .deviceless jax-cuda13-pjrt==0.11.2 jax-cuda13-plugin==0.11.2

and call `h200()` BEFORE anything initialises a JAX backend. The model picks its GPU kernels
(Mosaic tree-verify attention, the grouped expert matmul, Pallas Triton merges) when
`jax.default_backend() == "gpu"`; `gpu_kernels()` makes that hold while a program is lowered.
"""

import contextlib
import dataclasses
import os
import sys

import jax

DEFAULT_PLUGIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  ".deviceless")
# nvdisasm from the pip wheel nvidia-cuda-nvdisasm installed beside the plugins (the SASS
# checks: scripts/gmm_sass_check.py, verify_ar_deviceless.py, tree_builder_sass.py).
NVDISASM = os.path.join(DEFAULT_PLUGIN_DIR, "nvidia", "cu13", "bin", "nvdisasm")
INSTALL_HINT = ("pip install --no-deps --target {dir} jax-cuda13-pjrt==0.11.2 "
                "jax-cuda13-plugin==0.11.2")

# The H200's device description (the fields XLA:GPU's compiler reads; the values of XLA's
# h200 target spec, CUDA 13.0 as on the GPU image: driver 580, `/work/.library/device/KINDS.md`).
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 151397597184
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  driver_version: "13.0.0"
  runtime_version: "13.0.0"
  compile_time_toolkit_version: "13.0.0"
}
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""


class DevicelessUnavailable(RuntimeError):
  """The plugin wheels are not installed, or a JAX backend was initialised before `h200()`."""


@dataclasses.dataclass(frozen=True)
class Target:
  """Compile-only devices of one described GPU."""
  devices: tuple
  name: str = "NVIDIA H200"


def h200(plugin_dir: str = DEFAULT_PLUGIN_DIR) -> Target:
  """One compile-only H200. Puts `plugin_dir` on sys.path, keeps JAX's runtime on the CPU and
  tells the Mosaic GPU custom call where its runtime library is (needed at lowering)."""
  if not os.path.isdir(os.path.join(plugin_dir, "jax_plugins")):
    raise DevicelessUnavailable(
        f"no jax-cuda13 plugin in {plugin_dir}: {INSTALL_HINT.format(dir=plugin_dir)}")
  if plugin_dir not in sys.path:
    sys.path.insert(0, plugin_dir)
  jax.config.update("jax_platforms", "cpu")
  runtime_lib = os.path.join(plugin_dir, "jax_cuda13_plugin", "libmosaic_gpu_runtime.so")
  if os.path.exists(runtime_lib):
    os.environ.setdefault("MOSAIC_GPU_RUNTIME_LIB_PATH", runtime_lib)
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  try:
    topo = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET_CONFIG,
                                        topology="1x1x1")
  except Exception as e:  # the plugin failed to load: name the cause, keep the message
    raise DevicelessUnavailable(f"compile-only CUDA topology failed ({e}); "
                                f"{INSTALL_HINT.format(dir=plugin_dir)}") from e
  return Target(devices=tuple(topo.devices))


def on(target: Target, tree):
  """`tree`'s arrays / ShapeDtypeStructs as ShapeDtypeStructs placed on the target's first
  device (what `jit(...).lower` needs to compile for it)."""
  sharding = jax.sharding.SingleDeviceSharding(target.devices[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


@contextlib.contextmanager
def gpu_kernels():
  """While lowering: `jax.default_backend()` says "gpu" (the model's kernel choice reads it at
  trace time) and Pallas Triton sees an H200 (compute capability 9.0)."""
  saved = jax.default_backend
  jax.default_backend = lambda: "gpu"
  patches = [_patch_triton_capability()]
  try:
    yield
  finally:
    jax.default_backend = saved
    for undo in patches:
      undo()


def _patch_triton_capability():
  """Pallas Triton's lowering asks `gpu_info.get_gpu_info()` for the device it runs on, which
  without a device is the CPU: answer an H200's (compute capability 9.0). Returns the undo."""
  from jax._src.pallas.triton import gpu_info  # pylint: disable=import-outside-toplevel
  saved = gpu_info.get_gpu_info
  h200_info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  gpu_info.get_gpu_info = lambda: h200_info
  return lambda: setattr(gpu_info, "get_gpu_info", saved)
