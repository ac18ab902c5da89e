"""kdtree_jax/draft/gemv.py: the split-K few-row matmul against float64 numpy (interpret mode) and
its Triton lowering at the draft's o_proj and q|k|v shapes for an abstract H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.draft import gemv


@pytest.mark.parametrize("m,k,n,g", [
    (16, 256, 128, gemv.Gemv(splits=2, block_n=64, block_k=64)),
    (32, 512, 96, gemv.Gemv(splits=4, block_n=32, block_k=32, num_stages=2)),
    (16, 128, 64, gemv.Gemv(splits=1, block_n=16, block_k=16))])
def test_partials_sum_to_the_product(m, k, n, g):
  """The `splits` f32 partials are x @ w over each K piece (so they sum to x @ w) and dot()
  rounds their sum once to x's dtype (f32 here: 1e-5 of float64)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(m, k)).astype(np.float32)
  w = rng.normal(size=(k, n)).astype(np.float32)
  part = np.asarray(gemv.partials(jnp.asarray(x), jnp.asarray(w), g=g, interpret=True))
  assert part.shape == (g.splits, m, n) and part.dtype == np.float32
  kp = k // g.splits
  for s in range(g.splits):
    want = x[:, s * kp:(s + 1) * kp].astype(np.float64) @ w[s * kp:(s + 1) * kp]
    np.testing.assert_allclose(part[s], want, rtol=1e-5, atol=1e-4)
  got = gemv.dot(jnp.asarray(x).reshape(1, m, k), jnp.asarray(w), g, interpret=True)
  np.testing.assert_allclose(np.asarray(got)[0], x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("splits", [1, 2])
def test_add_dot_and_normed_dot(splits):
  """add_dot = x + a @ w (one split: the add in the kernel's epilogue); normed_dot = the
  float64 rms_norm(x, norm) @ w (the norm folded: x * norm in the prologue, the rows' sums of
  squares from the kernel); f32, 1e-5."""
  rng = np.random.default_rng(1)
  B, S, K, N, eps = 2, 8, 128, 64, 1e-6
  g = gemv.Gemv(splits=splits, block_n=32, block_k=32)
  a = rng.normal(size=(B, S, K)).astype(np.float32)
  w = rng.normal(size=(K, N)).astype(np.float32)
  x = rng.normal(size=(B, S, N)).astype(np.float32)
  norm = rng.normal(size=(K,)).astype(np.float32)
  got = gemv.add_dot(jnp.asarray(x), jnp.asarray(a), jnp.asarray(w), g, interpret=True)
  np.testing.assert_allclose(np.asarray(got), x + a.astype(np.float64) @ w, rtol=1e-5,
                             atol=1e-4)
  a64 = a.astype(np.float64)
  h = a64 / np.sqrt((a64 * a64).mean(-1, keepdims=True) + eps) * norm
  got = gemv.normed_dot(jnp.asarray(a), jnp.asarray(norm), jnp.asarray(w), eps, g,
                        interpret=True)
  np.testing.assert_allclose(np.asarray(got), h @ w, rtol=1e-5, atol=1e-4)
  with pytest.raises(ValueError, match="residual"):
    gemv.add_dot(jnp.asarray(x[:, :, :48]), jnp.asarray(a), jnp.asarray(w[:, :48]),
                 gemv.Gemv(splits=1, block_n=32, block_k=32), interpret=True)


def test_rejects_shapes_it_does_not_tile():
  """K not a multiple of splits * block_k, or N of block_n: a ValueError, not a wrong result."""
  x, w = jnp.zeros((16, 96)), jnp.zeros((96, 64))
  with pytest.raises(ValueError, match="does not fit"):
    gemv.partials(x, w, g=gemv.Gemv(splits=2, block_n=64, block_k=64), interpret=True)
  assert not gemv.supports(16, 128, 48, gemv.Gemv(splits=1, block_n=32, block_k=32))
  assert not gemv.supports(8, 128, 64, gemv.Gemv(splits=1, block_n=32, block_k=32))


@pytest.mark.parametrize("k,n,g", [(1024, 7168, gemv.Gemv(splits=1)),
                                   (1024, 7168, gemv.Gemv(splits=2)),
                                   (1024, 7168, gemv.Gemv(splits=4)),
                                   (7168, 1280, gemv.Gemv(splits=28)),
                                   (7168, 4608, gemv.Gemv(splits=14)),
                                   (2304, 7168, gemv.Gemv(splits=1))])
def test_lowers_for_h200(k, n, g):
  """bench_k26_full's draft o_proj ([16, 1024] x [1024, 7168]), q|k|v ([16, 7168] x
  [7168, 1280]), gate|up ([16, 7168] x [7168, 4608]) and down ([16, 2304] x [2304, 7168]) in
  bf16 lower to Triton for an abstract H200: the plain partials, the folded norm (normed_dot)
  and, with one split, the epilogue add (add_dot)."""
  from jax._src import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  sd = jax.ShapeDtypeStruct
  dev = mesh_lib.AbstractDevice("NVIDIA H200", 132, "gpu")
  x, w = sd((1, 16, k), jnp.bfloat16), sd((k, n), jnp.bfloat16)
  forms = [(lambda x, w: gemv.dot(x, w, g), (x, w)),
           (lambda x, w, nw: gemv.normed_dot(x, nw, w, 1e-6, g), (x, w, sd((k,), jnp.bfloat16)))]
  if g.splits == 1:
    forms.append((lambda x, w, r: gemv.add_dot(r, x, w, g), (x, w, sd((1, 16, n), jnp.bfloat16))))
  for f, args in forms:
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
      text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "draft_gemv" in text
