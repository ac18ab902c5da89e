"""XLA's cost estimate of the XLA work around the tree-verify kernel: the tree-mask words and,
with several splits, the merge of the split partials (combine.merge_splits_xla).

Runs anywhere (CPU is fine): compiles each on the shapes it sees and prints XLA's `bytes accessed`
and the time those bytes take at a given bandwidth. An estimate from the compiler's cost model,
not a timing (GPU timings: profile_verify_kernel.py, bench_verify_attention.py).

  python scripts/verify_glue_cost.py --shapes 1x1x8x46000,1x16x8x46000 --tbps 4.1
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.tree_verify import combine, masks  # noqa: E402
from pallas_kernels.tree_verify.tuning import BLOCK_M, default_tuning, num_row_tiles  # noqa: E402

_SHAPES = flags.DEFINE_list("shapes", ["1x1x8x46000", "1x16x8x46000", "1x64x8x46000",
                                       "1x64x64x46000", "4x16x64x46000"], "BxNxHxL shapes.")
_TBPS = flags.DEFINE_float("tbps", 4.1, "Bandwidth (TB/s) to turn bytes into a time floor.")


def _bytes(fn, *args):
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return cost["bytes accessed"]


def glue_bytes(b, n, h, l, r=512):
  """{'words': bytes, 'merge': bytes (0 with one split)} and the kernel's splits at this shape."""
  s = default_tuning(b, n, h, l).num_splits
  m = -(-(n * h) // 8) * 8
  sd = jax.ShapeDtypeStruct
  words = _bytes(lambda x: masks.tree_mask_words(x, h, num_row_tiles(n, h) * BLOCK_M),
                 sd((b, n, n), jnp.bool_))
  merge = 0.0 if s == 1 else _bytes(lambda o, x: combine.merge_splits_xla(o, x, jnp.bfloat16),
                                    sd((b, s, m, r), jnp.float32), sd((b, s, m), jnp.float32))
  return {"words": words, "merge": merge}, s


def partial_mb(b, n, h, s, r=512):
  """The floor of the split partials' traffic: written once by the kernel, read once by the merge
  (bf16 O + f32 LSE), 0 with one split."""
  return 0.0 if s == 1 else 2 * b * s * n * h * (2 * r + 4) / 1e6


def main(_):
  bw = _TBPS.value * 1e6  # bytes per us
  print(f"{'shape BxNxHxL':>16} {'splits':>6} {'words KB':>9} {'merge MB':>9} "
        f"{'merge us at ' + str(_TBPS.value) + ' TB/s':>20} {'partials MB (w+r, bf16)':>24}")
  for shape in _SHAPES.value:
    b, n, h, l = (int(x) for x in shape.split("x"))
    costs, s = glue_bytes(b, n, h, l)
    print(f"{shape:>16} {s:>6} {costs['words'] / 1e3:9.2f} {costs['merge'] / 1e6:9.2f} "
          f"{costs['merge'] / bw:20.2f} {partial_mb(b, n, h, s):24.2f}")


if __name__ == "__main__":
  app.run(main)
