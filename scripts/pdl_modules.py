"""Programmatic dependent launch (Tuning.pdl) in our Mosaic kernels' lowered modules, for an
abstract H200 on this CPU: per kernel, a hash of its Mosaic module text, whether the module
carries `mosaic_gpu.uses_pdl` (what XLA's launch reads) and its griddepcontrol instructions.
With --ptx_dir the same calls are compiled deviceless (kdtree_jax.deviceless, Mosaic's PTX
dumped there) and each PTX is checked: griddepcontrol.wait comes before the first TMA load
(cp.async.bulk.tensor ... global) and the first global load, launch_dependents after it.

  .venv/bin/python scripts/pdl_modules.py [--pdl 0,1] [--ptx_dir /tmp/pdl_ptx]

The kernels: the INT4 expert FFN's two calls (bench mlp_tune's T=1 and T=16 control rows:
the promoted tunings) and tree-verify attention at 1x1x8x46000 (swap-AB) and 1x16x8x46000
(default_tuning). With --pdl 0 the hashes are those of the default kernels (compare them
before and after a change: a default-off field must leave them alone).
"""

import glob
import hashlib
import os
import re
import subprocess
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
_PDL = flags.DEFINE_list("pdl", ["0", "1"], "Tuning.pdl values to lower.")
_PTX_DIR = flags.DEFINE_string("ptx_dir", "", "If set: compile deviceless, PTX per call here.")
_WORKER = flags.DEFINE_string("worker", "", "internal: 'call:pdl' compiled in this process")
CALLS = ("gmm_t1", "gmm_t16", "tv_1x1x8x46000", "tv_1x16x8x46000")


def _gmm_args(t):
  """(fn, abstract args) of the INT4 expert FFN at K2.6's share for mlp_tune's T control row."""
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  from pallas_kernels.grouped_matmul import bench, expert_mlp
  sd = jax.ShapeDtypeStruct
  e_l, d, f, m = 48, 7168, 2048, 8 * t
  stack = lambda n, k: (sd((e_l, n, k), jnp.int4), sd((e_l, k // 32, n), jnp.bfloat16))
  tunings = bench.mlp_tunings(bench.case_rows(t)[0], m, e_l, d, f)
  return tunings, lambda ts: (lambda x, g, u, dn, s: expert_mlp(
      x, g, u, dn, s, backend="pallas", tunings=ts)), (
          sd((m, d), jnp.bfloat16), stack(f, d), stack(f, d), stack(d, f), sd((e_l,), jnp.int32))


def _tv_args(b, n, h, l):
  """(tuning, fn, abstract args) of tree-verify attention at default_tuning."""
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  from pallas_kernels.tree_verify import api
  from pallas_kernels.tree_verify.tuning import default_tuning
  sd = jax.ShapeDtypeStruct
  return default_tuning(b, n, h, l), lambda t: (lambda *a: api.tree_verify_attention_mgpu(
      *a, scale=0.1, tuning=t)), (sd((b, n, h, 576), jnp.bfloat16),
                                  sd((b, l, 576), jnp.bfloat16), sd((b,), jnp.int32),
                                  sd((b, n, n), jnp.bool_))


def call(name: str, pdl: bool):
  """(fn, abstract args) of one of CALLS with Tuning.pdl = pdl (False: the tuning as made)."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  with_pdl = lambda t: dataclasses.replace(t, pdl=True) if pdl else t
  if name.startswith("gmm_t"):
    tunings, make, args = _gmm_args(int(name[len("gmm_t"):]))
    return make(tuple(with_pdl(t) for t in tunings)), args
  tuning, make, args = _tv_args(*(int(x) for x in name[len("tv_"):].split("x")))
  return make(with_pdl(tuning)), args


def module_texts(name: str, pdl: bool) -> list[str]:
  """The Mosaic module text of each kernel of the call lowered for an abstract H200."""
  # pylint: disable=import-outside-toplevel
  import jax
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import core
  from jax.experimental.mosaic.gpu import dialect as mgpu_dialect
  core.KNOWN_KERNELS.clear()
  jax.clear_caches()
  fn, args = call(name, pdl)
  h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h200)):
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  texts = []
  ctx = jax_mlir._create_ir_context()  # pylint: disable=protected-access
  with ctx, ir.Location.unknown():
    mgpu_dialect.register_dialect(ctx)
    ctx.append_dialect_registry(jax_mlir.upstream_dialects)
    ctx.load_all_available_dialects()
    ctx.allow_unregistered_dialects = True
    for module_bytes in core.KNOWN_KERNELS.values():
      module = core._run_serde_pass(  # pylint: disable=protected-access
          ir.Module.parse(module_bytes), serialize=False)
      texts.append(str(module))
  return texts


def describe(text: str) -> str:
  """One line: hash (of the text without dump_basename's per-process counter), uses_pdl,
  griddepcontrol instruction counts."""
  text = re.sub(r'(mosaic_gpu.dump_basename = "[^"]*?)_\d+"', r'\1"', text)
  digest = hashlib.sha256(text.encode()).hexdigest()[:12]
  return (f"sha256 {digest} uses_pdl={'mosaic_gpu.uses_pdl' in text} "
          f"wait={text.count('griddepcontrol.wait')} "
          f"launch_dependents={text.count('griddepcontrol.launch_dependents')}")


_TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.\S*shared::cluster\.global")
_GLOBAL_LOAD = re.compile(r"\bld\.global|\bld\.(?:\S+\.)?global")


def ptx_order(ptx: str) -> dict:
  """Line numbers of the first griddepcontrol.wait, TMA load, global load and launch_dependents
  (None where absent) of one kernel's PTX."""
  first = {}
  for i, line in enumerate(ptx.splitlines()):
    for key, hit in (("wait", "griddepcontrol.wait" in line),
                     ("launch", "griddepcontrol.launch_dependents" in line),
                     ("tma_load", bool(_TMA_LOAD.search(line))),
                     ("global_load", bool(_GLOBAL_LOAD.search(line)))):
      if hit and key not in first:
        first[key] = i
  return {k: first.get(k) for k in ("wait", "tma_load", "global_load", "launch")}


def _compile_worker(spec):
  """Deviceless compile of one call (Mosaic's PTX goes to MOSAIC_GPU_DUMP_TO)."""
  # pylint: disable=import-outside-toplevel
  from kdtree_jax import deviceless
  target = deviceless.h200()
  import jax
  name, pdl = spec.split(":")
  fn, args = call(name, pdl == "1")
  with deviceless.gpu_kernels():
    jax.jit(fn).lower(*deviceless.on(target, args)).compile()


def _ptx_report(name, pdl):
  folder = os.path.join(_PTX_DIR.value, f"{name}_pdl{pdl}")
  os.makedirs(folder, exist_ok=True)
  env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false", MOSAIC_GPU_DUMP_PTX="1",
             MOSAIC_GPU_DUMP_TO=folder)
  out = subprocess.run([sys.executable, __file__, f"--worker={name}:{pdl}"], env=env,
                       capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"{name} pdl={pdl}: compile failed\n{out.stderr[-3000:]}")
  for path in sorted(glob.glob(os.path.join(folder, "*.ptx"))):
    with open(path) as f:
      print(f"  PTX {os.path.basename(path)}: first lines {ptx_order(f.read())}")


def main(_):
  if _WORKER.value:
    _compile_worker(_WORKER.value)
    return
  for name in CALLS:
    for pdl in _PDL.value:
      for i, text in enumerate(module_texts(name, pdl == "1")):
        print(f"{name} pdl={pdl} kernel {i}: {describe(text)}")
      if _PTX_DIR.value:
        _ptx_report(name, pdl)


if __name__ == "__main__":
  app.run(main)
