"""bench_k26_full with the phase tables of `ar` and ddtree 15 only (issue 13's two targets): the
same programs, contexts and throughput rows, ~150 s less device time than the whole table.

  bash scripts/gpu_measure.sh $OUT k26_core:450
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
  return c
