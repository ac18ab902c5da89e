"""MoE routing, pair ordering and the combine against independent references (jax.lax.top_k,
numpy)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax.target import experts, moe
from kdtree_jax.target import params as P
from pallas_kernels.grouped_matmul import api


@pytest.mark.parametrize("t,e,k", [(1, 384, 8), (9, 384, 8), (5, 16, 4), (3, 8, 8)])
def test_top_k_select_equals_lax_top_k(t, e, k):
  """Same indices (ties: lower index first) and the values at them, bit for bit."""
  rng = np.random.default_rng(t * e + k)
  choice = rng.normal(size=(t, e)).astype(np.float32)
  choice[:, 1::7] = choice[:, :1]  # ties with column 0
  choice[0, -3:] = -np.inf  # group-limited experts
  values = rng.uniform(size=(t, e)).astype(np.float32)
  idx, w = moe.top_k_select(jnp.asarray(choice), jnp.asarray(values), k)
  _, want = jax.lax.top_k(jnp.asarray(choice), k)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(w), np.take_along_axis(values, np.asarray(want), 1))


def test_top_k_select_falls_back_to_lax_top_k_for_many_rows():
  t, e, k = 600, 384, 8  # t * e * e > COMPARE_TOP_K_MAX
  choice = jax.random.normal(jax.random.key(0), (t, e))
  idx, w = moe.top_k_select(choice, -choice, k)
  vals, want = jax.lax.top_k(choice, k)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(w), -np.asarray(vals))


@pytest.mark.parametrize("t,k,s", [(1, 8, 1), (5, 3, 4), (16, 8, 2)])
def test_combine_pairs_equals_numpy(t, k, s):
  """Per token, sum over its local pairs and the S partials of weight x row, against a numpy loop;
  the rows of non-local pairs hold NaN (undefined on the kernel) and must not leak."""
  rng = np.random.default_rng(t * 100 + k * 10 + s)
  d, m = 12, t * k
  rank = rng.permutation(m).astype(np.int32)
  mine = rng.uniform(size=m) < 0.7
  y = rng.normal(size=(s, m, d)).astype(np.float32)
  y[:, rank[~mine]] = np.nan
  w = rng.uniform(size=(t, k)).astype(np.float32)
  want = np.zeros((t, d), np.float64)
  for p in range(m):
    if mine[p]:
      want[p // k] += w[p // k, p % k] * y[:, rank[p]].astype(np.float64).sum(axis=0)
  got = experts.combine_pairs(jnp.asarray(y), jnp.asarray(rank), jnp.asarray(mine), jnp.asarray(w))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("norm", [False, True])
def test_route_weights_equal_numpy(norm):
  """route's weights: the unbiased scores of the chosen experts, normalised over them if
  norm_topk_prob, times routed_scaling_factor (HF's DeepseekV3 / K2 formula, in numpy)."""
  cfg = C.tiny(n_routed_experts=16, num_experts_per_tok=4, n_group=2, topk_group=1,
               norm_topk_prob=norm, routed_scaling_factor=2.5)
  p = P.init_params(jax.random.key(0), cfg, jnp.float32)["layers"][cfg.first_k_dense_replace]
  p = p["moe"]
  x = jax.random.normal(jax.random.key(1), (6, cfg.hidden_size))
  idx, w = moe.route(p, cfg, x)
  logits = np.asarray(x, np.float64) @ np.asarray(p["router"], np.float64)
  scores = 1 / (1 + np.exp(-logits))
  want = np.take_along_axis(scores, np.asarray(idx), axis=1)
  if norm:
    want = want / want.sum(axis=1, keepdims=True)
  np.testing.assert_allclose(np.asarray(w), want * 2.5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_gated_value_sums_partials_then_silu_times_up(splits):
  """silu(sum of gate partials) * (sum of up partials), rounded once, against numpy."""
  rng = np.random.default_rng(splits)
  g, u = (rng.normal(size=(splits, 5, 7)).astype(np.float32) for _ in range(2))
  got = api._gated_value((jnp.asarray(g, jnp.bfloat16), jnp.asarray(u, jnp.bfloat16)),
                         jnp.float32)
  gs, us = (np.asarray(jnp.asarray(v, jnp.bfloat16), np.float64).sum(axis=0) for v in (g, u))
  np.testing.assert_allclose(np.asarray(got), gs / (1 + np.exp(-gs)) * us, rtol=1e-5, atol=1e-6)
  fused = api._gated_value((jnp.asarray(g),), jnp.float32)
  np.testing.assert_allclose(np.asarray(fused), g.astype(np.float64).sum(axis=0), rtol=1e-5,
                             atol=1e-6)
