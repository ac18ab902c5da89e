"""bench_k26_core's DDTree 15 loop alone at 46k with its paired loop A/B (twenty-ninth session:
`--config THIS.py --ab_loop_bench=target.pair_layout_impl=pallas`), no phase tables."""
import pathlib

from kdtree_jax.cli import load_config_file


def get_config():
  c = load_config_file(str(pathlib.Path(__file__).parents[3] / "configs" / "bench_k26_core.py"))
  c.bench.modes = ["ddtree"]
  c.bench.phase_modes = "none"
  c.bench.ab_loop_modes = ["ddtree"]
  return c
