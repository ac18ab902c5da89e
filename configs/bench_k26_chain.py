"""bench_k26_tput for the chain (DFlash block, no tree) only: compile + throughput vs context
(4k, 16k, 46k, 128k) of chain with the runtime's defaults. k26_tput's 400 s box ended before
chain's rows (s9), and ar / ddtree 15 were measured there:

  bash scripts/gpu_measure.sh $OUT k26_chain:300
"""
import pathlib

from kdtree_jax.cli import load_config_file


def get_config():
  c = load_config_file(str(pathlib.Path(__file__).with_name("bench_k26_tput.py")))
  c.bench.modes = ["chain"]
  return c
