"""The MoE layer's routing glue above one token as ONE Pallas Triton program
(TargetConfig.work_list_kernel; experts.py `_lean_expert_ffn`, T > 1).

From the routing ids [T, K] the lean XLA glue runs three dependent small reduce fusions before
the expert kernels (`_pair_counts`: rank, sizes, ends; `_order_and_item_ends`: order, items per
expert so far; `work.work_list`: the items), ~1.5 us each on the H200 for a few hundred integers
(results/h200/2026-12-05/s11_k26_tree.log, DDTree 15 verify, T = 16). Here one program (grid of
1) computes the same integers with the same compare-and-sum formulas over power-of-two padded
axes and writes every array the expert kernels and the combine read:
  order [M] (the pair at each sorted row), pair_rows [M] (each pair's sorted row, 0 for pairs of
  other experts: the combine's gather rows), sizes [E_l], ends [E_l] (inclusive cumsum), h_rows
  [M] (the row each down input row takes: itself below the live count, else 0), and where R is
  known the work list [4, I] (`work.work_list`'s fields).
Integer math only, so the kernel (Triton on a CUDA GPU, Pallas interpret mode elsewhere:
`jax.lax.platform_dependent`, as route_kernel.py) equals the XLA glue bit for bit.

Letters: T tokens, K choices, M = T*K pairs, E_l local experts [e0, e0 + E_l), R rows per work
item, I items (`work.num_items`); a `p` suffix is the padded (power-of-2) size.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.grouped_matmul import work

# Up to this many pairs the kernel runs (T = 64 at K = 8: its [M, M] rank compare is 256k
# entries in one program); more: the XLA glue.
MAX_PAIRS = 512
# Not yet timed against other warp counts on a GPU.
NUM_WARPS = 4


def supports(t: int, k: int) -> bool:
  """Whether the kernel takes T tokens of K choices (above one token, at most MAX_PAIRS pairs)."""
  return t > 1 and t * k <= MAX_PAIRS


def pair_glue(idx_tk, e_l: int, e0: int, rows: int | None):
  """(order [M], pair_rows [M], sizes [E_l], ends [E_l], h_rows [M], items [4, I] or None where
  rows is None), int32: `_lean_expert_ffn`'s glue values from the routing ids [T, K]."""
  t, k = idx_tk.shape
  if not supports(t, k) or e_l < 1:
    raise ValueError(f"work list kernel: {idx_tk.shape=} {e_l=} (1 < T, T*K <= {MAX_PAIRS})")
  call = functools.partial(_pallas_glue, e_l=e_l, e0=e0, rows=rows)
  outs = jax.lax.platform_dependent(idx_tk.reshape(-1).astype(jnp.int32), cuda=call,
                                    default=functools.partial(call, interpret=True))
  return tuple(outs) + (() if rows is not None else (None,))


def _pallas_glue(idx_m, *, e_l, e0, rows, interpret=False):
  m = idx_m.shape[0]
  out = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=jax.typeof(idx_m).mat)
  shapes = [out((m,), jnp.int32), out((m,), jnp.int32), out((e_l,), jnp.int32),
            out((e_l,), jnp.int32), out((m,), jnp.int32)]
  if rows is not None:
    shapes.append(out((4, work.num_items(m, e_l, rows)), jnp.int32))
  kernel = functools.partial(_glue_kernel, e_l=e_l, e0=e0, rows=rows)
  return pl.pallas_call(
      kernel,
      out_shape=shapes,
      compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
  )(idx_m)


def _glue_kernel(idx_ref, order_ref, pair_rows_ref, sizes_ref, ends_ref, h_rows_ref, *items_ref,
                 e_l, e0, rows):
  """The one program: pairs [Mp] and experts [Ep] padded to powers of 2 (padded pairs sort
  after every real one and are never stored; padded experts hold no rows and no items)."""
  m = idx_ref.shape[0]
  mp, ep = pl.next_power_of_2(m), pl.next_power_of_2(e_l)
  pair = jnp.arange(mp, dtype=jnp.int32)
  real = pair < m
  key, mine = _pair_keys(plt.load(idx_ref.at[pl.ds(0, mp)], mask=real, other=0), real, e_l, e0)
  rank = _count(_code(key, pair, m)[None, :] < _code(key, pair, m)[:, None])
  expert = jnp.arange(ep, dtype=jnp.int32)
  sizes = _count((key[None, :] == expert[:, None]) & (expert < e_l)[:, None])  # padding: none
  ends = _count(key[None, :] <= expert[:, None])
  order = jnp.sum(jnp.where(real[None, :] & (rank[None, :] == pair[:, None]), pair[None, :], 0),
                  axis=1)
  plt.store(order_ref.at[pl.ds(0, mp)], order, mask=real)
  plt.store(pair_rows_ref.at[pl.ds(0, mp)], jnp.where(mine, rank, 0), mask=real)
  live = jnp.sum(mine.astype(jnp.int32))
  plt.store(h_rows_ref.at[pl.ds(0, mp)], jnp.where(pair < live, pair, 0), mask=real)
  plt.store(sizes_ref.at[pl.ds(0, ep)], sizes, mask=expert < e_l)
  plt.store(ends_ref.at[pl.ds(0, ep)], ends, mask=expert < e_l)
  if rows is not None:
    _store_items(items_ref[0], sizes, ends, expert, rows)


def _pair_keys(local_ids, real, e_l, e0):
  """(each pair's local expert, E_l for other experts' pairs, E_l + 1 for padding [Mp]; whether
  it is local [Mp]) as experts._pair_keys, padding after every real pair."""
  local = local_ids - e0
  mine = real & (local >= 0) & (local < e_l)
  return jnp.where(mine, local, jnp.where(real, e_l, e_l + 1)), mine


def _code(key, pair, m):
  """Distinct sort codes (ascending = stable order by key), as experts._pair_counts."""
  return key * m + pair


def _count(mask_2d):
  """Row sums of a [P, Q] mask as int32 [P]."""
  return jnp.sum(mask_2d.astype(jnp.int32), axis=1)


def _store_items(items_ref, sizes, ends, expert, rows):
  """`work.work_list` (with `windows_per_group`'s items per expert and their inclusive sum) over
  the padded experts [Ep] (padding: no rows, no items), written to items_ref [4, I]."""
  n_items = items_ref.shape[1]
  ip = pl.next_power_of_2(n_items)
  starts = ends - sizes
  base = starts - jax.lax.rem(starts, work.ALIGN)  # rows are >= 0: rem is floor's remainder
  chunks = jnp.where(sizes > 0, jax.lax.div(ends - base + (rows - 1), rows), 0)
  upto = jnp.sum(jnp.where(expert[None, :] <= expert[:, None], chunks[None, :], 0), axis=1)
  first = upto - chunks
  item = jnp.arange(ip, dtype=jnp.int32)[:, None]  # [Ip, 1] against [Ep]
  hit = (first[None, :] <= item) & (item < upto[None, :])
  win = base[None, :] + (item - first[None, :]) * rows
  lo = jnp.maximum(starts[None, :], win)
  size = jnp.maximum(jnp.minimum(ends[None, :], win + rows) - lo, 0)
  fields = (jnp.broadcast_to(expert[None, :], hit.shape), win, lo - win, size)
  keep = (jnp.arange(ip, dtype=jnp.int32) < n_items)[None, :]
  for f, field in enumerate(fields):  # row f as a [1, Ip] block (a static row index: no .at)
    plt.store(items_ref.at[pl.ds(f, 1), pl.ds(0, ip)],
              jnp.sum(jnp.where(hit, field, 0), axis=1)[None, :], mask=keep)
