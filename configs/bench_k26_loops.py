"""bench_k26_full's decode loops only, each compiled twice: with the runtime's command-buffer
setting and with the other (`_cmdbuf` rows: with command buffers, `runtime.COMMAND_BUFFER_OPTIONS`
incl. xla_gpu_graph_min_graph_size 1, the whole while in one CUDA graph, notes/runtime.md;
`_nograph` rows: without); ar and ddtree 15 at 46k, no phase tables (k26_core has them). The A/B
of issue 13's host gap: compare ms/step per mode (jax.profiler's busy / gap columns cannot see a
graph's kernels: ms/step only). Measured s9: ar 9.04 -> 5.21, ddtree 15 20.45 -> 9.71 ms/step.

  bash scripts/gpu_measure.sh $OUT k26_loops:300
"""
import pathlib

from kdtree_jax.cli import load_config_file


def get_config():
  c = load_config_file(str(pathlib.Path(__file__).with_name("bench_k26_core.py")))
  c.bench.phase_modes = "none"
  c.bench.ab_loop_modes = ["ar", "ddtree"]
  return c
