"""The routed-expert FFN over the (token, slot) pairs routed to a range of experts (dropless)."""

import dataclasses

import jax
import jax.numpy as jnp

from kdtree_jax.target.grouped_matmul import expert_mlp, work_rows
from pallas_kernels.grouped_matmul import work

# Up to this many (token, slot) pairs their expert order comes from comparisons ([M, M], a few
# fused reductions on a GPU) instead of a sort kernel (~6 us for any size on an H200).
COMPARE_SORT_MAX_PAIRS = 2048


def expert_ffn(x_td, idx_tk, w_tk, gate_edf, up_edf, down_efd, e0=0, impl="auto", lean=False,
               aligned=False):
  """Experts [e0, e0 + E_l) on the (token, slot) pairs routed to them, dropless -> [T, D] f32.

  Pairs are sorted by expert (pairs for other experts go last and contribute 0), run through
  the gated grouped matmul (gate and up in one call, SiLU-multiply fused) and the down grouped
  matmul on one work list, then each token gathers its K rows, weighted (one fusion, no scatter).
  lean: `_lean_expert_ffn` (TargetConfig.lean_glue), the same values in fewer launches and bytes.
  aligned (with lean, on the kernel at R 8; TargetConfig.align_expert_rows_from): each expert's
  sorted rows start 8-aligned (`aligned_rows`), so no expert's rows straddle a work window.
  """
  if lean and idx_tk.size <= COMPARE_SORT_MAX_PAIRS:
    return _lean_expert_ffn(x_td, idx_tk, w_tk, gate_edf, up_edf, down_efd, e0, impl, aligned)
  order, rank, sizes, ends, mine = sorted_pair_layout(idx_tk, gate_edf.shape[0], e0)
  y = expert_mlp(x_td[order // idx_tk.shape[1]], gate_edf, up_edf, down_efd, sizes, impl,
                 group_ends=ends)
  return combine_pairs(y, rank, mine, w_tk)


def sorted_pair_layout(idx_tk, e_l, e0=0):
  """(token, slot) pairs sorted by local expert (stable), the others last: (order [M]: the pair
  at each sorted row, rank [M]: each pair's sorted row, rows per local expert [E_l], their
  inclusive cumsum [E_l], whether each pair is local [M]), M = T*K.

  Up to COMPARE_SORT_MAX_PAIRS pairs, each pair's rank and every expert's size and end are the
  rows of ONE masked reduction over the pairs ([M + 2 E_l, M]); the order is a second one."""
  key, mine = _pair_keys(idx_tk, e_l, e0)
  if key.shape[0] > COMPARE_SORT_MAX_PAIRS:
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes, ends = jnp.sum(jnp.stack(_per_expert_masks(key, e_l)), axis=2, dtype=jnp.int32)
    return order, jnp.argsort(order).astype(jnp.int32), sizes, ends, mine
  rank, sizes, ends = _pair_counts(key, e_l)
  return jnp.sum(_order_terms(rank), axis=1, dtype=jnp.int32), rank, sizes, ends, mine


def _pair_keys(idx_tk, e_l, e0):
  """(each pair's local expert, E_l for the others [M] int32; whether it is local [M])."""
  local = idx_tk.reshape(-1) - e0
  mine = (local >= 0) & (local < e_l)
  return jnp.where(mine, local, e_l).astype(jnp.int32), mine


def _per_expert_masks(key, e_l):
  """[E_l, M] masks whose row sums are the sizes and the ends (pairs of experts <= e)."""
  expert = jnp.arange(e_l, dtype=jnp.int32)[:, None]
  return [key[None, :] == expert, key[None, :] <= expert]


def _pair_counts(key, e_l):
  """(rank [M]: each pair's sorted row, sizes [E_l], ends [E_l]) as ONE masked reduction."""
  m = key.shape[0]
  code = key * m + jnp.arange(m, dtype=jnp.int32)  # distinct; ascending = stable order by key
  counts = jnp.sum(jnp.concatenate([code[None, :] < code[:, None]] + _per_expert_masks(key, e_l)),
                   axis=1, dtype=jnp.int32)
  return counts[:m], counts[m:m + e_l], counts[m + e_l:]


def _order_terms(rank, m_rows=None):
  """[rows, M]: row r holds pair p where rank[p] == r (its sum: the pair at sorted row r; 0
  where no pair sits, e.g. the gaps of the aligned layout); rows = m_rows, default M."""
  pair = jnp.arange(rank.shape[0], dtype=jnp.int32)
  row = jnp.arange(rank.shape[0] if m_rows is None else m_rows, dtype=jnp.int32)
  return jnp.where(rank[None, :] == row[:, None], pair[None, :], 0)


def aligned_row_bound(m: int, e_l: int) -> int:
  """Rows of the 8-aligned layout of m pairs over e_l experts (static): each live expert adds at
  most ALIGN - 1 rows of gap."""
  return m + (work.ALIGN - 1) * min(e_l, m)


def aligned_rows(key, rank, sizes, ends):
  """The sorted layout with gaps: expert e's rows start at ALIGN x the ALIGN-row windows of the
  experts before it, so an expert of n rows spans ceil(n / ALIGN) whole windows (at R = ALIGN one
  work item each; packed, an expert that straddles a boundary costs one more, i.e. one more
  dequantise of its weights). -> (each pair's row [M]: past every row for non-local pairs,
  each expert's inclusive end [E_l]); one [E_l, E_l] reduction (the windows' cumsum)."""
  e_l = sizes.shape[0]
  windows = -(-sizes // work.ALIGN)
  ids = jnp.arange(e_l, dtype=jnp.int32)
  starts = work.ALIGN * jnp.sum(jnp.where(ids[None, :] < ids[:, None], windows[None, :], 0),
                                axis=1, dtype=jnp.int32)
  shift = starts - (ends - sizes)
  local = key < e_l
  bound = aligned_row_bound(rank.shape[0], e_l)
  return jnp.where(local, rank + shift[jnp.minimum(key, e_l - 1)], bound), starts + sizes


def _lean_expert_ffn(x_td, idx_tk, w_tk, gate_edf, up_edf, down_efd, e0, impl, aligned=False):
  """`expert_ffn` (same kernels, same values) with less glue around the two kernel calls:
  - the pairs' order and the work list's items-per-expert cumsum are ONE masked reduction
    (`_order_and_item_ends`: 3 dependent index reductions before the kernels, not 4);
  - the pass that sums the gated call's K-split partials reads the live rows only (rows past
    the live count take row 0: the down call computes them but stores none);
  - the combine's gathers of non-local pairs read row 0 (masked to 0 as before), so it reads
    ~the live rows of the down partials instead of all T*K rows of each split.
  The three index reductions (pair counts, order + item ends, work list) as ONE single-program
  Triton launch was built twice and measured slower both times (notes/moe.md "Tried again")."""
  t, k = idx_tk.shape
  m, e_l = t * k, gate_edf.shape[0]
  key, mine = _pair_keys(idx_tk, e_l, e0)
  rank, sizes, ends = _pair_counts(key, e_l)
  x_rows = jax.ShapeDtypeStruct((m, x_td.shape[1]), x_td.dtype)
  rows = work_rows(x_rows, gate_edf, up_edf, down_efd, sizes, impl)
  m_rows, n_items = m, None
  if aligned and rows == work.ALIGN:  # R 8 windows on the kernel (XLA's groups are contiguous)
    rank, ends = aligned_rows(key, rank, sizes, ends)
    m_rows, n_items = aligned_row_bound(m, e_l), work.num_items_aligned(m, e_l, rows)
  order, upto = _order_and_item_ends(rank, sizes, ends, rows, m_rows)
  items = None if rows is None else work.work_list(sizes, m_rows, rows, ends, items_upto=upto,
                                                   max_items=n_items)
  row = jnp.arange(m_rows, dtype=jnp.int32)
  y = expert_mlp(x_td[order // k], gate_edf, up_edf, down_efd, sizes, impl, group_ends=ends,
                 items=None if items is None else lambda r: _same_rows(items, r, rows),
                 h_rows=jnp.where(row < ends[-1], row, 0), pairs=m)
  return combine_pairs(y, jnp.where(mine, rank, 0), mine, w_tk)


def _same_rows(items, r, rows):
  if r != rows:
    raise ValueError(f"the work list was built for R={rows}, the call plans R={r}")
  return items


def _order_and_item_ends(rank, sizes, ends, rows, m_rows=None):
  """(the pair at each sorted row [m_rows, default M], the inclusive cumsum of the work items per
  expert [E_l] for R = rows, or None where rows is None) as ONE masked reduction: the order's
  [m_rows, M] terms and the cumsum's [E_l, E_l] ones side by side over a common axis
  (zero-padded)."""
  order_terms = _order_terms(rank, m_rows)
  if rows is None:
    return jnp.sum(order_terms, axis=1, dtype=jnp.int32), None
  (r, m), e_l = order_terms.shape, sizes.shape[0]
  n = max(m, e_l)
  chunks = jnp.pad(work.windows_per_group(sizes, ends, rows), (0, n - e_l))
  col = jnp.arange(n, dtype=jnp.int32)
  upto_terms = jnp.where(col[None, :] <= jnp.arange(e_l, dtype=jnp.int32)[:, None],
                         chunks[None, :], 0)
  counts = jnp.sum(jnp.concatenate([jnp.pad(order_terms, ((0, 0), (0, n - m))), upto_terms]),
                   axis=1, dtype=jnp.int32)
  return counts[:r], counts[r:]


def combine_pairs(y_smd, rank, mine, w_tk):
  """Sorted pair outputs as K-partials [S, T*K, D] -> [T, D] f32: per token, the sum over its K
  local pairs (and the S partials) of weight x row. Non-local pairs' rows are undefined: masked.

  Written as S*K element-wise terms, each a gather of T rows (one loop fusion that reads every
  row once): a reduction over the gathered [S, T, K, D] axes (0, 2) made XLA:GPU materialise
  them transposed in f32 ([T, D, S, K], 14.7 MB per layer at T=16) before reducing."""
  t, k = w_tk.shape
  rows = rank.reshape(t, k)
  return weighted_row_sum(lambda s, j: y_smd[s, rows[:, j]], y_smd.shape[0], mine.reshape(t, k),
                          w_tk)


def weighted_row_sum(row, splits: int, keep_tk, w_tk):
  """sum over s < splits and j < k of where(keep[:, j], w[:, j] x row(s, j), 0) -> [T, D] f32,
  as element-wise adds; row(s, j) [T, D] is split s of the rows of each token's j-th pair."""
  w = w_tk.astype(jnp.float32)
  total = None
  for j in range(w_tk.shape[1]):
    for s in range(splits):
      term = jnp.where(keep_tk[:, j, None], row(s, j).astype(jnp.float32) * w[:, j, None], 0.0)
      total = term if total is None else total + term
  return total


# The dense glue compares every local (token, expert) slot with every other: up to this many.
DENSE_GLUE_MAX_COMPARES = 1 << 24


def dense_glue_fits(t: int, e_l: int) -> bool:
  return (t * e_l) ** 2 <= DENSE_GLUE_MAX_COMPARES


@dataclasses.dataclass(frozen=True)
class Weighting:
  """How a token's routing weights come from its chosen experts' scores: k experts chosen
  (rank < k), normalised to sum 1 over them if `norm`, times `scale` (DeepSeek-V3 / K2)."""
  k: int
  norm: bool
  scale: float

  def dense(self, rank_te, scores_te):
    """[T, E] weights, 0 where not chosen."""
    w = jnp.where(rank_te < self.k, scores_te, 0.0)
    if self.norm:
      w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * self.scale

  def of_choices(self, scores_j):
    """Weights of k choices from their scores [..., k], the sum as k - 1 element-wise adds
    (fused into the consumer, no reduction launch)."""
    if not self.norm:
      return scores_j * self.scale
    total = scores_j[..., 0:1]
    for j in range(1, self.k):
      total = total + scores_j[..., j:j + 1]
    return scores_j / (total + 1e-20) * self.scale


def expert_ffn_dense(x_td, rank_te, scores_te, gate_edf, up_edf, down_efd, weighting: Weighting,
                     impl="auto", lean=False):
  """`expert_ffn` from a dense routing: rank_te [T, E] int32, each expert's place in token t's
  choice (chosen: rank < k; `moe.compare_rank`), scores_te [T, E] f32 the router's scores, whose
  chosen ones `weighting` turns into the routing weights; experts [0, E_l) are held here.

  Rows are the selected local slots in (expert, token) order, M = T*k (dropless bound). Each
  level is one masked reduction over the T x E_l local slots, all from the selection mask:
  1. each slot's sorted row, its rank among its token's local slots, rows per expert so far;
  2. each row's token, each (token, j < k) pair's row and weight; the work list;
  then the x gather, the two kernel calls and a gather-combine over k as in `expert_ffn`.
  One token (T = 1) has its own shorter path (`_one_token_ffn`; no lean form: the H200 measured
  the live-rows pass 1 us slower there, results/h200/2026-12-01/s6_moe_layer.log).
  lean (T > 1): the pass over the gated call's split partials reads the live rows only.
  """
  t = x_td.shape[0]
  e_l = gate_edf.shape[0]
  k = weighting.k
  if t == 1:
    return _one_token_ffn(x_td, rank_te[0], scores_te[0], gate_edf, up_edf, down_efd, weighting,
                          impl)
  sel = rank_te[:, :e_l] < k
  w_te = weighting.dense(rank_te, scores_te)
  pos, nth, ends = _slot_rows(sel)
  tok_row, _, pos_tk, w_tk, ok_tk = _row_lookup(sel, w_te[:, :e_l], pos, nth, t * k, k)
  sizes = ends - jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
  live = jnp.any(sel, axis=0)

  def items(rows):
    if rows >= t + work.ALIGN - 1:
      return one_window_work_list(live, sizes, ends, min(e_l, t * k))
    return work.work_list(sizes, t * k, rows, ends)

  row = jnp.arange(t * k, dtype=jnp.int32)
  y = expert_mlp(x_td[tok_row], gate_edf, up_edf, down_efd, sizes, impl, group_ends=ends,
                 items=items, h_rows=jnp.where(row < ends[-1], row, 0) if lean else None)
  return combine_pairs(y, pos_tk.reshape(-1), ok_tk.reshape(-1), w_tk)  # pos: 0 where no pair


def _one_token_ffn(x_1d, rank_e, scores_e, gate_edf, up_edf, down_efd, weighting, impl):
  """One token from its dense routing: the work list is one reduction over the experts of the
  choice rank and also names every choice's expert, so the weights are element-wise (no
  normalising reduction); then `one_token_ffn`."""
  items = one_token_work_list(rank_e, weighting.k, gate_edf.shape[0])
  w_j = weighting.of_choices(scores_e[items[0]])  # dead rows are undefined: masked in the combine
  return one_token_ffn(x_1d, items, w_j, gate_edf, up_edf, down_efd, impl,
                       sizes=(rank_e[:gate_edf.shape[0]] < weighting.k).astype(jnp.int32))


def one_token_ffn(x_1d, items, w_j, gate_edf, up_edf, down_efd, impl, sizes=None):
  """One token from its work list [4, k] (`one_token_work_list`'s rows, or the routing kernel's,
  `route_kernel.route_one_token`) and its k weights: row j is its j-th choice (rows in choice
  order, not expert order: each row is its own work item, so the kernel needs no order; the XLA
  path sorts them); the rows are x broadcast; the combine sums row j x its weight over the local
  choices (element-wise terms, as `combine_pairs`, not a reduction over [S, k, D]).
  x_1d: [1, D], or its k rows already broadcast [k, D] (moe._one_token_moe).
  sizes: rows per local expert, counted from the items if None (the XLA path's; the kernel
  reads the items only)."""
  k, e_l = items.shape[1], gate_edf.shape[0]
  live = items[3] > 0
  if sizes is None:
    sizes = jnp.sum(live[None, :] & (items[0][None, :] == jnp.arange(e_l)[:, None]), axis=1,
                    dtype=jnp.int32)
  rows = jnp.broadcast_to(x_1d, (k, x_1d.shape[1]))
  y = expert_mlp(rows, gate_edf, up_edf, down_efd, sizes, impl, items=lambda r: items,  # [S, k, D]
                 row_groups=jnp.where(live, items[0], e_l))
  return weighted_row_sum(lambda s, j: y[s, j][None], y.shape[0], live[None], w_j[None])


def one_token_work_list(rank_e, m: int, e_l: int):
  """One token's work list over its m choices, int32 [4, m]: row j alone in its window, i.e.
  (expert of choice j (any of the E), j - j % 8, j % 8, 1 if that expert is local (< e_l)
  else 0), as one reduction over the experts with no stack after it. The kernel skips the
  non-local rows (size 0) and never reads their expert; R >= 8 for any tuning, so the list does
  not depend on R."""
  ids = jnp.arange(rank_e.shape[0], dtype=jnp.int32)[None, :]
  item = jnp.arange(m, dtype=jnp.int32)[:, None]
  hit = rank_e[None, :] == item  # [m, E]
  first = ids == 0
  terms = jnp.stack([jnp.where(hit, ids, 0),
                     jnp.where(first, item - item % work.ALIGN, 0),
                     jnp.where(first, item % work.ALIGN, 0),
                     (hit & (ids < e_l)).astype(jnp.int32)])
  return jnp.sum(terms, axis=2, dtype=jnp.int32)


def one_window_work_list(live_e, sizes_e, ends_e, n_items: int):
  """The work list when every expert's rows fit one window (R >= T + 7: <= T rows starting <= 7
  past an 8-aligned row): item i = the i-th live expert (expert, its 8-aligned first row, its
  offset there, its rows), by a count of the live experts before each, then one reduction over
  the experts (no search, no gather, no stack after it). int32 [4, n_items]."""
  ids = jnp.arange(live_e.shape[0], dtype=jnp.int32)
  before = jnp.sum(live_e[None, :] & (ids[None, :] < ids[:, None]), axis=1, dtype=jnp.int32)
  starts = ends_e - sizes_e
  base = starts - starts % work.ALIGN
  item = jnp.arange(n_items, dtype=jnp.int32)[:, None]
  hit = live_e[None, :] & (before[None, :] == item)  # [I, E_l]
  terms = jnp.stack([jnp.where(hit, v[None, :], 0) for v in (ids, base, starts - base, sizes_e)])
  return jnp.sum(terms, axis=2, dtype=jnp.int32)


def _slot_rows(sel_te):
  """From the selection [T, E_l]: (each slot's row in (expert, token) order [T, E_l], its rank
  among its token's selected slots [T, E_l], rows of experts <= e [E_l]); int32."""
  t, e_l = sel_te.shape
  tok = jnp.arange(t, dtype=jnp.int32)[:, None]
  exp = jnp.arange(e_l, dtype=jnp.int32)[None, :]
  code = (exp * t + tok).reshape(-1)  # a slot's place in (expert, token) order
  flat = sel_te.reshape(-1)
  pos = jnp.sum(flat[None, :] & (code[None, :] < code[:, None]), axis=1, dtype=jnp.int32)
  nth = jnp.sum(sel_te[:, None, :] & (exp[:, :, None] < exp[:, None, :]), axis=2,
                dtype=jnp.int32)
  ends = jnp.sum(flat[None, :] & ((code // t)[None, :] <= jnp.arange(e_l)[:, None]), axis=1,
                 dtype=jnp.int32)
  return pos.reshape(t, e_l), nth, ends


def _row_lookup(sel_te, w_te, pos_te, nth_te, m: int, k: int):
  """(token [M] and expert [M] of each sorted row (0 past the live rows), and per (token, j < k):
  the row of its j-th local slot, its weight, whether it exists [T, k]). One term per sum."""
  t, e_l = sel_te.shape
  tok = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, e_l)).reshape(-1)
  exp = jnp.broadcast_to(jnp.arange(e_l, dtype=jnp.int32)[None, :], (t, e_l)).reshape(-1)
  at_row = sel_te.reshape(1, -1) & (pos_te.reshape(1, -1) == jnp.arange(m)[:, None])  # [M, T*E_l]
  tok_row = jnp.sum(jnp.where(at_row, tok, 0), axis=1, dtype=jnp.int32)
  exp_row = jnp.sum(jnp.where(at_row, exp, 0), axis=1, dtype=jnp.int32)
  is_nth = sel_te[:, None, :] & (nth_te[:, None, :] == jnp.arange(k)[None, :, None])  # [T, k, E_l]
  pos_tk = jnp.sum(jnp.where(is_nth, pos_te[:, None, :], 0), axis=2, dtype=jnp.int32)
  w_tk = jnp.sum(jnp.where(is_nth, w_te[:, None, :], 0), axis=2)
  return tok_row, exp_row, pos_tk, w_tk, jnp.any(is_nth, axis=2)
