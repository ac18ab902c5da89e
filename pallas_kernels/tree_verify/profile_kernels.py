"""Per-kernel CUPTI times of one tree_verify_attention call (where the time goes), GPU only.

  python -m pallas_kernels.tree_verify.profile_kernels \\
      --shapes 1x1x8x46000,1x16x8x46000,1x64x64x46000
"""

from absl import app, flags
import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.tree_verify.tuning import default_tuning

_SHAPES = flags.DEFINE_list("shapes", ["1x1x8x46000", "1x8x8x46000", "1x16x8x46000",
                                       "1x64x8x46000", "1x64x64x46000", "4x16x8x46000"],
                            "BxNxHxL shapes (L cache rows; the tree sits at [L - N, L)).")


def main(_):
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  for shape in _SHAPES.value:
    b, n, h, l = map(int, shape.split("x"))
    k = jax.random.split(jax.random.key(0), 2)
    q = jax.random.normal(k[0], (b, n, h, 576), jnp.bfloat16)
    cache = jax.random.normal(k[1], (b, l, 576), jnp.bfloat16)
    lengths = jnp.full((b,), l - n, jnp.int32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
    fn = jax.jit(lambda q, c, ln, m: pallas_kernels.tree_verify_attention(
        q, c, ln, m, scale=0.1, backend="pallas"))
    jax.block_until_ready(fn(q, cache, lengths, mask))
    _, per_kernel = profiler.measure(fn, aggregate=False)(q, cache, lengths, mask)
    total = sum(t for _, t in per_kernel)
    splits = default_tuning(b, n, h, l).num_splits
    print(f"\n{shape} (splits {splits}): {1e3 * total:.1f} us in {len(per_kernel)} kernels")
    for name, t in per_kernel:
      print(f"  {1e3 * t:8.1f} us  {name[:100]}")


if __name__ == "__main__":
  app.run(main)
