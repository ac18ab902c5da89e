"""bench_k26_full's decode loops only, each compiled twice: without command buffers (the default)
and with them (`_cmdbuf` rows; `runtime.COMMAND_BUFFER_OPTIONS` incl. xla_gpu_graph_min_graph_size
1: the whole while in one CUDA graph, notes/runtime.md); ar and ddtree 15 at 46k, no phase
tables (k26_core has them). The A/B of issue 13's host gap: compare ms/step per mode (the
`_cmdbuf` rows' busy / gap columns are op by op under the profiler: ms/step only).

  bash scripts/gpu_measure.sh $OUT k26_loops:300
"""
import pathlib

from kdtree_jax.cli import load_config_file


def get_config():
  c = load_config_file(str(pathlib.Path(__file__).with_name("bench_k26_core.py")))
  c.bench.phase_modes = "none"
  c.bench.ab_loop_modes = ["ar", "ddtree"]
  return c
