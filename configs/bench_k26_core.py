"""bench_k26_full with the phase tables of `ar` and ddtree 15 only (issue 13's two targets): ar
and ddtree loops at 46k only. No command-buffer A/B (measured on the H200, 2026-12-01: the ddtree
loop 14.47 ms/step with them, 13.02 without; configs/bench_k26_full.py's ab_loop_modes has it).
On a bare machine the five programs' compile takes ~130 s and each phase table ~80-110 s:

  bash scripts/gpu_measure.sh $OUT k26_core:450
  # one table only (e.g. ar's was just measured):  --config.bench.phase_modes=ddtree
"""
import importlib.util
import pathlib

_FULL = pathlib.Path(__file__).with_name("bench_k26_full.py")


def get_config():
  spec = importlib.util.spec_from_file_location("bench_k26_full", _FULL)
  full = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(full)
  c = full.get_config()
  c.bench.profile_budgets = [15]
  c.bench.modes = ["ar", "ddtree"]
  c.bench.ctxs = [46000]  # the host gap rows need the loop's ms per step at profile_ctx
  c.bench.ab_loop_modes = []
  c.bench.phase_modes = "ar,ddtree"
  return c
