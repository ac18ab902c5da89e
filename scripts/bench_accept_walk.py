"""The acceptance walk: vectorised (`tree.accept_walk`) vs the sequential walk it replaced
(`tests/test_accept_walk.sequential_walk`), jitted, batch 1, on DDTrees of the given budgets.

  python scripts/bench_accept_walk.py --budgets 15,63,255
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kdtree_jax import runtime, timing, tree  # noqa: E402
from test_accept_walk import sequential_walk  # noqa: E402

_BUDGETS = flags.DEFINE_list("budgets", ["15", "63", "255"], "DDTree budgets.")
_DEPTH = flags.DEFINE_integer("depth", 15, "Draft depth (block size - 1).")
_REPS = flags.DEFINE_integer("reps", 200, "Timed calls (median).")
runtime.define_flags()


def _case(rng, budget, depth, vocab=1000):
  """A DDTree and target choices that follow its deepest path."""
  logits = jnp.asarray(rng.normal(size=(depth, vocab)).astype(np.float32) * 3)
  tok, dep, par, vis = tree.build_ddtree(logits, budget)
  target = rng.integers(0, vocab, budget + 1).astype(np.int32)
  node = int(np.argmax(np.asarray(dep))) + 1
  while node > 0:
    target[int(par[node])] = int(tok[node - 1])
    node = int(par[node])
  return par, tok, jnp.asarray(target), vis


def main(_):
  rng, d = np.random.default_rng(0), _DEPTH.value
  seq = jax.jit(lambda p, t, g: sequential_walk(p, t, g, d))
  vec = jax.jit(lambda p, t, g, v: tree.accept_walk(p, t, g, d, v))
  print(f"device={jax.devices()[0].device_kind} depth={d}")
  for budget in map(int, _BUDGETS.value):
    par, tok, target, vis = _case(rng, budget, d)
    a, b = seq(par, tok, target), vec(par, tok, target, vis)
    same = all(bool((np.asarray(x) == np.asarray(y)).all()) for x, y in zip(a, b))
    ms_s, _ = timing.wall_ms(seq, (par, tok, target), reps=_REPS.value)
    ms_v, _ = timing.wall_ms(vec, (par, tok, target, vis), reps=_REPS.value)
    print(f"budget {budget:4d}: accepted {int(a[1])}, same result {same}, sequential "
          f"{1e3 * ms_s:.1f} us, vectorised {1e3 * ms_v:.1f} us (wall, median of {_REPS.value})")


if __name__ == "__main__":
  app.run(main)
