"""bench_k26_full with the phase tables of `ar` and ddtree 15 only (issue 13's two targets): ar
and ddtree loops at 46k only (and the ddtree loop again with command buffers, the runtime
default being without, to A/B them): about half the device time of the whole bench.

  bash scripts/gpu_measure.sh $OUT k26_core:330
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
  c.bench.ab_loop_modes = ["ddtree"]  # its loop again with the other command-buffer setting
  return c
