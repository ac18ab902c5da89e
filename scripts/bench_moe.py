"""The routed-expert FFN of one MoE layer at verify size: XLA ragged_dot vs the Mosaic grouped
GEMM, bf16 experts vs INT4-resident experts (dequantised by XLA in front of the GEMM, or inside our
fused Mosaic kernel, pallas_kernels/int4_matmul); checked against an f32 reference, CUPTI-timed.

  python scripts/bench_moe.py --tokens 65 --experts 48 --topk 8 --hidden 7168 --ffn 2048
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kdtree_jax import roofline  # noqa: E402
from kdtree_jax.model import experts, int4  # noqa: E402

_T = flags.DEFINE_integer("tokens", 65, "Tokens (verify width x batch).")
_E = flags.DEFINE_integer("experts", 48, "Routed experts on this device.")
_K = flags.DEFINE_integer("topk", 8, "Experts per token.")
_D = flags.DEFINE_integer("hidden", 7168, "Hidden size.")
_F = flags.DEFINE_integer("ffn", 2048, "Expert width.")


def main(_):
  t, e, k, d, f = _T.value, _E.value, _K.value, _D.value, _F.value
  ks = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
  idx = jnp.argsort(jax.random.uniform(ks[1], (t, e)), axis=1)[:, :k].astype(jnp.int32)
  w = jax.random.uniform(ks[2], (t, k), jnp.float32)
  mats = [jax.random.normal(ks[3 + i], s, jnp.float32) * 0.02
          for i, s in enumerate([(e, d, f), (e, d, f), (e, f, d)])]
  q = [int4.quantize(np.asarray(m)) for m in mats]
  deq = [int4.dequantize(m, jnp.bfloat16) for m in q]
  ref = experts.expert_ffn(x.astype(jnp.float32), idx, w,
                           *[m.astype(jnp.float32) for m in deq])
  ceil = roofline.measure_ceilings()
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  print(f"T={t} E={e} K={k} D={d} F={f}; copy {ceil['copy_tbps']:.2f} TB/s")
  # int4 "auto": dequantised by XLA in front of the Mosaic bf16 GEMM; "mosaic": the fused kernel.
  rows = [("bf16", "xla", deq), ("bf16", "mosaic", deq), ("int4", "xla", q), ("int4", "auto", q),
          ("int4", "mosaic", q)]
  for wname, impl, ws in rows:
    fn = jax.jit(lambda x, idx, w, ws, impl=impl: experts.expert_ffn(x, idx, w, *ws, impl=impl))
    try:
      out = fn(x, idx, w, ws)
      err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
      _, ts = profiler.measure(fn, iterations=20)(x, idx, w, ws)
      us = 1e3 * sorted(ts)[len(ts) // 2]
    except Exception as ex:  # report and continue: one failing variant must not hide the rest
      print(f"{wname:>5} {impl:>7}: FAILED {type(ex).__name__}: {str(ex)[:300]}")
      continue
    nbytes = sum(m.packed.size // 2 + m.scale.nbytes if wname == "int4" else m.nbytes for m in ws)
    print(f"{wname:>5} {impl:>7}: {us:8.1f} us  rel err {err:.2e}  weights {nbytes / 1e9:.2f} GB"
          f"  {nbytes / us / 1e6:.2f} TB/s ({100 * nbytes / us / 1e6 / ceil['copy_tbps']:.0f}% of copy)")


if __name__ == "__main__":
  app.run(main)
