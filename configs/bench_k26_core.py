"""bench_k26_full with the phase tables of `ar` and ddtree 15 only (issue 13's two targets): ar
and ddtree loops at 46k only. No command-buffer A/B here (k26_loops / k26_cmdbuf have it; the
fifth session's "with command buffers" loop formed no CUDA graph at all: notes/runtime.md).
On a bare machine the five programs' compile takes ~130 s and each phase table ~80-110 s:

  bash scripts/gpu_measure.sh $OUT k26_core:450
  # one table only (e.g. ar's was just measured):  --config.bench.phase_modes=ddtree
"""
import pathlib

from kdtree_jax.cli import load_config_file


def get_config():
  c = load_config_file(str(pathlib.Path(__file__).with_name("bench_k26_full.py")))
  c.bench.profile_budgets = [15]
  c.bench.modes = ["ar", "ddtree"]
  c.bench.ctxs = [46000]  # the host gap rows need the loop's ms per step at profile_ctx
  c.bench.ab_loop_modes = []
  c.bench.phase_modes = "ar,ddtree"
  return c
