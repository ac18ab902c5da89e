"""bench_k26_core's ar loop alone at 46k with its paired loop A/B (twenty-seventh session:
`--config THIS.py --ab_loop_bench=target.one_token_rows_first=true`), no phase tables."""
import pathlib

from kdtree_jax.cli import load_config_file


def get_config():
  c = load_config_file(str(pathlib.Path(__file__).parents[3] / "configs" / "bench_k26_core.py"))
  c.bench.modes = ["ar"]
  c.bench.phase_modes = "none"
  c.bench.ab_loop_modes = ["ar"]
  return c
