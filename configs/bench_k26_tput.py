"""bench_k26_full without phase tables: compile + throughput vs context (4k, 16k, 46k, 128k) of
ar, chain and ddtree 15 with the runtime's defaults (the decode loop one CUDA graph):

  bash scripts/gpu_measure.sh $OUT k26_tput:580   # 400 s did ar and ddtree only (s9)
"""
import pathlib

from kdtree_jax.cli import load_config_file


def get_config():
  c = load_config_file(str(pathlib.Path(__file__).with_name("bench_k26_full.py")))
  c.bench.phase_modes = "none"
  return c
