"""The target model: absorbed decode == naive prefill, tree decode == per-path prefill, shapes, errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax
from kdtree_jax.target import config as C
from kdtree_jax.target.cache import LatentCache, compact_rows
from kdtree_jax.target import params as P
from kdtree_jax.target import transformer as T


def rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.fixture(scope="module")
def tiny_model():
  cfg = C.tiny()
  return cfg, P.init_params(jax.random.key(0), cfg, jnp.float32, std=0.1)


@pytest.mark.slow
def test_incremental_decode_equals_prefill(tiny_model):
  cfg, params = tiny_model
  toks = jax.random.randint(jax.random.key(1), (2, 40), 0, cfg.vocab_size)  # > orig_max 32: YaRN
  full = kdtree_jax.forward(cfg, params, toks)
  cache = LatentCache.zeros(cfg, 2, 48, jnp.float32)
  lg, cache, _ = T.prefill(cfg, params, cache, toks[:, :7])
  cache = cache.replace(lengths=jnp.full((2,), 7, jnp.int32))
  outs = [lg]
  step = jax.jit(lambda c, t, p: T.decode(cfg, params, c, t, p, jnp.ones((2, 1, 1), bool)))
  for t in range(7, 40):
    lg, cache, _ = step(cache, toks[:, t:t + 1], jnp.full((2, 1), t, jnp.int32))
    cache = cache.replace(lengths=cache.lengths + 1)
    outs.append(lg)
  assert rel(jnp.concatenate(outs, 1), full) < 1e-5


def random_tree(rng, n):
  """parents[i] < i for i >= 1, parents[0] = -1; returns (parents, depth, ancestor-or-self mask)."""
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
  depth = [0] * n
  vis = np.eye(n, dtype=bool)
  for i in range(1, n):
    depth[i] = depth[parents[i]] + 1
    vis[i] |= vis[parents[i]]
  return parents, np.array(depth), vis


@pytest.mark.slow
def test_tree_decode_equals_path_prefill(tiny_model):
  cfg, params = tiny_model
  rng = np.random.default_rng(0)
  prompt_len, n = 9, 12
  prompt = rng.integers(0, cfg.vocab_size, (1, prompt_len))
  nodes = rng.integers(0, cfg.vocab_size, (1, n))
  parents, depth, vis = random_tree(rng, n)
  cache = LatentCache.zeros(cfg, 1, 32, jnp.float32)
  _, cache, _ = T.prefill(cfg, params, cache, jnp.asarray(prompt))
  cache = cache.replace(lengths=jnp.array([prompt_len], jnp.int32))
  logits, _, _ = T.decode(cfg, params, cache, jnp.asarray(nodes), jnp.asarray(prompt_len + depth)[None],
                          jnp.asarray(vis)[None])
  for i in range(n):
    path = [j for j in range(n) if vis[i, j]]  # ancestors in index order == root-to-node order
    seq = np.concatenate([prompt[0], nodes[0, path]])[None]
    ref = kdtree_jax.forward(cfg, params, seq)[0, -1]
    assert rel(logits[0, i], ref) < 1e-5, i


def test_compact_rows_moves_accepted_rows():
  lat = jnp.arange(2 * 3 * 12 * 2, dtype=jnp.float32).reshape(2, 3, 12, 2)  # 2 layers of [B, L, C]
  layers = (lat[0], lat[1])                                                  # one buffer per layer
  lengths = jnp.array([2, 4, 0], jnp.int32)
  src = jnp.array([[0, 2, 5], [0, 1, 3], [0, 0, 0]], jnp.int32)
  count = jnp.array([3, 2, 1], jnp.int32)
  out = compact_rows(layers, lengths, src, count)
  for i, b in itertools.product(range(2), range(3)):
    for k in range(3):
      want = lat[i, b, lengths[b] + (src[b, k] if k < count[b] else k)]
      np.testing.assert_array_equal(out[i][b, lengths[b] + k], want)
    # rows outside [len, len + 3) are untouched
    untouched = np.ones(12, bool)
    untouched[lengths[b]:lengths[b] + 3] = False
    np.testing.assert_array_equal(out[i][b, untouched], lat[i, b, untouched])


def test_k2_6_parameter_count():
  counts = P.count_params(C.kimi_k2_6())
  print({k: f"{v / 1e9:.2f}B" for k, v in counts.items()})
  assert 1.02e12 < counts["total"] < 1.04e12
  assert abs(counts["routed_experts"] - 1014.69e9) < 0.01e9
  assert abs(counts["attention"] - 6.17e9) < 0.01e9  # projections (norms counted apart)
  assert abs(counts["shared_experts"] - 2.64e9) < 0.01e9
  assert abs(counts["embed_head"] - 2.35e9) < 0.01e9


def test_token_ids_out_of_range(tiny_model):
  cfg, params = tiny_model
  with pytest.raises(ValueError, match="token ids must be in"):
    kdtree_jax.forward(cfg, params, jnp.array([[1, cfg.vocab_size]]))
  with pytest.raises(ValueError, match="must be \\[B, S\\]"):
    kdtree_jax.forward(cfg, params, jnp.array([1, 2]))
