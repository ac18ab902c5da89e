"""bench_k26_core's loops at one DDTree budget (twenty-sixth session: the step's ms per budget on
the zero-mean bench model, whose tree tokens route apart): `--config THIS.py:BUDGET[,ar]`,
no phase tables, ar's loop too with ',ar'."""
import pathlib

from kdtree_jax.cli import load_config_file


def get_config(arg="15"):
  c = load_config_file(str(pathlib.Path(__file__).parents[3] / "configs" / "bench_k26_core.py"))
  budget, *extra = arg.split(",")
  c.bench.budget = int(budget)
  c.bench.modes = ["ar", "ddtree"] if "ar" in extra else ["ddtree"]
  c.bench.phase_modes = "none"
  return c
