"""The vectorised acceptance walk equals the sequential root walk it replaced, on random trees."""

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from kdtree_jax import tree


def sequential_walk(parents_n1, node_tokens_n, target_tokens_n1, max_depth):
  """The walk kdtree_jax used until 2026-12-01: one fori_loop step per depth."""
  child_parent = parents_n1[1:]
  path = jnp.full((max_depth + 1,), -1, jnp.int32).at[0].set(0)

  def step(i, carry):
    cur, nxt, n, path, live = carry
    hit = live & (child_parent == cur) & (node_tokens_n == nxt)
    ok = jnp.any(hit)
    child = (jnp.argmax(hit) + 1).astype(jnp.int32)
    cur = jnp.where(ok, child, cur)
    path = path.at[i + 1].set(jnp.where(ok, child, -1))
    nxt = jnp.where(ok, target_tokens_n1[cur], nxt)
    return cur, nxt, n + ok.astype(jnp.int32), path, live & ok

  init = (jnp.int32(0), target_tokens_n1[0].astype(jnp.int32), jnp.int32(0), path, True)
  _, nxt, n, path, _ = lax.fori_loop(0, max_depth, step, init)
  return path, n, nxt


def _random_parents(rng, n, max_depth):
  """Random tree of n nodes (tree index 0 = root; node k's parent < k), some invalid nodes."""
  parents, depth = [-1], [0]
  for k in range(1, n + 1):
    if rng.random() < 0.1:
      parents.append(-1)
      depth.append(-1)
      continue
    cands = [j for j in range(k) if 0 <= depth[j] < max_depth]
    p = int(rng.choice(cands))
    parents.append(p)
    depth.append(depth[p] + 1)
  return np.asarray(parents, np.int32)


def _case(rng, n, vocab, max_depth):
  parents = _random_parents(rng, n, max_depth)
  tokens = rng.integers(0, vocab, n).astype(np.int32)
  target = rng.integers(0, vocab, n + 1).astype(np.int32)
  # Targets agree with a random child most of the time, so walks go deep.
  for k in rng.permutation(np.arange(1, n + 1)):
    if parents[k] >= 0 and rng.random() < 0.7:
      target[parents[k]] = tokens[k - 1]
  return parents, tokens, target


@pytest.mark.slow
@pytest.mark.parametrize("use_vis", [False, True])
def test_vectorised_walk_equals_sequential(use_vis):
  rng = np.random.default_rng(0)
  seq = jax.jit(sequential_walk, static_argnums=3)
  vec = jax.jit(lambda p, t, g, v: tree.accept_walk(p, t, g, 6, v if use_vis else None))
  depths = set()
  for trial in range(150):
    n, vocab = int(rng.integers(1, 40)), int(rng.choice([2, 3, 50]))  # tiny vocab: twin siblings
    parents, tokens, target = _case(rng, n, vocab, 6)
    vis = tree.ancestor_matrix(jnp.asarray(parents))
    got = vec(parents, tokens, target, vis)
    want = seq(jnp.asarray(parents), jnp.asarray(tokens), jnp.asarray(target), 6)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"trial {trial}")
    depths.add(int(want[1]))
  assert {0, 1, 2, 3} <= depths, depths  # the cases reach several depths


@pytest.mark.slow
def test_ancestor_matrix_matches_ddtree_visibility():
  logits = np.random.default_rng(1).normal(size=(5, 7)).astype(np.float32) * 3
  tok, dep, par, vis = tree.build_ddtree(jnp.asarray(logits), 40)
  np.testing.assert_array_equal(np.asarray(tree.ancestor_matrix(par)), np.asarray(vis))
  chain = tree.build_chain(jnp.asarray(logits))
  np.testing.assert_array_equal(np.asarray(tree.ancestor_matrix(chain[2])), np.asarray(chain[3]))


def test_walk_under_vmap_and_depth_cap():
  rng = np.random.default_rng(2)
  cases = [_case(rng, 20, 3, 6) for _ in range(4)]
  p, t, g = (np.stack(x) for x in zip(*cases))
  got = jax.jit(jax.vmap(lambda a, b, c: tree.accept_walk(a, b, c, 2)))(p, t, g)
  for i in range(4):
    want = sequential_walk(jnp.asarray(p[i]), jnp.asarray(t[i]), jnp.asarray(g[i]), 2)
    for x, y in zip(got, want):
      np.testing.assert_array_equal(np.asarray(x)[i], np.asarray(y))
