"""Tree-verify variants compiled for an H200 on this CPU (kdtree_jax.deviceless), one process per
variant: the compiled call's kernels (XLA's thunk sequence: name, grid, threads, static SMEM), the
Mosaic kernel's SMEM scratch and ptxas registers / spills, and its loops' SASS instruction mix
(backward branches of `nvdisasm -c`; the per-tile loops of notes/kernel.md "Why N=1, H=8 costs
17 + 3 us"). Facts of the compiled program only: no timing.

  .venv/bin/python scripts/verify_ar_deviceless.py [--shape 1,1,8,46000] \
      [--variants "default;balanced_splits=1;merge_loads_first=1"] [--loops]

Needs the jax-cuda13 wheels in .deviceless (kdtree_jax/deviceless.py) and, for --loops, nvdisasm
(the nvidia-cuda-nvdisasm wheel in .deviceless, WORKSPACE.md "Setup") and ptxas.
"""

import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SHAPE = flags.DEFINE_string("shape", "1,1,8,46000", "B,N,H,L")
_VARIANTS = flags.DEFINE_string("variants", "default;balanced_splits=1;merge_loads_first=1;"
                                "merge_cols=32;num_splits=128",
                                "';'-separated k=v,k=v Tuning fields over default_tuning")
_LOOPS = flags.DEFINE_bool("loops", False, "print the Mosaic kernel's loops (SASS) too")
_WORKER = flags.DEFINE_string("worker", "", "internal: compile this one variant (dump folders "
                              "from the environment run_worker sets)")
_PTXAS = "/usr/local/cuda-13.0/bin/ptxas"
_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def tuning_of(spec, b, n, h, l):
  """default_tuning with the spec's fields over it ('default': none)."""
  # pylint: disable-next=import-outside-toplevel
  from pallas_kernels.tree_verify.tuning import Tuning, default_tuning
  pairs = () if spec == "default" else (kv.split("=") for kv in spec.split(","))
  fields = {k: v if k == "merge" else int(v) for k, v in pairs}  # merge=xla / triton: a name
  return Tuning(**(default_tuning(b, n, h, l).__dict__ | fields))


def compile_variant(spec):
  """Worker: compile the call for the compile-only H200 (Mosaic's PTX and XLA's dump go where
  run_worker's environment says)."""
  sys.path.insert(0, ROOT)
  from kdtree_jax import deviceless  # pylint: disable=import-outside-toplevel
  target = deviceless.h200()
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from pallas_kernels.tree_verify import api  # pylint: disable=import-outside-toplevel
  b, n, h, l = (int(x) for x in _SHAPE.value.split(","))
  t = tuning_of(spec, b, n, h, l)
  sd = jax.ShapeDtypeStruct
  args = deviceless.on(target, (sd((b, n, h, 576), jnp.bfloat16), sd((b, l, 576), jnp.bfloat16),
                                sd((b,), jnp.int32), sd((b, n, n), jnp.bool_)))
  with deviceless.gpu_kernels():
    jax.jit(lambda *a: api.tree_verify_attention_mgpu(*a, scale=0.1, tuning=t)).lower(
        *args).compile()
  print("TUNING", t)


def run_worker(spec, folder):
  """Compiles `spec` in a fresh process (the deviceless target must come before any backend);
  returns its Tuning's repr."""
  os.makedirs(os.path.join(folder, "mosaic"))
  env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false", MOSAIC_GPU_DUMP_PTX="1",
             MOSAIC_GPU_DUMP_TO=os.path.join(folder, "mosaic"),
             XLA_FLAGS=f"--xla_dump_to={os.path.join(folder, 'xla')}")
  out = subprocess.run([sys.executable, __file__, f"--shape={_SHAPE.value}", f"--worker={spec}"],
                       env=env, capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"{spec}: compile failed\n{out.stderr[-3000:]}")
  return next(line[len("TUNING "):] for line in out.stdout.splitlines()
              if line.startswith("TUNING "))


def sass_loops(ptx):
  """[(first, last address, instruction count, top opcodes)] of the kernel's backward branches
  that close a loop of more than 8 instructions (the barrier-retry stubs are shorter)."""
  sys.path.insert(0, ROOT)
  from kdtree_jax import deviceless  # pylint: disable=import-outside-toplevel
  cubin = ptx[:-len(".ptx")] + ".cubin"
  subprocess.run([_PTXAS, "-arch=sm_90a", ptx, "-o", cubin], check=True, capture_output=True)
  text = subprocess.run([deviceless.NVDISASM, "-c", cubin], capture_output=True, text=True,
                        check=True).stdout
  labels, ins, pending = {}, [], []
  for line in text.splitlines():
    if m := _LABEL.match(line):
      pending.append(m[1])
    elif m := _INS.search(line):
      for name in pending:
        labels[name] = int(m[1], 16)
      pending = []
      ins.append((int(m[1], 16), re.sub(r"^@!?U?P\w+\s+", "", m[2])))
  loops = []
  for addr, op in ins:
    m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", op)
    if m and labels.get(m[1], addr) < addr:
      body = [o for a, o in ins if labels[m[1]] <= a <= addr]
      if len(body) > 8 and "EXIT" not in " ".join(body) and "NANOSLEEP" not in " ".join(body):
        mix = collections.Counter(o.split()[0].split(".")[0] for o in body)
        loops.append((labels[m[1]], addr, len(body), mix.most_common(12)))
  return loops


def report(spec, folder):
  print(f"== {spec}: {run_worker(spec, folder)}")
  for path in glob.glob(os.path.join(folder, "xla", "*thunk_sequence.txt")):
    for line in open(path):
      if "kCustomKernel" in line:
        print("  kernel:", line.split("]", 1)[1].strip())
      elif "kCustomCall" in line:
        print("  kernel: a custom call (the Mosaic kernel)")
  for path in sorted(glob.glob(os.path.join(folder, "mosaic", "*.resources.txt"))):
    smem = re.search(r"smem_scratch_bytes=(\d+)", open(path).read())
    print(f"  Mosaic SMEM scratch: {smem[1]} bytes")
  for path in sorted(glob.glob(os.path.join(folder, "mosaic", "*.ptxas"))):
    for line in open(path):
      if "registers" in line or "spill" in line:
        print("  ptxas:", line.strip().replace("ptxas info    : ", ""))
  if _LOOPS.value:
    for ptx in sorted(glob.glob(os.path.join(folder, "mosaic", "*.ptx"))):
      for lo, hi, count, mix in sass_loops(ptx):
        print(f"  loop {lo:#06x}-{hi:#06x}: {count} instructions per warp per trip |",
              ", ".join(f"{k} {v}" for k, v in mix))


def main(_):
  if _WORKER.value:
    compile_variant(_WORKER.value)
    return
  for spec in filter(None, _VARIANTS.value.split(";")):
    with tempfile.TemporaryDirectory() as folder:
      report(spec, folder)


if __name__ == "__main__":
  app.run(main)
