"""DDTree's level loop and assembly (`kdtree_jax.tree.build_ddtree` after `topk_logprobs`) as ONE
Pallas Triton program: build_ddtree's `auto` builder on a GPU up to AUTO_MAX_PADDED_CANDIDATES,
`impl="pallas"` at any budget. The same tree as `kdtree_jax.tree._build_from_topk`, node for node.

Why: XLA's build is ~45 kernels per step at budget 15 / block 16 (a sort and an update fusion per
level, then a global sort, scatters and gathers): launches, not work. Here one program holds the
tiny arrays (n budget nodes, K candidates per depth, J depths) and per depth:
  - the level's nodes go to a scratch buffer in global memory (L1 / L2; a barrier each side), and
    each candidate LOADS its parent's fields (hi, lo, ok, lexrank) and its log-prob: O(Cp) loads;
  - the best np of the Cp candidates, in order, by a bitonic network (pallas_kernels.bitonic:
    sort blocks of np, then halve by best-of-pairs + merges), over three words per candidate
    (score key, lo key, one int32 = padding flag | tie key | candidate index): the exact order of
    XLA's stable sort, the index being the stable sort's last tie-break;
  - the level's survivors merge into the running best np of all levels (descending; one best-of-
    pairs + log2(np) stages): the global pop order without comparing every survivor with every
    survivor.
After the loop one merge turns the running best ascending (pop order), and the tree (parents,
visibility) is compared out ([Np, Np]; `write_tree`). Measured on an H100 (2026-12-05, 4 warps,
CUPTI us per build): 30.7 / 40.3 / 51.3 / 65.1 / 84.9 at budgets 7 / 15 / 31 / 47 / 63, XLA's
sorts 138.5-352.6 (notes/tree_builder.md, which also has the rank-counting selection this
replaced: [Cp, Cp] compares, register spills from Cp 256 on).

Exactness: every key is the XLA builder's: valid first, double-f32 score desc, tie key asc, then
the slot / candidate index; floats compare as IEEE (-0.0 == 0.0, as lax.sort), the candidate
index and (level, slot) index make the orders total. Within a level, XLA's order of valid nodes
(score, tie) is the global order's (score, rank tuple): the tie key (parent's lexicographic rank,
r) orders as the rank tuple, so merging sorted levels gives the global sort. A candidate is valid
iff its score key is finite (log-probs are clamped at -1e30 by topk_logprobs, so valid scores are
finite). Gathers from registers are one-hot compares + sums (x + 0 is exact, and lax.sort
compares -0.0 == 0.0, so a zero's sign, the only thing a sum can change, never matters). Triton's
blocks are powers of two: every axis is padded, and padding sorts after every real entry.

Letters: n budget, K = min(n, V) top-k per depth, J depths, C static (parent, rank) candidate
pairs per level, N = n + 1 tree indices (root 0); a `p` suffix is the padded (power-of-2) size.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import bitonic

_INT_MAX = np.iinfo(np.int32).max
_PAD_BIT = 30


def pow2(x: int) -> int:
  """The smallest power of two >= x (>= 1)."""
  return 1 << max(0, int(x) - 1).bit_length()


def digit_packing(k: int) -> tuple[int, int]:
  """(bits per rank digit, digits per int32 key) of the packed rank tuples: digits r + 1 <= K
  and 0 (padding past a node's depth) in `bits` bits, big-endian, `per` per non-negative key."""
  bits = int(np.ceil(np.log2(k + 2)))
  return bits, max(1, 31 // bits)


def key_layout(n: int, k: int, cp: int) -> tuple[int, int]:
  """(index bits, tie bits) of the candidates' packed int32 key pad<<30 | tie<<ib | index: the
  index < Cp, the tie key lexrank * k + r < pow2(n) * k."""
  ib = bitonic.log2(cp)
  tb = max(1, (pow2(n) * k - 1).bit_length())
  if ib + tb > _PAD_BIT:
    raise ValueError(f"bitonic selection packs tie and index in 30 bits: n={n}, k={k} need "
                     f"{ib + tb}")
  return ib, tb


def _take(vec, idx, axis_ids, zero):
  """vec[idx] as a one-hot compare + sum: vec [P], idx [Q] (ids in axis_ids [P]) -> [Q]."""
  hit = idx[:, None] == axis_ids[None, :]
  return jnp.sum(jnp.where(hit, vec[None, :], zero), axis=1)


def _dd_add(hi, lo, x):
  """Double-f32 (hi, lo) + f32 x, renormalized: the same operations as kdtree_jax.tree._dd_add."""
  s = hi + x
  bb = s - hi
  e = (hi - (s - bb)) + (x - bb)
  lo = lo + e
  hi2 = s + lo
  return hi2, lo - (hi2 - s)


def _beats(keys_a, keys_b, idx_a, idx_b):
  """[A, B]: entry a sorts before entry b under (keys..., index) ascending (lexicographic)."""
  before = idx_a < idx_b
  for ka, kb in zip(reversed(keys_a), reversed(keys_b)):
    before = (ka < kb) | ((ka == kb) & before)
  return before


def _lexrank(tie, ok, slot):
  """Rank of each node of a level under (valid first, tie asc, slot asc): tree._lexrank."""
  key = jnp.where(ok, tie, _INT_MAX)
  before = _beats([key[:, None]], [key[None, :]], slot[:, None], slot[None, :])
  return jnp.sum(before.astype(jnp.int32), axis=0)


def _candidate_before(a, b):
  """Candidates (score key, lo key, packed int) in XLA's level order (the int is unique)."""
  return _beats(list(a[:2]), list(b[:2]), a[2], b[2])


def _global_before(m):
  """Survivors (score key, lo key, m rank-tuple keys, level * np + slot, payload...) in XLA's
  global pop order."""
  def before(a, b):
    return _beats(list(a[:2 + m]), list(b[:2 + m]), a[2 + m], b[2 + m])
  return before


def _first_level(lp_ref, ids_ref, slot, *, k, bits, per, m):
  """Depth 1: the top-k of block position 1 (r = slot), the rest invalid: (hi, lo, ok, tie,
  keys) and the token of each slot."""
  ok = slot < k
  r = jnp.where(ok, slot, 0)
  hi = jnp.where(ok, lp_ref[0, r], -jnp.inf)
  keys = tuple(((r + 1) << (bits * (per - 1))) if i == 0 else jnp.zeros_like(r)
               for i in range(m))
  return (hi, jnp.zeros_like(hi), ok.astype(jnp.int32), r, *keys), ids_ref[0, r]


def _survivor_entry(level, token, parent, d, slot, np_):
  """A level's nodes as global-order entries: (score key, lo key, keys, index, token, parent)."""
  hi, lo, ok, _, *keys = level
  score = jnp.where(ok > 0, -hi, jnp.inf)
  return (score, -lo, *keys, d * np_ + slot, token, parent)


def _barrier(interpret):
  """All threads of the program meet (global-memory writes before it are visible after it); a
  no-op in interpret mode, where the program is one sequential evaluation."""
  if not interpret:
    plt.debug_barrier()


def _children(level, d, refs, cand, *, n, k, c, np_, bits, per, m, interpret):
  """One depth: the best np children (slots >= n invalid) of `level`'s nodes in XLA's level
  order, as (hi, lo, ok, tie, keys) plus each one's token and parent slot."""
  lp_ref, ids_ref, cj_ref, cr_ref, hl_ref, is_ref = refs
  cj, cr, cidx = cand
  hi, lo, ok, tie, *keys = level
  slot = jnp.arange(np_, dtype=jnp.int32)
  hl_ref[0, :] = hi
  hl_ref[1, :] = lo
  is_ref[0, :] = ok
  is_ref[1, :] = _lexrank(tie, ok > 0, slot)
  for i, key in enumerate(keys):
    is_ref[2 + i, :] = key
  _barrier(interpret)                              # the level is in memory for every thread
  pad = cidx >= c
  c_ok = (is_ref[0, cj] > 0) & ~pad
  c_hi, c_lo = _dd_add(hl_ref[0, cj], hl_ref[1, cj], lp_ref[d, cr])
  score = jnp.where(c_ok, -c_hi, jnp.inf)
  lo_key = -jnp.where(c_ok, c_lo, 0.0)
  ib, tb = key_layout(n, k, cj.shape[0])
  packed = (pad.astype(jnp.int32) << _PAD_BIT) | ((is_ref[1, cj] * k + cr) << ib) | cidx
  score, lo_key, packed = bitonic.top_sorted((score, lo_key, packed), _candidate_before, np_)
  index = packed & ((1 << ib) - 1)
  parent, r = cj_ref[index], cr_ref[index]
  ok = (score < jnp.inf) & (slot < n)
  digit = (r + 1) << (bits * (per - 1 - jax.lax.rem(d, per)))  # d >= 0: rem, div = %, //
  new_keys = tuple(is_ref[2 + i, parent] + jnp.where(i == jax.lax.div(d, per), digit, 0)
                   for i in range(m))
  token = ids_ref[d, r]
  _barrier(interpret)                              # every read done before the next level writes
  tie = (packed >> ib) & ((1 << tb) - 1)
  return (-score, -lo_key, ok.astype(jnp.int32), tie, *new_keys), token, parent


def _best_survivors(refs, *, n, k, j, c, bits, per, m, interpret):
  """The best np survivors of all levels in pop order (ascending), as global-order entries."""
  lp_ref, ids_ref, cj_ref, cr_ref = refs[:4]
  np_ = pow2(n)
  slot = jnp.arange(np_, dtype=jnp.int32)
  cj, cr = cj_ref[...], cr_ref[...]
  cand = (cj, cr, jnp.arange(cj.shape[0], dtype=jnp.int32))
  before = _global_before(m)
  level, token = _first_level(lp_ref, ids_ref, slot, k=k, bits=bits, per=per, m=m)
  first = _survivor_entry(level, token, jnp.full_like(slot, -1), 0, slot, np_)
  worst = tuple(jnp.full_like(x, jnp.inf if x.dtype == jnp.float32 else _INT_MAX)
                for x in first)                    # after every entry, real or invalid
  acc = bitonic.merge_best(worst, first, before)

  def step(d, carry):
    level, acc = carry
    level, token, parent = _children(level, d, refs, cand, n=n, k=k, c=c, np_=np_, bits=bits,
                                     per=per, m=m, interpret=interpret)
    entry = _survivor_entry(level, token, parent, d, slot, np_)
    return level, bitonic.merge_best(acc, entry, before)

  acc = jax.lax.fori_loop(1, j, step, (level, acc))[1]
  return bitonic.merge(acc, before, np_, None)


def _tree_fields(acc, npos, np_, m):
  """Per tree index t (0 = root, t = pop position + 1): ok, depth, token, parent slot, slot, keys
  (zeros for the root and past np)."""
  score, _, *rest = acc
  keys, index, token, parent = rest[:m], rest[m], rest[m + 1], rest[m + 2]
  t = jnp.arange(npos, dtype=jnp.int32)
  pos = jnp.arange(np_, dtype=jnp.int32)
  shift = lambda v: _take(v, t - 1, pos, 0)
  fields = dict(ok=shift((score < jnp.inf).astype(jnp.int32)), depth=shift(index // np_ + 1),
                token=shift(token), parent=shift(parent), slot=shift(index % np_))
  return t, fields, [shift(key) for key in keys]


def write_tree(tok_ref, dep_ref, par_ref, vis_ref, t, f, keys, *, n, bits, per):
  """The outputs from the per-tree-index fields (t, f, keys as `_tree_fields` gives them):
  tokens, depths, parents and visibility."""
  valid = (f["ok"] > 0) & (t >= 1) & (t <= n)
  depth = jnp.where(valid, f["depth"], 0)
  tok_ref[...] = jnp.where(valid, f["token"], 0)
  dep_ref[...] = depth
  # A node's parent: the tree index whose survivor is (its level - 1, its parent slot).
  is_parent = ((f["depth"][None, :] == f["depth"][:, None] - 1)
               & (f["slot"][None, :] == f["parent"][:, None]) & valid[None, :])
  parent = jnp.sum(jnp.where(is_parent, t[None, :], 0), axis=1)
  par_ref[...] = jnp.where(valid, jnp.where(depth == 1, 0, parent), -1)
  vis_ref[...] = _visibility(t, depth, valid | (t == 0), keys, bits, per).astype(jnp.int32)


def _visibility(t, depth, ok, keys, bits, per):
  """vis[i, j]: j is i or an ancestor of i: j's rank tuple (its first depth_j digits) is a
  prefix of i's (tree._ancestor_mask), compared key by key after shifting out the digits past
  depth_j (zero in j's keys)."""
  dep_j = depth[None, :]
  vis = (dep_j <= depth[:, None]) & ok[:, None] & ok[None, :]
  for m, key in enumerate(keys):
    shift = bits * (per - jnp.clip(dep_j - m * per, 0, per))
    vis = vis & ((key[:, None] >> shift) == (key[None, :] >> shift))
  return vis | (t[:, None] == t[None, :])


def _kernel(lp_ref, ids_ref, cj_ref, cr_ref, tok_ref, dep_ref, par_ref, vis_ref, hl_ref, is_ref,
            *, n, k, j, c, bits, per, m, interpret):
  """lp/ids [Jp, Kp] top-k log-probs and ids per depth, cj/cr [Cp] static candidate pairs ->
  tokens/depths/parents [Np] and visibility [Np, Np] (int32) over tree indices; hl_ref [2, np]
  f32 and is_ref [2 + m, np] int32 are the level scratch (outputs nobody reads)."""
  refs = (lp_ref, ids_ref, cj_ref, cr_ref, hl_ref, is_ref)
  acc = _best_survivors(refs, n=n, k=k, j=j, c=c, bits=bits, per=per, m=m, interpret=interpret)
  t, f, keys = _tree_fields(acc, tok_ref.shape[0], pow2(n), m)
  write_tree(tok_ref, dep_ref, par_ref, vis_ref, t, f, keys, n=n, bits=bits, per=per)


# The largest padded candidate count Cp = pow2(C) at which build_ddtree's `auto` takes this
# kernel on a GPU (above it, XLA's sorts): Cp 512 = budgets 60-105 at K = n (63 measured). The
# kernel beat XLA's sorts at every Cp up to 512 on an H100 (2026-12-05,
# scripts/bench_tree_builder.py, CUPTI us per build): 84.9 vs 352.6 at budget 63. The rank-counting
# selection it replaced fell off at Cp 256 (1161.9 vs 304.3) and took the trained pair's step at
# budget 63 to 5.92 ms (vs 0.90 with XLA's builder), which is why the cap was 128 before.
AUTO_MAX_PADDED_CANDIDATES = 512


def padded_candidates(n: int, k: int) -> int:
  """Cp: the kernel's padded count of (parent, rank) candidates per level for n nodes, top-k k."""
  return pow2(len(candidate_pairs(n, k)[0]))


def suits_auto(n: int, k: int) -> bool:
  """Whether build_ddtree's `auto` takes this kernel for n nodes and top-k k (on a GPU)."""
  return padded_candidates(n, k) <= AUTO_MAX_PADDED_CANDIDATES


def candidate_pairs(n, k):
  """The static (parent j, child rank r) candidate pairs of tree._candidate_pairs."""
  from kdtree_jax import tree  # pylint: disable=import-outside-toplevel
  return tree._candidate_pairs(n, k)  # pylint: disable=protected-access


# Triton warps: 4 at every Cp (H100, 2026-12-05: 4 vs 8 warps 30.7 / 36.1 us at Cp 16, 40.3 / 47.6
# at 64, 51.3 / 53.1 at 128, 65.1 / 75.7 at 256).
BITONIC_WARPS = 4


def build_from_topk(lp_jk, ids_jk, n: int, interpret: bool = False,
                    num_warps: int = BITONIC_WARPS):
  """tree.build_ddtree's result from topk_logprobs' (log-probs, ids) [J, K], as one kernel."""
  j, k = lp_jk.shape
  cj, cr = candidate_pairs(n, k)
  c = len(cj)
  cp, jp, kp, npos, np_ = pow2(c), pow2(j), pow2(k), pow2(n + 1), pow2(n)
  key_layout(n, k, cp)                              # fails early if the keys do not fit
  bits, per = digit_packing(k)
  m = -(-j // per)
  pad2 = lambda x: jnp.pad(x, ((0, jp - j), (0, kp - k)))
  cand = lambda x: jnp.asarray(np.pad(x, (0, cp - c)).astype(np.int32))
  kernel = functools.partial(_kernel, n=n, k=k, j=j, c=c, bits=bits, per=per, m=m,
                             interpret=interpret)
  vec = jax.ShapeDtypeStruct((npos,), jnp.int32)
  tok, dep, par, vis, _, _ = pl.pallas_call(
      kernel,
      out_shape=[vec, vec, vec, jax.ShapeDtypeStruct((npos, npos), jnp.int32),
                 jax.ShapeDtypeStruct((2, np_), jnp.float32),
                 jax.ShapeDtypeStruct((2 + m, np_), jnp.int32)],
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
  )(pad2(lp_jk), pad2(ids_jk), cand(cj), cand(cr))
  return tok[1:n + 1], dep[1:n + 1], par[:n + 1], vis[:n + 1, :n + 1] != 0
