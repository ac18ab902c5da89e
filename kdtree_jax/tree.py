"""DDTree on device: best-first draft tree, chain tree, and the acceptance walk.

Letters (the package glossary, kdtree_jax/__init__.py): J draft depth (block positions 1..J),
V vocab, K top-k per depth, N verify width: tree indices 0..N-1, index 0 = the root = the bonus
token, the n = `budget` = N - 1 nodes at 1..N-1 (arrays over the nodes alone have N - 1 rows).

`build_ddtree` reproduces `build_ddtree_tree` of liranringel/ddtree node for node. The published
algorithm is a max-heap on path log-prob with entries (-score, rank_tuple): popping a node emits
it, then pushes its next sibling (rank r+1) and first child (depth+1, rank 0). Pops come out in
(score desc, rank tuple asc) order, so the tree is the first n prefixes in that order; here it is
computed without a pop loop: one sort per depth over the candidates that can still make the top
n, then one sort over the survivors (a per-pop loop cost 2.9 ms per step on an H200 at n = 64:
each pop was a few tiny kernels inside a device while loop).

Deviations (documented, tested):
- Scores are exact-ish double-f32 sums (hi, lo) accumulated root->leaf; the reference uses
  Python floats (f64). Both are exact for sums of a few f32 log-probs of similar magnitude.
- Log-probs are clamped at -1e30 so masked (-inf) logits cannot produce NaNs.
- Top-k ties (equal logits) take the lower token id first (`lax.top_k` order).
- Exhaustion (budget > sum_d K^d, only when V is tiny): the tree is padded to `budget` nodes
  with invalid nodes: token 0, depth 0, parent -1, visibility = only itself. No walk reaches
  them (parent -1 is nobody's child); use `node_depths > 0` as the validity mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

_LOGP_FLOOR = -1e30


TOPK_CHUNK = 512  # vocab columns per first-stage chunk of `chunked_top_k`


def chunked_top_k(x_jv: jax.Array, k: int, chunk: int = TOPK_CHUNK):
  """lax.top_k(x, k) over the last axis, exactly (values, and ids with ties to the lower id),
  in two stages when V is long: the top k of each `chunk`-column block, then the top k of those
  candidates. The same values and ids as one top_k, in ~C + V/C*k instead of V sequential steps
  per row: XLA's GPU TopK kernel runs one thread block per row, so one top_k over [16, 20480]
  (the draft block's logits on one GPU's share of K2.6) took 111 us on an H200 (2026-12-01).
  Exact because the global top k is among the blocks' top k, and the candidates sit in
  (block, rank) order, so equal values still come out lower id first."""
  j, v = x_jv.shape
  if v <= 2 * chunk or v % chunk or k > chunk:
    return lax.top_k(x_jv, k)
  top, local = lax.top_k(x_jv.reshape(j, v // chunk, chunk), k)       # [J, V/C, K]
  ids = local + (jnp.arange(v // chunk, dtype=local.dtype) * chunk)[None, :, None]
  best, where = lax.top_k(top.reshape(j, -1), k)                        # [J, K]
  return best, jnp.take_along_axis(ids.reshape(j, -1), where, axis=-1)


def topk_logprobs(draft_logits_jv: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Top-k log-probs [J, K] f32 (log_softmax over full V) and their token ids [J, K] int32."""
  logits = draft_logits_jv.astype(jnp.float32)
  top, ids = chunked_top_k(logits, k)
  logp = top - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  return jnp.maximum(logp, _LOGP_FLOOR), ids.astype(jnp.int32)


def _two_sum(a, b):
  """Error-free a + b = s + e (Knuth)."""
  s = a + b
  bb = s - a
  return s, (a - (s - bb)) + (b - bb)


def _dd_add(hi, lo, x):
  """Double-f32 (hi, lo) + f32 x, renormalized."""
  s, e = _two_sum(hi, x)
  lo = lo + e
  hi2 = s + lo
  return hi2, lo - (hi2 - s)


def _check_budget(budget: int, depth: int):
  """Trace-time argument checks."""
  if budget < 1:
    raise ValueError(f"{budget=} must be >= 1")
  if depth < 1:
    raise ValueError(f"draft depth {depth=} must be >= 1 (draft_logits is [depth, V])")


def _sort_take(keys, payload, n):
  """Stable sort by `keys` (tuple of arrays, ascending), then the first n of each payload array."""
  out = lax.sort(tuple(keys) + tuple(payload), num_keys=len(keys), is_stable=True)
  return [x[:n] for x in out[len(keys):]]


def _candidate_pairs(n, k):
  """Static (parent j, child rank r) pairs that can reach the top n of the next level.

  Parents are in pop order and ranks in log-prob order, so (j, r) is preceded by every
  (j' <= j, r' <= r): only pairs with (j + 1) * (r + 1) <= n can be among the top n
  (about n ln n of the n * k).
  """
  counts = np.minimum(k, n // np.arange(1, n + 1))  # ranks r < n // (j + 1) per parent j
  j = np.repeat(np.arange(n, dtype=np.int32), counts)
  r = np.arange(len(j)) - np.repeat(np.cumsum(counts) - counts, counts)
  return j, r.astype(np.int32)


def _level(lp_k, hi, lo, ok, lexrank, n):
  """Top-n children (score desc, rank tuple asc) of one level's n nodes (given in pop order).

  Children of one level have rank tuples of equal length, so they compare as
  (parent's lexicographic rank, child rank r): one int key.
  Returns (hi, lo, ok, parent slot, r, tie key) of the n kept children, in pop order.
  """
  k = lp_k.shape[0]
  j, r = _candidate_pairs(n, k)
  c_hi, c_lo = _dd_add(hi[j], lo[j], lp_k[r])
  c_ok = ok[j]
  c_hi, c_lo = jnp.where(c_ok, c_hi, -jnp.inf), jnp.where(c_ok, c_lo, 0.0)
  tie = lexrank[j] * k + r
  keys = (jnp.where(c_ok, -c_hi, jnp.inf), -c_lo, tie)
  (sel,) = _sort_take(keys, (jnp.arange(len(j)),), n)
  return c_hi[sel], c_lo[sel], c_ok[sel], jnp.asarray(j)[sel], jnp.asarray(r)[sel], tie[sel]


def _lexrank(tie, ok):
  """Lexicographic rank of each kept node among its level (invalid nodes last): the stable
  argsort's inverse, counted instead (how many nodes come before each: smaller key, or equal key
  and earlier slot), one [n, n] comparison fusion where a sort and a scatter were two kernels per
  level (n <= a few hundred)."""
  key = jnp.where(ok, tie, jnp.iinfo(jnp.int32).max)
  slot = jnp.arange(key.shape[0])
  before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None])
                                            & (slot[None, :] < slot[:, None]))
  return jnp.sum(before, axis=1, dtype=jnp.int32)


TREE_IMPLS = ("auto", "xla", "pallas", "interpret")


def build_ddtree(draft_logits_jv: jax.Array, budget: int, impl: str = "auto"):
  """Best-first DDTree of n = budget nodes (N = n + 1 with the root) -> (node_tokens [N-1],
  node_depths [N-1], parents [N], visibility [N, N]).

  impl: 'auto' (default: 'pallas' where the program is lowered for a CUDA GPU and the budget is
  one the kernel was measured fast at (`ddtree_build.suits_auto`: up to 105 nodes at K = n), 'xla'
  elsewhere; `jax.lax.platform_dependent`), 'xla' (the sorts below), 'pallas' (everything after
  `topk_logprobs` as one Pallas Triton program, pallas_kernels.ddtree_build; the same result
  node for node) or 'interpret' (that kernel in Pallas interpret mode, for CPU tests).

  Vectorised, no pop loop: the heap pops nodes in (score desc, rank tuple asc) order, so the
  tree is the first n prefixes in that order. The best n prefixes of depth d are among the
  children of the best n of depth d-1 (a better parent's rank-0 child beats any child of a worse
  parent), so each level is one sort of n*K candidates; a final sort of the J*n survivors by
  (score, whole rank tuple) gives exactly the heap's pop order.
  """
  J, V = draft_logits_jv.shape
  _check_budget(budget, J)
  n, K = budget, min(budget, V)
  if impl not in TREE_IMPLS:
    raise ValueError(f"{impl=} is not one of {TREE_IMPLS}")
  lp_jk, ids_jk = topk_logprobs(draft_logits_jv, K)
  if impl == "xla":
    return _build_from_topk(lp_jk, ids_jk, n)
  from pallas_kernels import ddtree_build  # pylint: disable=import-outside-toplevel
  if impl == "auto" and not ddtree_build.suits_auto(n, K):
    return _build_from_topk(lp_jk, ids_jk, n)
  kernel = functools.partial(ddtree_build.build_from_topk, n=n)
  if impl == "auto":
    return jax.lax.platform_dependent(lp_jk, ids_jk, cuda=kernel,
                                      default=functools.partial(_build_from_topk, n=n))
  return kernel(lp_jk, ids_jk, interpret=impl == "interpret")


def _build_from_topk(lp_jk, ids_jk, n):
  """The XLA builder (the sorts of `build_ddtree`'s docstring) from the top-K per depth."""
  J, K = lp_jk.shape
  first = jnp.arange(n)
  ok = first < K
  hi = jnp.where(ok, lp_jk[0, jnp.minimum(first, K - 1)], -jnp.inf)
  lo = jnp.zeros((n,), jnp.float32)
  tie = jnp.where(ok, first, 0)
  levels = [dict(hi=hi, lo=lo, ok=ok, parent=jnp.full((n,), -1), r=tie)]
  for d in range(1, J):
    hi, lo, ok, parent, r, tie = _level(lp_jk[d], hi, lo, ok, _lexrank(tie, ok), n)
    levels.append(dict(hi=hi, lo=lo, ok=ok, parent=parent, r=r))
  return _assemble(levels, ids_jk, n)


def _digits(levels, n):
  """[J, n, J] rank tuples (r + 1, 0-padded) of every kept node, through its parents."""
  J = len(levels)
  dig = []
  for d, lev in enumerate(levels):
    cur = jnp.zeros((n, J), jnp.int32).at[:, d].set(lev["r"] + 1)
    if d:
      cur = cur + jnp.where(jnp.arange(J) < d, dig[-1][jnp.clip(lev["parent"], 0, n - 1)], 0)
    dig.append(cur)
  return jnp.stack(dig)


def _assemble(levels, ids_jk, n):
  """Global pop order over all levels' survivors -> tokens, depths, parents, visibility."""
  J = len(levels)
  flat_dig = _digits(levels, n).reshape(J * n, J)
  cat = lambda k: jnp.concatenate([lev[k] for lev in levels])
  hi, lo, ok = cat("hi"), cat("lo"), cat("ok")
  keys = (jnp.where(ok, -hi, jnp.inf), -lo) + _packed_digits(flat_dig, ids_jk.shape[1])
  (sel,) = _sort_take(keys, (jnp.arange(J * n),), n)
  valid = ok[sel]
  depth = sel // n + 1
  tokens = jnp.where(valid, ids_jk[depth - 1, cat("r")[sel]], 0)
  # Tree index of each selected (level, slot); a node's parent is a slot of the level above.
  pos = jnp.zeros((J * n,), jnp.int32).at[sel].set(jnp.arange(1, n + 1, dtype=jnp.int32))
  par_flat = jnp.clip((depth - 2) * n + cat("parent")[sel], 0, J * n - 1)
  parents = jnp.where(valid, jnp.where(depth == 1, 0, pos[par_flat]), -1)
  parents = jnp.concatenate([jnp.array([-1]), parents]).astype(jnp.int32)
  depths = jnp.where(valid, depth, 0).astype(jnp.int32)
  return tokens.astype(jnp.int32), depths, parents, _ancestor_mask(flat_dig[sel], depths, valid)


def _packed_digits(digits, k):
  """Rank tuples [rows, J] packed big-endian into as few int32 sort keys as keep lexicographic
  order."""
  bits = int(np.ceil(np.log2(k + 2)))
  per = max(1, 31 // bits)
  keys = []
  for start in range(0, digits.shape[1], per):
    key = jnp.zeros(digits.shape[:1], jnp.int32)
    for i in range(start, min(start + per, digits.shape[1])):
      key = key * (1 << bits) + digits[:, i]
    keys.append(key)
  return tuple(keys)


def _ancestor_mask(dig_nj, depth_n, valid_n):
  """vis[i, j]: j is i or an ancestor of i (tree indices, root 0), from the rank tuples."""
  n, J = dig_nj.shape
  dig = jnp.concatenate([jnp.zeros((1, J), jnp.int32), dig_nj])
  dep = jnp.concatenate([jnp.zeros((1,), jnp.int32), depth_n])
  ok = jnp.concatenate([jnp.array([True]), valid_n])
  prefix = jnp.all((dig[:, None, :] == dig[None, :, :]) | (jnp.arange(J) >= dep[None, :, None]), -1)
  vis = prefix & (dep[None, :] <= dep[:, None]) & ok[:, None] & ok[None, :]
  return vis | jnp.eye(n + 1, dtype=bool)


def build_chain(draft_logits_jv: jax.Array):
  """Greedy DFlash chain as a tree: node k = argmax at depth k+1, parent of node k is node k-1."""
  J = draft_logits_jv.shape[0]
  tokens = jnp.argmax(draft_logits_jv.astype(jnp.float32), axis=-1).astype(jnp.int32)
  depths = jnp.arange(1, J + 1, dtype=jnp.int32)
  parents = jnp.arange(-1, J, dtype=jnp.int32)
  vis = jnp.tril(jnp.ones((J + 1, J + 1), bool))
  return tokens, depths, parents, vis


def accept_walk(parents_n, node_tokens_n, target_tokens_n, max_depth: int | None = None,
                vis_nn=None):
  """The accepted root path: node k is accepted iff its token is its parent's target choice (the
  lowest-index such sibling) and every ancestor is accepted. One vectorised pass, no loop.

  parents_n [N], target_tokens_n [N]: over the tree indices (root included); node_tokens_n
  [N-1]: over the nodes. vis_nn [N, N] (optional): vis[i, j] = j is i or an ancestor of i (the
  tree's visibility mask); without it the ancestors are found from `parents_n` by pointer
  doubling. Returns (path [max_depth+1] int32 tree indices, root first, -1 padded; accept_len
  int32 = accepted draft nodes; next_bonus int32 = the target token after the last accepted
  node). max_depth (static) bounds the path; default N - 1 (always enough).
  """
  nodes = node_tokens_n.shape[0]
  max_d = nodes if max_depth is None else max_depth
  vis = ancestor_matrix(parents_n) if vis_nn is None else vis_nn
  par = parents_n[1:]
  match = (par >= 0) & (node_tokens_n == target_tokens_n[jnp.maximum(par, 0)])
  idx = jnp.arange(nodes)
  earlier_twin = (par[None, :] == par[:, None]) & match[None, :] & (idx[None, :] < idx[:, None])
  ok = jnp.concatenate([jnp.array([True]), match & ~jnp.any(earlier_twin, axis=1)])
  accepted = jnp.all(ok[None, :] | ~vis, axis=1)                   # [N]
  depth = jnp.sum(vis, axis=1, dtype=jnp.int32) - 1
  slot = jnp.where(accepted & (depth <= max_d), depth, max_d + 1)
  path = jnp.full((max_d + 1,), -1, jnp.int32).at[slot].set(
      jnp.arange(nodes + 1, dtype=jnp.int32), mode="drop")
  a = jnp.sum(path >= 0, dtype=jnp.int32) - 1
  return path, a, target_tokens_n[path[a]].astype(jnp.int32)


def ancestor_matrix(parents_n):
  """vis[i, j]: j is i or an ancestor of i, from parent indices (-1: the root, or an invalid
  node that sees only itself), by pointer doubling: log2(N) gathers of the [N, N] mask."""
  n = parents_n.shape[0]
  idx = jnp.arange(n)
  up = jnp.where(parents_n >= 0, parents_n, idx)  # 2^k-th ancestor (the root is its own)
  vis = (idx[:, None] == idx[None, :]) | (up[:, None] == idx[None, :])
  for _ in range(int(np.ceil(np.log2(max(n, 2))))):  # ancestors within 2^k -> within 2^(k+1)
    vis = vis | vis[up]
    up = up[up]
  return vis
