"""XLA's cost estimate of the work around the tree-verify kernel: the tree block and the merge.

Runs anywhere (CPU is fine): compiles `kernel.tree_partial` and `kernel.merge` (the kernel's split
partials + the tree block -> output) on the shapes they see and prints XLA's `bytes accessed` and
FLOPs, and the time those bytes take at a given bandwidth. An estimate from the compiler's cost
model, not a timing (GPU timings: profile_kernels.py, bench.py here). The CPU
cost model counts the whole cache as read by the tree block's row gather (a GPU gather reads N rows).

  python -m pallas_kernels.tree_verify.glue_cost --shapes 1x64x64x16384,1x16x16x46000 \\
      --tbps 4.1
"""

from absl import app, flags
import jax
import jax.numpy as jnp

from pallas_kernels.tree_verify import kernel_v1 as kernel  # v1: the XLA tree block
from pallas_kernels.tree_verify.tuning import BLOCK_M, default_tuning

_SHAPES = flags.DEFINE_list("shapes", ["1x64x64x16384", "1x64x64x46000", "1x16x16x46000",
                                       "4x16x64x46000"], "BxNxHxL shapes.")
_TBPS = flags.DEFINE_float("tbps", 4.1, "Bandwidth (TB/s) to turn bytes into a time floor.")


def _cost(fn, *args):
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return cost["bytes accessed"], cost["flops"]


def glue_costs(b, n, h, l, c=576, r=512):
  """{'tree': (bytes, flops), 'merge': (bytes, flops)} and the kernel's splits at this shape."""
  s = default_tuning(b, n, h, l, kernel="v1").num_splits
  mp = -(-(n * h) // BLOCK_M) * BLOCK_M
  sd = jax.ShapeDtypeStruct
  tree = _cost(lambda *a: kernel.tree_partial(*a, scale=0.1, value_dim=r),
               sd((b, n, h, c), jnp.bfloat16), sd((b, l, c), jnp.bfloat16), sd((b,), jnp.int32),
               sd((b, n, n), jnp.bool_))
  merge = _cost(lambda *a: kernel.merge(*a, jnp.bfloat16),
                sd((b, s, mp, r), jnp.float32), sd((b, s, mp), jnp.float32),
                sd((b, n, h, r), jnp.float32), sd((b, n, h), jnp.float32),
                sd((b, n, h), jnp.float32))
  return {"tree": tree, "merge": merge}, s


def main(_):
  bw = _TBPS.value * 1e6  # bytes per us
  print(f"{'shape BxNxHxL':>16} {'splits':>6} {'tree MB':>8} {'merge MB':>9} {'merge MFLOP':>11} "
        f"{'merge us at ' + str(_TBPS.value) + ' TB/s':>20}")
  for shape in _SHAPES.value:
    b, n, h, l = (int(x) for x in shape.split("x"))
    costs, s = glue_costs(b, n, h, l)
    (tb, _), (mb, mf) = costs["tree"], costs["merge"]
    print(f"{shape:>16} {s:>6} {tb / 1e6:8.2f} {mb / 1e6:9.2f} {mf / 1e6:11.1f} {mb / bw:20.2f}")


if __name__ == "__main__":
  app.run(main)
