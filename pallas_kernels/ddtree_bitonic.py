"""DDTree's builder as one Pallas Triton program with BITONIC selection (ddtree_build's
`selection="bitonic"`): the same tree as `kdtree_jax.tree._build_from_topk`, node for node, with
no [Cp, Cp] or [np, Jp, np] compare.

Why: the rank-counting kernel (ddtree_build) compares every candidate with every candidate per
depth ([Cp, Cp]) and every survivor with every survivor ([np, Jp, np] per level); on an H100 it
went from 140 us at Cp 128 to 1162 / 1178 us at Cp 256 / 512 (notes/tree_builder.md), where XLA's
sorts take 304 / 352. Here per depth:
  - the level's nodes go to a scratch buffer in global memory (L1 / L2; a barrier each side), and
    each candidate LOADS its parent's fields (hi, lo, ok, lexrank) and its log-prob: O(Cp) loads
    where the rank kernel's one-hot gathers were [Cp, np] compares each;
  - the best np of the Cp candidates, in order, by a bitonic network (pallas_kernels.bitonic:
    sort blocks of np, then halve by best-of-pairs + merges), over three words per candidate
    (score key, lo key, one int32 = padding flag | tie key | candidate index): the exact order of
    XLA's stable sort, the index being the stable sort's last tie-break;
  - the level's survivors merge into the running best np of all levels (descending; one best-of-
    pairs + log2(np) stages): the global pop order without the [np, Jp, np] ranks.
After the loop one merge turns the running best ascending (pop order) and the tree (parents,
visibility) is compared out as in ddtree_build ([Np, Np]).

Exactness: every key is the XLA builder's (ddtree_build's docstring): floats compare as IEEE
(-0.0 == 0.0, as lax.sort), the candidate index and (level, slot) index make the orders total.
Within a level, XLA's order of valid nodes (score, tie) is the global order's (score, rank tuple):
the tie key (parent's lexicographic rank, r) orders as the rank tuple, so merging sorted levels
gives the global sort. A candidate is valid iff its score key is finite (log-probs are clamped at
-1e30 by topk_logprobs, so valid scores are finite).

Letters as ddtree_build: n budget, k top-k, j depths, c candidate pairs, p suffix = padded.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import bitonic
from pallas_kernels import ddtree_build as db

_INT_MAX = np.iinfo(np.int32).max
_PAD_BIT = 30


def key_layout(n: int, k: int, cp: int) -> tuple[int, int]:
  """(index bits, tie bits) of the candidates' packed int32 key pad<<30 | tie<<ib | index: the
  index < Cp, the tie key lexrank * k + r < pow2(n) * k."""
  ib = bitonic.log2(cp)
  tb = max(1, (db.pow2(n) * k - 1).bit_length())
  if ib + tb > _PAD_BIT:
    raise ValueError(f"bitonic selection packs tie and index in 30 bits: n={n}, k={k} need "
                     f"{ib + tb}")
  return ib, tb


def _candidate_before(a, b):
  """Candidates (score key, lo key, packed int) in XLA's level order (the int is unique)."""
  return db._beats(list(a[:2]), list(b[:2]), a[2], b[2])  # pylint: disable=protected-access


def _global_before(m):
  """Survivors (score key, lo key, m rank-tuple keys, level * np + slot, payload...) in XLA's
  global pop order."""
  def before(a, b):
    return db._beats(list(a[:2 + m]), list(b[:2 + m]), a[2 + m], b[2 + m])  # pylint: disable=protected-access
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
  is_ref[1, :] = db._lexrank(tie, ok > 0, slot)  # pylint: disable=protected-access
  for i, key in enumerate(keys):
    is_ref[2 + i, :] = key
  _barrier(interpret)                              # the level is in memory for every thread
  pad = cidx >= c
  c_ok = (is_ref[0, cj] > 0) & ~pad
  c_hi, c_lo = db._dd_add(hl_ref[0, cj], hl_ref[1, cj], lp_ref[d, cr])  # pylint: disable=protected-access
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
  np_ = db.pow2(n)
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
  (zeros for the root and past np), as ddtree_build._outputs gives them."""
  score, _, *rest = acc
  keys, index, token, parent = rest[:m], rest[m], rest[m + 1], rest[m + 2]
  t = jnp.arange(npos, dtype=jnp.int32)
  pos = jnp.arange(np_, dtype=jnp.int32)
  shift = lambda v: db._take(v, t - 1, pos, 0)  # pylint: disable=protected-access
  fields = dict(ok=shift((score < jnp.inf).astype(jnp.int32)), depth=shift(index // np_ + 1),
                token=shift(token), parent=shift(parent), slot=shift(index % np_))
  return t, fields, [shift(key) for key in keys]


def _kernel(lp_ref, ids_ref, cj_ref, cr_ref, tok_ref, dep_ref, par_ref, vis_ref, hl_ref, is_ref,
            *, n, k, j, c, bits, per, m, interpret):
  """ddtree_build._kernel's contract; hl_ref [2, np] f32 and is_ref [2 + m, np] int32 are the
  level scratch (outputs nobody reads)."""
  refs = (lp_ref, ids_ref, cj_ref, cr_ref, hl_ref, is_ref)
  acc = _best_survivors(refs, n=n, k=k, j=j, c=c, bits=bits, per=per, m=m, interpret=interpret)
  t, f, keys = _tree_fields(acc, tok_ref.shape[0], db.pow2(n), m)
  db.write_tree(tok_ref, dep_ref, par_ref, vis_ref, t, f, keys, n=n, bits=bits, per=per)


def build_from_topk(lp_jk, ids_jk, n: int, interpret: bool = False, num_warps: int = 4):
  """tree.build_ddtree's result from topk_logprobs' (log-probs, ids) [J, K], as one kernel."""
  j, k = lp_jk.shape
  cj, cr = db.candidate_pairs(n, k)
  c = len(cj)
  cp, jp, kp, npos, np_ = db.pow2(c), db.pow2(j), db.pow2(k), db.pow2(n + 1), db.pow2(n)
  key_layout(n, k, cp)                              # fails early if the keys do not fit
  bits, per = db.digit_packing(k)
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
