"""MoE routing and pair ordering against independent references (jax.lax.top_k, numpy argsort)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import moe


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
