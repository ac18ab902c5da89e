"""DDTree on device: best-first draft tree, chain tree, and the acceptance walk.

Letters: L depth (draft positions 1..L), V vocab, K top-k per depth, N node budget
(tree indices 0..N, index 0 = the root = the bonus token), F frontier slots.

`build_ddtree` reproduces `build_ddtree_tree` of liranringel/ddtree node for node: a max-heap
on path log-prob with entries (-score, rank_tuple); popping a node emits it, then pushes its next
sibling (rank r+1, if r+1 < K) and its first child (depth+1, rank 0, if depth < L). Here the
heap is a fixed array of N+1 frontier slots and each pop is an argmax whose ties are broken by
the lexicographically smallest rank tuple, as heapq does.

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

import jax
import jax.numpy as jnp
from jax import lax

_LOGP_FLOOR = -1e30


def topk_logprobs(draft_logits_lv: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Top-k log-probs [L, K] f32 (log_softmax over full V) and their token ids [L, K] int32."""
  logits = draft_logits_lv.astype(jnp.float32)
  top, ids = lax.top_k(logits, k)
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


def _best_slot(f_hi, f_lo, f_ranks_fl, f_valid):
  """Frontier slot with max score; ties -> lexicographically smallest rank tuple."""
  neg = jnp.float32(-jnp.inf)
  hi = jnp.where(f_valid, f_hi, neg)
  cand = f_valid & (hi == jnp.max(hi))
  lo = jnp.where(cand, f_lo, neg)
  cand = cand & (lo == jnp.max(lo))
  big = jnp.iinfo(jnp.int32).max
  for i in range(f_ranks_fl.shape[1]):
    r = jnp.where(cand, f_ranks_fl[:, i], big)
    cand = cand & (r == jnp.min(r))
  return jnp.argmax(cand).astype(jnp.int32), jnp.any(f_valid)


def _check_budget(budget: int, depth: int):
  """Trace-time argument checks."""
  if budget < 1:
    raise ValueError(f"{budget=} must be >= 1")
  if depth < 1:
    raise ValueError(f"draft depth {depth=} must be >= 1 (draft_logits is [depth, V])")


def build_ddtree(draft_logits_lv: jax.Array, budget: int):
  """Best-first DDTree -> (node_tokens [N], node_depths [N], parents [N+1], visibility [N+1, N+1])."""
  L, V = draft_logits_lv.shape
  _check_budget(budget, L)
  N, K = budget, min(budget, V)
  lp_lk, ids_lk = topk_logprobs(draft_logits_lv, K)
  F = N + 1
  f = dict(
      hi=jnp.zeros((F,), jnp.float32).at[0].set(lp_lk[0, 0]),
      lo=jnp.zeros((F,), jnp.float32),
      valid=jnp.zeros((F,), bool).at[0].set(True),
      parent=jnp.zeros((F,), jnp.int32),
      depth=jnp.ones((F,), jnp.int32),
      rank=jnp.zeros((F,), jnp.int32),
      ranks=jnp.full((F, L), -1, jnp.int32).at[0, 0].set(0),
  )
  t = dict(
      tokens=jnp.zeros((N,), jnp.int32),
      depths=jnp.zeros((N,), jnp.int32),
      parents=jnp.full((N + 1,), -1, jnp.int32),
      hi=jnp.zeros((N + 1,), jnp.float32),
      lo=jnp.zeros((N + 1,), jnp.float32),
      vis=jnp.zeros((N + 1, N + 1), bool).at[0, 0].set(True),
  )

  def pop(k, carry):
    f, t = carry
    s, any_valid = _best_slot(f["hi"], f["lo"], f["ranks"], f["valid"])
    idx = k + 1
    par, d, r = f["parent"][s], f["depth"][s], f["rank"][s]
    hi, lo, ranks = f["hi"][s], f["lo"][s], f["ranks"][s]
    tok = jnp.where(any_valid, ids_lk[d - 1, r], 0)
    eye = jnp.arange(N + 1) == idx
    vis_row = jnp.where(any_valid, t["vis"][par] | eye, eye)
    t = dict(
        tokens=t["tokens"].at[k].set(tok),
        depths=t["depths"].at[k].set(jnp.where(any_valid, d, 0)),
        parents=t["parents"].at[idx].set(jnp.where(any_valid, par, -1)),
        hi=t["hi"].at[idx].set(hi),
        lo=t["lo"].at[idx].set(lo),
        vis=t["vis"].at[idx].set(vis_row),
    )
    # Next sibling replaces the popped slot: same parent, rank r+1.
    sib_ok = any_valid & (r + 1 < K)
    s_hi, s_lo = _dd_add(t["hi"][par], t["lo"][par], lp_lk[d - 1, jnp.minimum(r + 1, K - 1)])
    f = _write_slot(f, s, sib_ok, s_hi, s_lo, par, d, r + 1, ranks.at[d - 1].set(r + 1))
    # First child goes to the fresh slot idx: depth d+1, rank 0.
    kid_ok = any_valid & (d < L)
    c_hi, c_lo = _dd_add(hi, lo, lp_lk[jnp.minimum(d, L - 1), 0])
    c_ranks = ranks.at[jnp.minimum(d, L - 1)].set(jnp.where(d < L, 0, ranks[L - 1]))
    f = _write_slot(f, idx, kid_ok, c_hi, c_lo, idx, d + 1, 0, c_ranks)
    return f, t

  f, t = lax.fori_loop(0, N, pop, (f, t))
  return t["tokens"], t["depths"], t["parents"], t["vis"]


def _write_slot(f, s, ok, hi, lo, parent, depth, rank, ranks):
  """Write one frontier entry at slot s (valid iff ok)."""
  return dict(
      hi=f["hi"].at[s].set(hi),
      lo=f["lo"].at[s].set(lo),
      valid=f["valid"].at[s].set(ok),
      parent=f["parent"].at[s].set(parent),
      depth=f["depth"].at[s].set(depth),
      rank=f["rank"].at[s].set(rank),
      ranks=f["ranks"].at[s].set(ranks),
  )


def build_chain(draft_logits_lv: jax.Array):
  """Greedy DFlash chain as a tree: node k = argmax at depth k+1, parent of node k is node k-1."""
  L = draft_logits_lv.shape[0]
  tokens = jnp.argmax(draft_logits_lv.astype(jnp.float32), axis=-1).astype(jnp.int32)
  depths = jnp.arange(1, L + 1, dtype=jnp.int32)
  parents = jnp.arange(-1, L, dtype=jnp.int32)
  vis = jnp.tril(jnp.ones((L + 1, L + 1), bool))
  return tokens, depths, parents, vis


def accept_walk(parents_n1, node_tokens_n, target_tokens_n1, max_depth: int | None = None):
  """Walk from the root while the target's token is a child's token.

  Returns (path [max_depth+1] int32 tree indices, root first, -1 padded; accept_len int32
  = accepted draft nodes; next_bonus int32 = the target token after the last accepted node).
  max_depth (static) bounds the walk; default N (always enough).
  """
  N = node_tokens_n.shape[0]
  D = N if max_depth is None else max_depth
  child_parent = parents_n1[1:]
  path = jnp.full((D + 1,), -1, jnp.int32).at[0].set(0)

  def step(i, carry):
    cur, nxt, n, path, live = carry
    hit = live & (child_parent == cur) & (node_tokens_n == nxt)
    ok = jnp.any(hit)
    child = (jnp.argmax(hit) + 1).astype(jnp.int32)
    cur = jnp.where(ok, child, cur)
    path = path.at[i + 1].set(jnp.where(ok, child, -1))
    nxt = jnp.where(ok, target_tokens_n1[cur], nxt)
    return cur, nxt, n + ok.astype(jnp.int32), path, live & ok

  init = (jnp.int32(0), target_tokens_n1[0].astype(jnp.int32), jnp.int32(0), path, jnp.bool_(True))
  _, nxt, n, path, _ = lax.fori_loop(0, D, step, init)
  return path, n, nxt.astype(jnp.int32)
