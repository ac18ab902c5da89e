"""The dense MoE glue (cfg.moe_glue="dense": one [T, E] selection mask, rows and work list from
it) against the sorted glue and against a numpy per-token loop over the routed experts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.checkpoint import int4
from kdtree_jax.target import config as C
from kdtree_jax.target import moe
from kdtree_jax.target import params as P


def _layer(cfg, dtype=jnp.float32, int4_experts=False, seed=0):
  layers = P.init_params(jax.random.key(seed), cfg, dtype, int4_experts=int4_experts)["layers"]
  return layers[cfg.first_k_dense_replace]["moe"]


def _numpy_routed(p, cfg, x):
  """Per token: HF's routing (jax.lax.top_k), then sum of weight x expert FFN over the local
  experts it chose; f32 numpy."""
  idx, w = moe.route(p, cfg, jnp.asarray(x))
  idx, w = np.asarray(idx), np.asarray(w, np.float64)
  g, u, d = (np.asarray(p[n], np.float64) for n in ("gate", "up", "down"))
  out = np.zeros(x.shape, np.float64)
  for t in range(x.shape[0]):
    for e, wt in zip(idx[t], w[t]):
      if e < g.shape[0]:
        a, b = x[t] @ g[e], x[t] @ u[e]
        out[t] += wt * ((a / (1 + np.exp(-a)) * b) @ d[e])
  return out


@pytest.mark.parametrize("t,local,n_group", [(1, None, 2), (1, 5, 1), (6, None, 2), (7, 3, 1)])
def test_dense_glue_equals_sorted_glue_and_numpy(t, local, n_group):
  cfg = C.tiny(n_routed_experts=8, num_experts_per_tok=3, n_group=n_group, topk_group=1,
               num_local_experts=local, expert_backend="xla", moe_glue="sorted")
  dense = dataclasses.replace(cfg, moe_glue="dense")
  p = _layer(cfg)
  p.pop("shared")
  x = np.asarray(jax.random.normal(jax.random.key(t), (t, cfg.hidden_size)), np.float32)
  routes_a, routes_b = [], []
  a = moe.moe(p, cfg, jnp.asarray(x), routes_a)
  b = moe.moe(p, dense, jnp.asarray(x), routes_b)
  np.testing.assert_array_equal(np.asarray(routes_a[0]), np.asarray(routes_b[0]))
  rank, _ = moe.route_dense(p, dense, jnp.asarray(x))
  want_rank = np.full(rank.shape, cfg.n_routed_experts)
  np.put_along_axis(want_rank, np.asarray(routes_a[0]), np.arange(3)[None], axis=1)
  got_rank = np.where(np.asarray(rank) < 3, np.asarray(rank), cfg.n_routed_experts)
  np.testing.assert_array_equal(got_rank, want_rank)  # the same choices, in the same order
  want = _numpy_routed(p, cfg, x)
  scale = np.abs(want).max()
  np.testing.assert_allclose(np.asarray(b), want, rtol=1e-5, atol=1e-5 * scale)
  np.testing.assert_allclose(np.asarray(a), want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("t", [1, 5, 12])
def test_dense_glue_through_the_kernel_interpret(t):
  """INT4 experts on the kernel (GPU interpret mode) with the dense glue == the sorted glue on
  XLA within bf16 rounding. The three work lists: one token (T=1), one window per expert (T=5:
  R=16 >= T + 7 at the default tuning), the general one (T=12: R=16 < 19)."""
  cfg = C.tiny(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8,
               num_experts_per_tok=3, n_group=1, topk_group=1, expert_backend="xla",
               moe_glue="sorted")
  p = _layer(cfg, jnp.bfloat16, int4_experts=True, seed=1)
  x = jax.random.normal(jax.random.key(10 + t), (t, cfg.hidden_size), jnp.bfloat16)
  want = moe.moe(p, cfg, x).astype(jnp.float32)
  got = moe.moe(p, dataclasses.replace(cfg, moe_glue="dense", expert_backend="interpret"), x)
  rel = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
  assert rel < 1e-2, rel
  assert isinstance(p["gate"], int4.Int4Weight)


@pytest.mark.parametrize("name", ["k2_qlora_yarn32", "noqlora_group4_yarn64_sharded"])
def test_dense_glue_hf_parity(name):
  """Two HF fixtures' logits with the dense glue (f32, every MoE layer on it) within the parity
  tolerance of HF's (test_hf_parity.REL_TOL); the routing itself is compared above."""
  import os  # pylint: disable=import-outside-toplevel
  import kdtree_jax  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", name)
  cfg, params = kdtree_jax.load_hf_checkpoint(root, dtype=jnp.float32)
  with np.load(os.path.join(root, "reference.npz")) as z:
    tokens, ref = z["tokens"], z["logits"]
  dense = dataclasses.replace(cfg, moe_glue="dense")
  assert moe._dense_glue(dense, tokens.size)  # pylint: disable=protected-access
  logits = np.asarray(kdtree_jax.forward(dense, params, jnp.asarray(tokens)), np.float32)
  assert float(np.linalg.norm(logits - ref) / np.linalg.norm(ref)) < 1e-4


def test_auto_glue_is_dense_at_one_token_only():
  """moe_glue='auto' (the default): the dense glue for one token (ar), sorted above."""
  cfg = C.tiny(n_routed_experts=8, num_experts_per_tok=3)
  assert cfg.moe_glue == "auto"
  assert moe._dense_glue(cfg, 1) and not moe._dense_glue(cfg, 2)  # pylint: disable=protected-access
