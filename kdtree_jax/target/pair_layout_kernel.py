"""The sorted pair layout of a MoE layer's routed (token, slot) pairs and the expert calls' work
list as ONE Pallas kernel launch (TargetConfig.pair_layout_impl "pallas"), for up to MAX_PAIRS
pairs (a DDTree 15 verify: 16 tokens x 8 = 128).

Letters: M pairs (T tokens x K slots), E_l local experts, I work items, R rows per item; Mp,
Ep, Ip: M, E_l, I rounded up to powers of 2 (Triton's block sizes).

The XLA glue it replaces (`experts._lean_expert_ffn`: `_pair_counts`, `_order_and_item_ends`,
`work.work_list`) is three dependent masked reductions, three launches of ~2 us each with almost
no bytes (H100, 32-layer DDTree 15 step: 2.2 + 1.6 + 2.1 us a MoE layer; WORKSPACE
"Twenty-ninth session"). Here one program computes the same integers in registers: each pair's
sorted row (its rank among the keys local expert x Mp + pair, non-local pairs last), the rows
and inclusive row ends per local expert, the pair at each sorted row, the R-row windows per
expert and their inclusive sum, and the four fields of every work item (`work.work_list`'s
definition). On a CUDA GPU it lowers through Triton, elsewhere it runs in Pallas interpret mode.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.grouped_matmul import work

# Up to this many pairs the kernel runs; more: the XLA glue. Its [Mp, Mp] comparisons live in
# registers: 128 x 128 int32 is 128 registers a thread at NUM_WARPS = 4.
MAX_PAIRS = 128
NUM_WARPS = 4


def supports(m: int) -> bool:
  """Whether the kernel takes M pairs."""
  return 1 <= m <= MAX_PAIRS


def pair_layout(idx_tk, e_l: int, e0, rows: int, n_items: int):
  """(rank [M]: each pair's sorted row, sizes [E_l], ends [E_l]: their inclusive cumsum, order
  [M]: the pair at each sorted row, items [4, n_items]: `work.work_list(sizes, M, rows, ends)`)
  int32, for idx_tk [T, K] global expert ids and the local experts [e0, e0 + E_l); pairs of
  other experts sort last, in pair order (as `experts.sorted_pair_layout`)."""
  t, k = idx_tk.shape
  m = t * k
  if not supports(m) or e_l < 1 or rows < work.ALIGN or n_items < 1:
    raise ValueError(f"pair layout kernel: {idx_tk.shape=} {e_l=} {rows=} {n_items=} "
                     f"(M <= {MAX_PAIRS}, R >= {work.ALIGN})")
  call = functools.partial(_pallas_layout, e_l=e_l, rows=rows, n_items=n_items)
  idx = idx_tk.reshape(m).astype(jnp.int32)
  e0 = jnp.broadcast_to(jnp.asarray(e0, jnp.int32), (1,))
  return jax.lax.platform_dependent(idx, e0, cuda=call,
                                    default=functools.partial(call, interpret=True))


def _pallas_layout(idx_m, e0, *, e_l, rows, n_items, interpret=False):
  m = idx_m.shape[0]
  # The outputs vary over a shard_map's axes as the ids do (its varying-axes check).
  out = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=jax.typeof(idx_m).mat)
  shapes = [out((m,), jnp.int32), out((e_l,), jnp.int32), out((e_l,), jnp.int32),
            out((m,), jnp.int32), out((4, n_items), jnp.int32)]
  kernel = functools.partial(_layout_kernel, e_l=e_l, rows=rows, n_items=n_items)
  return tuple(pl.pallas_call(
      kernel,
      grid=(1,),
      out_shape=shapes,
      compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
  )(idx_m, e0))


def _layout_kernel(idx_ref, e0_ref, rank_ref, sizes_ref, ends_ref, order_ref, items_ref, *,
                   e_l, rows, n_items):
  """One program: the M pairs' ids -> the five outputs (padded lanes masked on load and store)."""
  m = idx_ref.shape[0]
  mp, ep, ip = (pl.next_power_of_2(v) for v in (m, e_l, n_items))
  pair = jnp.arange(mp, dtype=jnp.int32)
  live = pair < m
  local = plt.load(idx_ref.at[pl.ds(0, mp)], mask=live, other=0) - e0_ref[0]
  key = jnp.where(live & (local >= 0) & (local < e_l), local, e_l)
  # Distinct codes: ascending = stable order by key; padded lanes (key E_l, pair >= M) sort last.
  code = key * mp + pair
  rank = jnp.sum((code[None, :] < code[:, None]).astype(jnp.int32), axis=1)
  expert = jnp.arange(ep, dtype=jnp.int32)
  counted = live[None, :] & (expert[:, None] < e_l)
  sizes = jnp.sum((counted & (key[None, :] == expert[:, None])).astype(jnp.int32), axis=1)
  ends = jnp.sum((counted & (key[None, :] <= expert[:, None])).astype(jnp.int32), axis=1)
  order = jnp.sum(jnp.where(rank[None, :] == pair[:, None], pair[None, :], 0), axis=1)
  plt.store(rank_ref.at[pl.ds(0, mp)], rank, mask=live)
  plt.store(order_ref.at[pl.ds(0, mp)], order, mask=live)
  plt.store(sizes_ref.at[pl.ds(0, ep)], sizes, mask=expert < e_l)
  plt.store(ends_ref.at[pl.ds(0, ep)], ends, mask=expert < e_l)
  _store_items(items_ref, sizes, ends, expert, rows, ip, n_items)


def _store_items(items_ref, sizes, ends, expert, rows, ip, n_items):
  """`work.work_list`'s four fields per item: the expert's R-row windows from its first row
  rounded down to ALIGN, their inclusive sum over the experts, then each item's expert."""
  starts = ends - sizes
  base = starts - starts % work.ALIGN
  chunks = jnp.where(sizes > 0, (ends - base + rows - 1) // rows, 0)
  upto = jnp.sum(jnp.where(expert[None, :] <= expert[:, None], chunks[None, :], 0), axis=1)
  first = upto - chunks
  item = jnp.arange(ip, dtype=jnp.int32)[:, None]  # [Ip, 1] against [Ep]
  hit = (first[None, :] <= item) & (item < upto[None, :])
  win = base[None, :] + (item - first[None, :]) * rows
  lo = jnp.maximum(starts[None, :], win)
  size = jnp.maximum(jnp.minimum(ends[None, :], win + rows) - lo, 0)
  fields = (jnp.broadcast_to(expert[None, :], hit.shape), win, lo - win, size)
  live = jnp.arange(ip, dtype=jnp.int32) < n_items
  for f, value in enumerate(fields):
    plt.store(items_ref.at[pl.ds(f, 1), pl.ds(0, ip)],
              jnp.sum(jnp.where(hit, value, 0), axis=1)[None, :], mask=live[None, :])
