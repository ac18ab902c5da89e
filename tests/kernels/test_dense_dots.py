"""The grouped expert matmul as a dense dot (G = 1 expert holding all M rows), as
pallas_kernels/grouped_matmul/dense_bench.py times it: numerics vs numpy f64 under every bench
tuning (GPU interpret mode on CPU), the bench's variant list at K2.6's shapes, and the H200
lowering of one K2.6 shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import api, dense_bench, kernel
from pallas_kernels.grouped_matmul.tuning import default_tuning

# small [N, K] the kernel takes: N below a 128 tile's multiple (block_n 64, 4 K steps) and
# N = 2 x 128 with 8 K steps (block_n 128: the n64 and every pN row apply)
SMALL = [(192, 512), (256, 1024)]
VARIANTS = dense_bench._VARIANTS.default  # pylint: disable=protected-access


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("n,k", SMALL)
def test_dense_dot_matches_f64_under_every_bench_tuning(m, n, k):
  xs, ws, ws_kn = dense_bench._operands(m, n, k, 1)  # pylint: disable=protected-access
  ran = []
  for name in VARIANTS:
    tun_pad = dense_bench.variant_tuning(name, m, n, k)
    if tun_pad is None:
      continue
    y = dense_bench.kernel_dot(xs[0][0], ws_kn[0], m, *tun_pad, backend="interpret")
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    ref = np.asarray(xs[0][0], np.float64) @ np.asarray(ws[0], np.float64).T
    got = np.asarray(y.astype(jnp.float32), np.float64)
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel <= 1e-2, (name, rel)  # bf16 output: one rounding, ~2e-3
    assert np.abs(got - ref).max() <= 2e-2 * np.abs(ref).max(), name  # no wrong row or column
    ran.append(name)
  assert "default" in ran and len(ran) >= 5, ran  # splits, store_once, ... each ran


def test_bench_row_checks_and_reports_a_kernel_and_xla_row():
  """bench_row end to end off a GPU (interpret mode, wall time): both rows correct, the kernel
  row carries its tuning and launch shape; a variant that does not apply, or names a form run
  already, is skipped."""
  shapes = dense_bench.Shapes(1, {"tiny": (192, 512, True)})
  ceil = {"copy_tbps": 1.0}
  xla = dense_bench.bench_row("tiny", 1, "xla", ceil, shapes)
  row = dense_bench.bench_row("tiny", 1, "pad8", ceil, shapes)
  assert xla["ok"] and row["ok"], (xla, row)
  assert row["short"].startswith("r8n64") and row["ctas"] >= 1 and "x_xla" in row
  assert dense_bench.bench_row("tiny", 16, "pad8", ceil, shapes) is None  # M >= 8: no pad
  assert dense_bench.bench_row("tiny", 1, "default+pad8", ceil, shapes) is None  # pad8's form


def test_bench_variants_build_valid_tunings_at_k26_shapes():
  applied = 0
  for m in (1, 16):
    for n, k, _ in dense_bench.SHAPES.values():
      base = default_tuning(m, 1, k, n, False)
      x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
      assert dense_bench.variant_tuning("default", m, n, k) == (base, False)
      for name in VARIANTS:
        tun_pad = dense_bench.variant_tuning(name, m, n, k)
        if tun_pad is None:
          continue
        t, pad = tun_pad
        assert kernel.supports(x, k, n, None, t), (name, m, n, k)
        assert kernel.launch_shape(k, n, 1, False, False, t)["ctas_per_sm_smem"] >= 1
        assert t.rows <= base.rows and (pad or name == "default" or t != base), name
        applied += 1
  assert applied >= 80, applied  # most rows apply; a renamed variant would silently vanish
  assert dense_bench.variant_tuning("p1", 16, 2112, 7168)[0].splits == 1
  with pytest.raises(ValueError):
    dense_bench.variant_tuning("q3", 16, 896, 7168)


def _lower_h200(fn, m, n, k):
  """fn(x [M, K], w [1, K, N]) through the whole Mosaic GPU lowering for an abstract H200."""
  sd = jax.ShapeDtypeStruct
  h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h200)):
    return jax.jit(fn).trace(sd((m, k), jnp.bfloat16), sd((1, k, n), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("m", [1, 16])
def test_dense_dot_lowers_for_h200(m):
  """q_a|kv_a [2112, 7168] at the default tuning (8 K splits, block_n 64); M = 1 on x [1, K]."""
  n, k = 2112, 7168
  t = default_tuning(m, 1, k, n, False)
  fn = lambda x, w: api.grouped_matmul(x, (w,), np.asarray([m], np.int32), backend="pallas",
                                       tuning=t)
  assert "gmm_bf16_mosaic_gpu" in _lower_h200(fn, m, n, k) and t.splits == 8


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 16])
def test_every_bench_row_lowers_for_h200(m):
  """Every kernel row the bench runs at the K2.6 shapes lowers (~11 s per M): no row fails on
  the GPU at its lowering."""
  lowered = 0
  for n, k, _ in dense_bench.SHAPES.values():
    for name in VARIANTS:
      tun_pad = dense_bench.variant_tuning(name, m, n, k)
      if tun_pad is not None:
        fn = lambda x, w, tun_pad=tun_pad: dense_bench.kernel_dot(x, w, m, *tun_pad,
                                                                  backend="pallas")
        assert "gmm_bf16_mosaic_gpu" in _lower_h200(fn, m, n, k), name
        lowered += 1
  assert lowered >= 40, lowered
