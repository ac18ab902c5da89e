"""DDTree on device vs a plain-Python transcription of the published heapq algorithm."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import tree


def ref_build(lp_lk, ids_lk, budget):
  """liranringel/ddtree build_ddtree_tree, transcribed (Python floats, heapq)."""
  L, K = lp_lk.shape
  first = float(lp_lk[0, 0])
  heap = [(-first, (0,), 0, 1, 0, first)]
  tokens, depths, parents = [], [], [-1]
  children = [dict()]
  while heap and len(tokens) < budget:
    _, ranks, par, d, r, logw = heapq.heappop(heap)
    tok = int(ids_lk[d - 1, r])
    idx = len(tokens) + 1
    tokens.append(tok)
    depths.append(d)
    parents.append(par)
    children.append(dict())
    children[par][tok] = idx
    if r + 1 < K:
      w = logw - float(lp_lk[d - 1, r]) + float(lp_lk[d - 1, r + 1])
      heapq.heappush(heap, (-w, ranks[:-1] + (r + 1,), par, d, r + 1, w))
    if d < L:
      w = logw + float(lp_lk[d, 0])
      heapq.heappush(heap, (-w, ranks + (0,), idx, d + 1, 0, w))
  n = len(tokens) + 1
  vis = np.zeros((n, n), bool)
  vis[0, 0] = True
  for i in range(1, n):
    vis[i, :i] = vis[parents[i], :i]
    vis[i, i] = True
  return tokens, depths, parents, vis


def ref_walk(parents, tokens, target):
  """liranringel/ddtree follow_verified_tree, transcribed."""
  children = [dict() for _ in parents]
  for i in range(1, len(parents)):
    if parents[i] >= 0:
      children[parents[i]][tokens[i - 1]] = i
  path, cur, nxt = [0], 0, int(target[0])
  while nxt in children[cur]:
    cur = children[cur][nxt]
    path.append(cur)
    nxt = int(target[cur])
  return path, nxt


_build = jax.jit(tree.build_ddtree, static_argnums=1)


def check_tree(logits, budget):
  """Device tree == reference node for node (padding past exhaustion)."""
  L, V = logits.shape
  lp, ids = tree.topk_logprobs(jnp.asarray(logits), min(budget, V))
  r_tok, r_dep, r_par, r_vis = ref_build(np.asarray(lp), np.asarray(ids), budget)
  tok, dep, par, vis = (np.asarray(x) for x in _build(jnp.asarray(logits), budget))
  n = len(r_tok)
  assert tok.shape == (budget,) and par.shape == (budget + 1,) and vis.shape == (budget + 1,) * 2
  np.testing.assert_array_equal(tok[:n], r_tok)
  np.testing.assert_array_equal(dep[:n], r_dep)
  np.testing.assert_array_equal(par[: n + 1], r_par)
  np.testing.assert_array_equal(vis[: n + 1, : n + 1], r_vis)
  # Padding: depth 0, parent -1, token 0, sees only itself, seen by nobody else.
  assert (dep[n:] == 0).all() and (par[n + 1 :] == -1).all() and (tok[n:] == 0).all()
  np.testing.assert_array_equal(vis[n + 1 :], np.eye(budget + 1, dtype=bool)[n + 1 :])
  assert not vis[:, n + 1 :][~np.eye(budget + 1, dtype=bool)[:, n + 1 :]].any()


@pytest.mark.parametrize("L,V,budget", [
    (1, 7, 1), (4, 50, 1), (5, 50, 8), (15, 300, 32), (15, 64, 96), (3, 4, 9), (6, 3, 20),
    (2, 3, 12), (2, 3, 40), (1, 5, 9), (4, 2, 64), (8, 1000, 64),
])
def test_matches_reference_random(L, V, budget):
  rng = np.random.default_rng(L * 1000 + V + budget)
  for scale in (0.5, 3.0, 10.0):
    check_tree(rng.normal(size=(L, V)).astype(np.float32) * scale, budget)


@pytest.mark.parametrize("L,V,budget", [(4, 6, 30), (3, 5, 17), (6, 8, 40), (5, 3, 50)])
def test_ties(L, V, budget):
  """Exactly equal logits: uniform rows, repeated rows, integer-valued logits."""
  rng = np.random.default_rng(V + budget)
  check_tree(np.zeros((L, V), np.float32), budget)
  row = rng.normal(size=(1, V)).astype(np.float32)
  check_tree(np.repeat(row, L, 0), budget)
  for _ in range(5):
    check_tree(rng.integers(0, 3, size=(L, V)).astype(np.float32), budget)


def test_masked_logits_no_nan():
  logits = np.full((3, 10), -np.inf, np.float32)
  logits[:, :2] = [[1.0, 0.0]] * 3
  tok, dep, par, vis = tree.build_ddtree(jnp.asarray(logits), 6)
  assert (np.asarray(dep) > 0).all() and (np.asarray(tok)[:2] < 2).all()


def test_chain_is_greedy():
  logits = np.random.default_rng(0).normal(size=(7, 40)).astype(np.float32)
  tok, dep, par, vis = (np.asarray(x) for x in tree.build_chain(jnp.asarray(logits)))
  np.testing.assert_array_equal(tok, logits.argmax(-1))
  np.testing.assert_array_equal(dep, np.arange(1, 8))
  np.testing.assert_array_equal(par, np.arange(-1, 7))
  np.testing.assert_array_equal(vis, np.tril(np.ones((8, 8), bool)))


_walk = jax.jit(tree.accept_walk, static_argnums=3)


def check_walk(parents, tokens, target, max_depth):
  path, n, nxt = _walk(
      jnp.asarray(parents), jnp.asarray(tokens), jnp.asarray(target), max_depth)
  r_path, r_nxt = ref_walk(list(parents), list(tokens), target)
  path = np.asarray(path)
  assert int(n) == len(r_path) - 1 and int(nxt) == r_nxt
  np.testing.assert_array_equal(path[: len(r_path)], r_path)
  assert (path[len(r_path):] == -1).all()
  return int(n)


def test_accept_walk_random_trees():
  rng = np.random.default_rng(1)
  L, V, budget = 5, 4, 20
  seen = set()
  for trial in range(40):
    logits = rng.normal(size=(L, V)).astype(np.float32) * float(rng.choice([0.5, 2.0, 6.0]))
    tok, dep, par, _ = (np.asarray(x) for x in _build(jnp.asarray(logits), budget))
    # Targets drawn mostly from the tree's own tokens so walks go deep.
    target = rng.integers(0, V, size=budget + 1).astype(np.int32)
    if trial % 2 == 0:
      target[:budget] = np.where(rng.random(budget) < 0.8, tok, target[:budget])
    seen.add(check_walk(par, tok, target, L))
  assert 0 in seen and max(seen) >= 3


def test_accept_walk_full_and_zero():
  logits = np.random.default_rng(2).normal(size=(5, 30)).astype(np.float32)
  tok, dep, par, _ = (np.asarray(x) for x in tree.build_chain(jnp.asarray(logits)))
  full = np.append(tok, 7).astype(np.int32)  # target agrees everywhere, bonus 7
  assert check_walk(par, tok, full, 5) == 5
  zero = full.copy()
  zero[0] = (tok[0] + 1) % 30
  assert check_walk(par, tok, zero, 5) == 0
  # DDTree: a target that follows the deepest path accepts full depth.
  ttok, tdep, tpar, _ = (np.asarray(x) for x in tree.build_ddtree(jnp.asarray(logits * 6), 40))
  leaf = int(np.argmax(tdep)) + 1
  target = np.zeros(41, np.int32)
  node = leaf
  while node > 0:
    target[tpar[node]] = ttok[node - 1]
    node = tpar[node]
  target[leaf] = 3
  assert check_walk(tpar, ttok, target, 5) == tdep.max() == 5


@pytest.mark.slow
def test_jit_vmap_batch():
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(4, 6, 20)).astype(np.float32)
  budget = 12
  out = jax.jit(jax.vmap(lambda x: tree.build_ddtree(x, budget)))(jnp.asarray(logits))
  target = rng.integers(0, 20, size=(4, budget + 1)).astype(np.int32)
  target[:, 0] = np.asarray(out[0])[:, 0]  # root's choice = first node's token
  walk = jax.jit(jax.vmap(lambda p, t, g: tree.accept_walk(p, t, g, 6)))
  paths, ns, nxts = walk(out[2], out[0], jnp.asarray(target))
  for b in range(4):
    one = tree.build_ddtree(jnp.asarray(logits[b]), budget)
    for x, y in zip(out, one):
      np.testing.assert_array_equal(np.asarray(x)[b], np.asarray(y))
    r_path, r_nxt = ref_walk(list(np.asarray(out[2])[b]), list(np.asarray(out[0])[b]), target[b])
    assert int(ns[b]) == len(r_path) - 1 >= 1 and int(nxts[b]) == r_nxt
  cout = jax.vmap(tree.build_chain)(jnp.asarray(logits))
  assert cout[0].shape == (4, 6) and cout[3].shape == (4, 7, 7)


def test_topk_logprobs():
  logits = np.random.default_rng(4).normal(size=(3, 50)).astype(np.float32)
  lp, ids = tree.topk_logprobs(jnp.asarray(logits), 5)
  ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  order = np.argsort(-logits, axis=-1, kind="stable")[:, :5]
  np.testing.assert_array_equal(np.asarray(ids), order)
  np.testing.assert_allclose(np.asarray(lp), np.take_along_axis(ref, order, -1), rtol=1e-5)
  tie_ids = tree.topk_logprobs(jnp.zeros((2, 9)), 4)[1]
  np.testing.assert_array_equal(np.asarray(tie_ids), [[0, 1, 2, 3]] * 2)


@pytest.mark.parametrize("v,k,chunk", [(4096, 16, 512), (2048, 64, 128), (1536, 3, 256),
                                        (1000, 8, 128)])  # last: V % chunk != 0 (one top_k)
def test_chunked_top_k_is_exact(v, k, chunk):
  """The two-stage top-k against a stable numpy sort: same values, same ids, ties (many
  repeated values across and inside blocks) to the lower id."""
  rng = np.random.default_rng(v + k)
  x = rng.integers(-20, 20, size=(5, v)).astype(np.float32)  # heavy ties
  x[0] = 0.0  # every value tied
  x[1, ::chunk] = 50.0  # the winners at block starts, one per block
  vals, ids = tree.chunked_top_k(jnp.asarray(x), k, chunk)
  order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
  np.testing.assert_array_equal(np.asarray(ids), order)
  np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(x, order, -1))


def test_bad_budget():
  with pytest.raises(ValueError, match="budget"):
    tree.build_ddtree(jnp.zeros((3, 5)), 0)
