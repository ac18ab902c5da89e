"""DDTree's level loop and assembly (`kdtree_jax.tree.build_ddtree` after `topk_logprobs`) as ONE
Pallas Triton program (build_ddtree's `auto` builder on a GPU up to AUTO_MAX_PADDED_CANDIDATES;
`impl="pallas"` at any budget).

The XLA build is ~45 kernels per step at budget 15 / block 16 (a sort and an update fusion per
level, then a global sort, scatters and gathers): launches, not work. Here one program holds
every array in registers (all tiny: n budget nodes, K candidates per depth, J depths) and
  - selects by RANK COUNTING: a candidate's rank = how many candidates beat it under exactly the
    XLA sort's key order (valid first, double-f32 score desc, tie key asc, slot asc), so the
    kept ones are those of rank < n, in rank order;
  - gathers and scatters as one-hot compares + sums (x + 0 is exact, and lax.sort compares
    -0.0 == 0.0, so a zero's sign, the only thing a sum can change, never matters).
Triton's blocks are powers of two: every axis is padded, and padding ranks after every real
entry (a leading key) and is never selected.

Structure (two loops, so the Triton program stays small: the first, fully unrolled version took
~3 minutes of XLA:GPU compile): a loop over depths builds the survivors [Jp, np] (each level's n
kept nodes: [Cp, Cp] candidate compares), a loop over the survivors' levels counts their global
ranks ([np, Jp, np] compares a step), a loop over levels gathers them into tree order, then the
parents and visibility ([Np, Np]) are compared out. At budget 15 / block 16: Cp = 64 (C = 45),
Jp = np = 16, Np = 32; at budget 63: Cp = 512 (C = 273), the [Cp, Cp] compare is 256k entries
per level: the trained pair's step at budget 63 took 5.92 ms with this kernel, 0.91 with XLA's
builder (H100, 2026-12-05).

This module is the "rank" selection (`build_from_topk(selection="rank")`); the DEFAULT is the
"bitonic" one (pallas_kernels.ddtree_bitonic: bitonic networks and memory gathers, no [Cp, Cp] or
[np, Jp, np] compares, no register spills at Cp 512; default_selection), faster at every budget on
an H100 (notes/tree_builder.md). It shares the candidate pairs and the output stage (`write_tree`).

Letters: n budget, K = min(n, V) top-k per depth, J depths, C static (parent, rank) candidate
pairs per level, N = n + 1 tree indices (root 0); a `p` suffix is the padded (power-of-2) size.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

_INT_MAX = np.iinfo(np.int32).max


def pow2(x: int) -> int:
  """The smallest power of two >= x (>= 1)."""
  return 1 << max(0, int(x) - 1).bit_length()


def digit_packing(k: int) -> tuple[int, int]:
  """(bits per rank digit, digits per int32 key) of the packed rank tuples: digits r + 1 <= K
  and 0 (padding past a node's depth) in `bits` bits, big-endian, `per` per non-negative key."""
  bits = int(np.ceil(np.log2(k + 2)))
  return bits, max(1, 31 // bits)


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


def _row(x2d, rows, d, zero):
  """Row d (traced) of a [Jp, P] array, as a masked sum (exact: one term is not zero)."""
  return jnp.sum(jnp.where(rows[:, None] == d, x2d, zero), axis=0)


def _set_row(x2d, rows, d, v):
  """x2d with row d (traced) replaced by v [P]."""
  return jnp.where(rows[:, None] == d, v[None, :], x2d)


# A level's nodes (1D over slots) and the survivors of every level (2D [Jp, np]) are carried
# through the loops as tuples in this order; `keys` (the packed rank tuples) are appended.
_LEVEL = ("hi", "lo", "ok", "tie")
_SURV = ("hi", "lo", "ok", "parent", "token")


def _children(lvl, lp_row, cj, cr, *, n, k, c):
  """The n kept children (score desc, rank tuple asc) of one level's nodes, in pop order, by
  rank counting: tree._level. Returns (hi, lo, ok, parent slot, r, tie) over slots."""
  slot = jnp.arange(lvl["hi"].shape[0], dtype=jnp.int32)
  cidx = jnp.arange(cj.shape[0], dtype=jnp.int32)
  kk = jnp.arange(lp_row.shape[0], dtype=jnp.int32)
  lexrank = _lexrank(lvl["tie"], lvl["ok"] > 0, slot)
  pad = cidx >= c
  c_ok = (_take(lvl["ok"], cj, slot, 0) > 0) & ~pad
  c_hi, c_lo = _dd_add(_take(lvl["hi"], cj, slot, 0.0), _take(lvl["lo"], cj, slot, 0.0),
                       _take(lp_row, cr, kk, 0.0))
  c_hi, c_lo = jnp.where(c_ok, c_hi, -jnp.inf), jnp.where(c_ok, c_lo, 0.0)
  tie = _take(lexrank, cj, slot, 0) * k + cr
  keys = [pad.astype(jnp.int32), jnp.where(c_ok, -c_hi, jnp.inf), -c_lo, tie]
  before = _beats([x[:, None] for x in keys], [x[None, :] for x in keys],
                  cidx[:, None], cidx[None, :])
  rank = jnp.sum(before.astype(jnp.int32), axis=0)
  pick = lambda v, zero: jnp.sum(jnp.where(rank[None, :] == slot[:, None], v[None, :], zero), 1)
  ok = (pick(c_ok.astype(jnp.int32), 0) > 0) & (slot < n)
  return (pick(c_hi, 0.0), pick(c_lo, 0.0), ok.astype(jnp.int32), pick(cj, 0), pick(cr, 0),
          pick(tie, 0))


def _first_level(lp, ids, np_, *, k, bits, per, m):
  """Depth 1 (the top-k of block position 1, rank r = slot, the rest invalid) as a level tuple
  (_LEVEL + keys) and its survivor row (_SURV + keys)."""
  rows = jnp.arange(lp.shape[0], dtype=jnp.int32)
  slot = jnp.arange(np_, dtype=jnp.int32)
  kk = jnp.arange(lp.shape[1], dtype=jnp.int32)
  ok = slot < k
  r = jnp.where(ok, slot, 0)
  hi = jnp.where(ok, _take(_row(lp, rows, 0, 0.0), r, kk, 0.0), -jnp.inf)
  lo = jnp.zeros_like(hi)
  keys = [((r + 1) << (bits * (per - 1))) if i == 0 else jnp.zeros_like(r) for i in range(m)]
  token = _take(_row(ids, rows, 0, 0), r, kk, 0)
  return ((hi, lo, ok.astype(jnp.int32), r, *keys),
          (hi, lo, ok.astype(jnp.int32), jnp.full_like(r, -1), token, *keys))


def _survivors(lp, ids, cj, cr, np_, *, n, k, j, c, bits, per, m):
  """Every level's kept nodes as survivors [Jp, np] (_SURV + packed rank tuples): depth 1, then
  one loop step per depth (tree._level + tree._digits)."""
  jp, kp = lp.shape
  rows = jnp.arange(jp, dtype=jnp.int32)
  slot = jnp.arange(np_, dtype=jnp.int32)
  kk = jnp.arange(kp, dtype=jnp.int32)
  put = lambda vals, d, old: tuple(_set_row(x2d, rows, d, v) for x2d, v in zip(old, vals))
  level, first = _first_level(lp, ids, np_, k=k, bits=bits, per=per, m=m)
  zeros = lambda x: jnp.zeros((jp, np_), x.dtype)
  surv = put(first, 0, tuple(zeros(x) for x in first))

  def step(d, carry):
    level, surv = carry
    lvl = dict(zip(_LEVEL, level[:4]))
    hi, lo, ok, parent, r, tie = _children(lvl, _row(lp, rows, d, 0.0), cj, cr, n=n, k=k, c=c)
    digit = (r + 1) << (bits * (per - 1 - jax.lax.rem(d, per)))  # d >= 0: rem, div = %, //
    keys = [_take(pk, parent, slot, 0) + jnp.where(i == jax.lax.div(d, per), digit, 0)
            for i, pk in enumerate(level[4:])]
    token = _take(_row(ids, rows, d, 0), r, kk, 0)
    return (hi, lo, ok, tie, *keys), put((hi, lo, ok, parent, token, *keys), d, surv)

  return jax.lax.fori_loop(1, j, step, (level, surv))[1]


def _global_rank(surv, n, j):
  """rank [Jp, np]: position of survivor (level d, slot s) in the heap's pop order
  (tree._assemble's sort keys: valid first, score desc, rank tuple asc, then level and slot);
  padding (slots >= n, levels >= J) last. One loop step per level of the rival survivors."""
  hi, lo, ok = surv[:3]
  keys2d = surv[5:]
  jp, np_ = hi.shape
  rows = jnp.arange(jp, dtype=jnp.int32)
  slot = jnp.arange(np_, dtype=jnp.int32)
  real = (slot[None, :] < n) & (rows[:, None] < j)
  keys = [(~real).astype(jnp.int32), jnp.where(ok > 0, -hi, jnp.inf), -lo, *keys2d]
  index = rows[:, None] * np_ + slot[None, :]

  def step(d, acc):
    rival = [_row(x, rows, d, x.dtype.type(0)) for x in keys]
    before = _beats([x[:, None, None] for x in rival], [x[None] for x in keys],
                    (d * np_ + slot)[:, None, None], index[None])
    return acc + jnp.sum(before.astype(jnp.int32), axis=0)

  return jax.lax.fori_loop(0, j, step, jnp.zeros((jp, np_), jnp.int32))


def _outputs(surv, rank, n, j, npos):
  """Per tree index t (0 = root, 1..n = pop order): valid, depth, token, parent slot, slot and
  packed keys of the survivor of rank t - 1 (zeros for the root and padding)."""
  jp, np_ = rank.shape
  rows = jnp.arange(jp, dtype=jnp.int32)
  slot = jnp.arange(np_, dtype=jnp.int32)
  t = jnp.arange(npos, dtype=jnp.int32)
  ok, parent, token, keys = surv[2], surv[3], surv[4], surv[5:]
  fields = (ok, jnp.broadcast_to(rows[:, None] + 1, rank.shape), token, parent,
            jnp.broadcast_to(slot[None, :], rank.shape), *keys)

  def step(d, acc):
    hit = ((_row(rank, rows, d, 0) + 1)[None, :] == t[:, None]) & (slot < n)[None, :]
    return tuple(a + jnp.sum(jnp.where(hit, _row(x, rows, d, 0)[None, :], 0), axis=1)
                 for a, x in zip(acc, fields))

  out = jax.lax.fori_loop(0, j, step, tuple(jnp.zeros((npos,), jnp.int32) for _ in fields))
  return t, dict(zip(("ok", "depth", "token", "parent", "slot"), out[:5])), list(out[5:])


def _kernel(lp_ref, ids_ref, cj_ref, cr_ref, tok_ref, dep_ref, par_ref, vis_ref, *,
            n, k, j, c, bits, per, m):
  """lp/ids [Jp, Kp] top-k log-probs and ids per depth, cj/cr [Cp] static candidate pairs ->
  tokens/depths/parents [Np] and visibility [Np, Np] (int32) over tree indices."""
  surv = _survivors(lp_ref[...], ids_ref[...], cj_ref[...], cr_ref[...], pow2(n),
                    n=n, k=k, j=j, c=c, bits=bits, per=per, m=m)
  t, f, keys = _outputs(surv, _global_rank(surv, n, j), n, j, tok_ref.shape[0])
  write_tree(tok_ref, dep_ref, par_ref, vis_ref, t, f, keys, n=n, bits=bits, per=per)


def write_tree(tok_ref, dep_ref, par_ref, vis_ref, t, f, keys, *, n, bits, per):
  """The outputs from the per-tree-index fields (t, f, keys as `_outputs` gives them): tokens,
  depths, parents and visibility (shared with pallas_kernels.ddtree_bitonic)."""
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


# The largest padded candidate count Cp = pow2(C) at which build_ddtree's `auto` takes this
# kernel on a GPU (above it, XLA's sorts): Cp 512 = budgets 60-105 at K = n (63 measured). The bitonic selection
# (default_selection) beat XLA's sorts at every Cp up to 512 on an H100 (2026-12-05,
# scripts/bench_tree_builder.py, CUPTI us per build): 84.9 vs 352.6 at budget 63. The rank
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


def default_warps(cp: int) -> int:
  """Triton warps by padded candidate count: measured on an H100 (2026-12-05,
  scripts/bench_tree_builder.py, CUPTI us per build): Cp 16 / 64 4 warps 48.7 / 77.6 vs 8 warps
  59.1 / 87.5; Cp 128 4 warps 149.2 vs 8 warps 140.1."""
  return 8 if cp >= 128 else 4


# The kernel's per-depth selection: "rank" (this module: rank counting, [Cp, Cp] compares) or
# "bitonic" (pallas_kernels.ddtree_bitonic: bitonic networks and memory gathers, O(Cp log^2 np)).
SELECTIONS = ("rank", "bitonic")


def default_selection(cp: int) -> str:
  """The selection by padded candidate count: "bitonic" at every Cp. Measured on an H100
  (2026-12-05, scripts/bench_tree_builder.py, CUPTI us per build, bitonic 4 warps vs rank vs XLA's
  sorts): Cp 16 30.7 / 48.3 / 138.5, Cp 64 40.3 / 77.7 / 213.9, Cp 128 51.3 / 140.8 / 262.8,
  Cp 256 65.1 / 447.0 / 305.5, Cp 512 84.9 / 1178 / 352.6. "rank" stays selectable by name."""
  del cp
  return "bitonic"


# Triton warps of the bitonic selection: 4 at every Cp (H100, 2026-12-05: 4 vs 8 warps 30.7 / 36.1
# us at Cp 16, 40.3 / 47.6 at 64, 51.3 / 53.1 at 128, 65.1 / 75.7 at 256).
BITONIC_WARPS = 4


def build_from_topk(lp_jk, ids_jk, n: int, interpret: bool = False,
                    num_warps: int | None = None, selection: str | None = None):
  """tree.build_ddtree's result from topk_logprobs' (log-probs, ids) [J, K], as one kernel.
  selection: one of SELECTIONS (None: default_selection(Cp))."""
  j, k = lp_jk.shape
  cj, cr = candidate_pairs(n, k)
  c = len(cj)
  cp, jp, kp, npos = pow2(c), pow2(j), pow2(k), pow2(n + 1)
  selection = selection or default_selection(cp)
  if selection not in SELECTIONS:
    raise ValueError(f"{selection=} is not one of {SELECTIONS}")
  if selection == "bitonic":
    from pallas_kernels import ddtree_bitonic  # pylint: disable=import-outside-toplevel
    return ddtree_bitonic.build_from_topk(lp_jk, ids_jk, n, interpret=interpret,
                                          num_warps=num_warps or BITONIC_WARPS)
  bits, per = digit_packing(k)
  pad2 = lambda x: jnp.pad(x, ((0, jp - j), (0, kp - k)))
  cand = lambda x: jnp.asarray(np.pad(x, (0, cp - c)).astype(np.int32))
  kernel = functools.partial(_kernel, n=n, k=k, j=j, c=c, bits=bits, per=per,
                             m=-(-j // per))
  vec = jax.ShapeDtypeStruct((npos,), jnp.int32)
  tok, dep, par, vis = pl.pallas_call(
      kernel,
      out_shape=[vec, vec, vec, jax.ShapeDtypeStruct((npos, npos), jnp.int32)],
      compiler_params=plt.CompilerParams(num_warps=num_warps or default_warps(cp),
                                         num_stages=1),
      interpret=interpret,
  )(pad2(lp_jk), pad2(ids_jk), cand(cj), cand(cr))
  return tok[1:n + 1], dep[1:n + 1], par[:n + 1], vis[:n + 1, :n + 1] != 0
