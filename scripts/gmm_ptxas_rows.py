"""ptxas' register counts of the INT4 expert FFN's two kernels per bench `mlp_tune` row, for an
H200, on a CPU-only machine (the deviceless compile of kdtree_jax.deviceless; the counts equal
the H200 ptxas log's for the same rows, s8_moe_tune_run*.log). Registers per thread set the CTAs
an SM holds (65536 / (128 x registers rounded up to 8)): notes/int4_small_t.md.

  .venv/bin/python scripts/gmm_ptxas_rows.py --cases 1,16 [--ptx_dir DIR]
  .venv/bin/python scripts/gmm_ptxas_rows.py --cases 16 --variants 'GATED|DOWN,...'

--variants: the given `apply_variant` rows (as bench's --mlp_variants) instead of the case's own.

--ptx_dir keeps each kernel's PTX (MOSAIC_GPU_DUMP_TO) for `ptxas -arch=sm_90a` + `nvdisasm -c`
(Mosaic's own SASS dump needs nvdisasm on its path; without it it logs an error and goes on).
"""

import os
import subprocess
import sys

from absl import app, flags

_CASES = flags.DEFINE_list("cases", ["1", "16"], "mlp_tune cases (T) whose rows to compile.")
_PTX_DIR = flags.DEFINE_string("ptx_dir", "", "If set, one subfolder of PTX per row.")
_VARIANTS = flags.DEFINE_list("variants", [], "Rows to compile instead of bench.case_rows(T).")
_ROW = flags.DEFINE_string("compile_row", "", "Internal: compile row 'T:name' in this process.")


def _compile_row(t: int, name: str):
  """Compiles the mlp_tune row `name` of case T deviceless; ptxas' log goes to stderr."""
  # pylint: disable=import-outside-toplevel
  from kdtree_jax import deviceless
  target = deviceless.h200()
  import jax
  import jax.numpy as jnp
  from pallas_kernels.grouped_matmul import bench, expert_mlp
  sd = jax.ShapeDtypeStruct
  e_l, d, f, m = 48, 7168, 2048, 8 * t
  stack = lambda n, k: (sd((e_l, n, k), jnp.int4), sd((e_l, k // 32, n), jnp.bfloat16))
  tunings = bench.mlp_tunings(name, m, e_l, d, f)
  fn = lambda x, g, u, dn, s: expert_mlp(x, g, u, dn, s, backend="pallas", tunings=tunings)
  args = deviceless.on(target, (sd((m, d), jnp.bfloat16), stack(f, d), stack(f, d),
                                stack(d, f), sd((e_l,), jnp.int32)))
  with deviceless.gpu_kernels():
    jax.jit(fn).lower(*args).compile()


def _registers(log: str) -> list[str]:
  """'kernel: N' per kernel from a ptxas -v log."""
  out, name = [], None
  for line in log.splitlines():
    if "Compiling entry function" in line:
      name = line.split("'")[1].removesuffix("_mosaic_gpu_kernel")
    elif "registers" in line and name:
      out.append(f"{name}: {line.split('Used ')[1].split(' registers')[0]}")
  return out


def main(_):
  if _ROW.value:
    t, name = _ROW.value.split(":", 1)
    _compile_row(int(t), name)
    return
  from pallas_kernels.grouped_matmul import bench  # pylint: disable=import-outside-toplevel
  for t in map(int, _CASES.value):
    for index, name in enumerate(_VARIANTS.value or bench.case_rows(t)):
      env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1")
      if _PTX_DIR.value:  # one process per row: Mosaic reads the dump settings once
        env["MOSAIC_GPU_DUMP_TO"] = os.path.join(_PTX_DIR.value, f"T{t}_row{index}")
        os.makedirs(env["MOSAIC_GPU_DUMP_TO"], exist_ok=True)
      run = subprocess.run([sys.executable, __file__, f"--compile_row={t}:{name}"], env=env,
                           capture_output=True, text=True, check=False)
      log = run.stdout + run.stderr
      if _PTX_DIR.value:  # with a dump folder Mosaic writes the ptxas log there (X.ptxas)
        folder = env["MOSAIC_GPU_DUMP_TO"]
        log += "".join(open(os.path.join(folder, f), encoding="utf-8").read()
                       for f in sorted(os.listdir(folder)) if f.endswith(".ptxas"))
      regs = _registers(log) or [f"FAILED: {run.stderr[-300:]}"]
      print(f"T={t} {name}: " + ", ".join(regs), flush=True)


if __name__ == "__main__":
  app.run(main)
