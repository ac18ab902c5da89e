"""The MoE routing after the router logits as ONE Pallas kernel launch (TargetConfig.router_impl
"pallas"): sigmoid, bias, top-k and the weights, for n_group == 1 and up to MAX_TOKENS tokens.

Letters: T tokens, E routed experts (EP: E rounded up to a power of 2, Triton's block sizes),
K experts per token.

The XLA path (`moe.route`) is 4-5 fused reductions per layer (H200, CUPTI, 60 MoE layers per
step: ~644 us at T=16, ~306 us at T=1; WORKSPACE.md, sixth session). Here one program per token
loads its E logits once (padded lanes masked to -inf), and picks its K experts by K argmax
reductions (each one a joint (value, index) reduction: ties go to the lower index, as
`jax.lax.top_k`), each pick masked out before the next; the chosen experts' scores are then
re-read from the logits (a K-wide gather: the exact sigmoid of the same logit, not choice -
bias) and weighted as `experts.Weighting.of_choices`. On a CUDA GPU it lowers through Triton,
elsewhere it runs in Pallas interpret mode (`jax.lax.platform_dependent`: one config value).

Two output forms: (ids [T, K] int32, weights [T, K] f32) as `moe.route`; for one token also the
one-token work list [4, K] int32 (`experts.one_token_work_list`'s rows: expert, 8-aligned row,
offset, 1 if the expert is held here), so `_one_token_ffn` needs no XLA glue between this launch
and the expert kernels. Above one token (TargetConfig.route_work_list), a second launch of one
program (`pair_layout`) turns the ids into the lean glue's pair order, ranks, sizes, ends and
work list (`experts.lean_pair_layout`'s values), in place of 3 dependent XLA index reductions.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.grouped_matmul import work

# Up to this many tokens the kernel runs (one program each); more: the XLA path.
MAX_TOKENS = 64
# One warp per token: each of the K argmax reductions is warp shuffles only (no shared memory
# barrier), E = 384 is 16 lanes per thread. Not yet timed against 2 or 4 warps on a GPU.
NUM_WARPS = 1


def supports(t: int, n_group: int) -> bool:
  """Whether the kernel takes T tokens of this routing (no group limit, small T)."""
  return n_group == 1 and 1 <= t <= MAX_TOKENS


def route_pallas(logits_te, bias_e, k: int, norm: bool, scale: float):
  """(ids [T, K] int32 in lax.top_k order of sigmoid(logits) + bias, ties to the lower index;
  weights [T, K] f32: the chosen sigmoid scores, normalised to sum 1 if `norm`, times scale).
  logits_te: [T, E] or wider: the kernel reads the first E = len(bias) columns (the packed
  router|shared dot's output, `moe.router_and_shared(wide=True)`: no slice made for the kernel)."""
  ids, w = _call(logits_te, bias_e, k, norm, scale, None)
  return ids, w


def route_one_token(logits_1e, bias_e, k: int, norm: bool, scale: float, e_local: int):
  """One token: (its work list [4, K] int32 as `experts.one_token_work_list`: row 0 the ids in
  top-k order, rows 1-2 each choice's 8-aligned row and offset, row 3 whether its expert is
  < e_local; weights [K] f32 as `route_pallas`). logits_1e: [1, E] or wider, as `route_pallas`."""
  if logits_1e.shape[0] != 1:
    raise ValueError(f"route_one_token takes one token: {logits_1e.shape=}")
  items, w = _call(logits_1e, bias_e, k, norm, scale, e_local)
  return items, w[0]


def _call(logits_te, bias_e, k, norm, scale, e_local):
  t, width = logits_te.shape
  e = bias_e.shape[0]
  if not 1 <= t <= MAX_TOKENS or bias_e.shape != (e,) or not 1 <= k <= e <= width:
    raise ValueError(f"route kernel: {logits_te.shape=} {bias_e.shape=} {k=} "
                     f"(T <= {MAX_TOKENS}, K <= E <= the logits' columns)")
  call = functools.partial(_pallas_route, k=k, norm=norm, scale=float(scale), e_local=e_local)
  logits = logits_te.astype(jnp.float32)
  return jax.lax.platform_dependent(logits, bias_e, cuda=call,
                                    default=functools.partial(call, interpret=True))


def _pallas_route(logits_te, bias_e, *, k, norm, scale, e_local, interpret=False):
  t = logits_te.shape[0]
  kp = pl.next_power_of_2(k)
  # The outputs vary over a shard_map's axes as the logits do (its varying-axes check).
  out = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=jax.typeof(logits_te).mat)
  first = out((4, kp), jnp.int32) if e_local is not None else out((t, kp), jnp.int32)
  kernel = functools.partial(_route_kernel, k=k, norm=norm, scale=scale, e_local=e_local)
  ids, w = pl.pallas_call(
      kernel,
      grid=(t,),
      out_shape=[first, out((t, kp), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
  )(logits_te, bias_e)
  return ids[:, :k], w[:, :k]


def _route_kernel(logits_ref, bias_ref, first_ref, w_ref, *, k, norm, scale, e_local):
  """Program `row`: its logits [E] (the first E = len(bias) columns of its row) -> its K choices
  (ids or the one-token work list) and weights (K padded to a power of 2; the padded slots hold
  choice K's copies, cut by the caller)."""
  row = pl.program_id(0)
  e = bias_ref.shape[0]
  ep, kp = pl.next_power_of_2(e), pl.next_power_of_2(k)
  lane = jnp.arange(ep, dtype=jnp.int32)
  live = lane < e
  logits = plt.load(logits_ref.at[row, pl.ds(0, ep)], mask=live, other=0.0)
  bias = plt.load(bias_ref.at[pl.ds(0, ep)], mask=live, other=0.0).astype(jnp.float32)
  choice = jnp.where(live, _sigmoid(logits) + bias, -jnp.inf)
  slot = jnp.arange(kp, dtype=jnp.int32)
  ids = jnp.zeros((kp,), jnp.int32)
  for j in range(k):
    best = jnp.argmax(choice).astype(jnp.int32)  # the largest; ties: the lower index
    ids = jnp.where(slot >= j, best, ids)
    choice = jnp.where(lane == best, -jnp.inf, choice)
  scores = _sigmoid(plt.load(logits_ref.at[row, ids]))  # the chosen logits, re-read
  w_ref[row, :] = _weights(scores, slot < k, norm, scale)
  if e_local is None:
    first_ref[row, :] = ids
  else:  # one token: its work list, as experts.one_token_work_list
    first_ref[0, :] = ids
    first_ref[1, :] = slot - slot % work.ALIGN
    first_ref[2, :] = slot % work.ALIGN
    first_ref[3, :] = (ids < e_local).astype(jnp.int32)


def _sigmoid(x):
  """HF's torch.sigmoid in f32, spelt out so interpret mode and Triton compute the same form."""
  return 1.0 / (1.0 + jnp.exp(-x))


def _weights(scores_k, real_k, norm, scale):
  """`experts.Weighting.of_choices` over the real slots of scores [KP]."""
  if not norm:
    return scores_k * scale
  total = jnp.sum(jnp.where(real_k, scores_k, 0.0))
  return scores_k / (total + 1e-20) * scale


# The pair layout kernel compares the pairs in chunks of this many (its [M, CHUNK] terms stay in
# registers at M = 64 tokens x 8).
LAYOUT_CHUNK = 32
LAYOUT_WARPS = 4


def pair_layout(ids_tk, e_l: int, rows: int | None):
  """The lean expert glue's index arrays from the routing's ids (`experts.lean_pair_layout`'s
  values, bitwise) as ONE Triton launch after the routing kernel: (order [M]: the pair at each
  row sorted by local expert (stable, the others last), rank [M]: each pair's sorted row, sizes
  [E_l], ends [E_l] (their inclusive cumsum), the work list [4, I] int32 for R = rows as
  `work.work_list(..., items_upto=...)`, or None where rows is None), M = T*K, experts
  [0, e_l) held here. One program: each chunk of pairs is compared with all M pairs (its ranks,
  their contribution to the order, sizes and ends), then the work list over the experts."""
  t, k = ids_tk.shape
  m = t * k
  if not 1 <= t <= MAX_TOKENS or e_l < 1:
    raise ValueError(f"pair_layout: {ids_tk.shape=} {e_l=}")
  call = functools.partial(_pallas_layout, e_l=e_l, rows=rows)
  ids = ids_tk.reshape(m)
  out = jax.lax.platform_dependent(ids, cuda=call, default=functools.partial(call, interpret=True))
  return (*out, None) if rows is None else tuple(out)


def _pallas_layout(ids_m, *, e_l, rows, interpret=False):
  m = ids_m.shape[0]
  out = functools.partial(jax.ShapeDtypeStruct, manual_axis_type=jax.typeof(ids_m).mat)
  shapes = [out((m,), jnp.int32), out((m,), jnp.int32), out((e_l,), jnp.int32),
            out((e_l,), jnp.int32)]
  if rows is not None:
    shapes.append(out((4, work.num_items(m, e_l, rows)), jnp.int32))
  return pl.pallas_call(
      functools.partial(_layout_kernel, e_l=e_l, rows=rows),
      grid=(1,),
      out_shape=shapes,
      compiler_params=plt.CompilerParams(num_warps=LAYOUT_WARPS, num_stages=1),
      interpret=interpret,
  )(ids_m)


def _pair_keys(ids_ref, start, size, m, e_l):
  """Pairs [start, start + size): (their index, key: local expert, e_l for the others, e_l + 1
  past M (sorted last, counted nowhere))."""
  pair = start + jnp.arange(size, dtype=jnp.int32)
  real = pair < m
  ids = plt.load(ids_ref.at[pl.ds(start, size)], mask=real, other=0)
  local = (ids >= 0) & (ids < e_l)
  return pair, jnp.where(real, jnp.where(local, ids, e_l), e_l + 1)


def _layout_kernel(ids_ref, order_ref, rank_ref, sizes_ref, ends_ref, *items_ref, e_l, rows):
  m = ids_ref.shape[0]
  mp, gp = pl.next_power_of_2(m), pl.next_power_of_2(e_l)
  chunk = min(LAYOUT_CHUNK, mp)
  pair, key = _pair_keys(ids_ref, 0, mp, m, e_l)
  code = key * mp + pair  # distinct; ascending = stable order by key
  group = jnp.arange(gp, dtype=jnp.int32)

  def one_chunk(c, acc):
    order, sizes, ends = acc
    start = pl.multiple_of(c * chunk, chunk)
    pair_c, key_c = _pair_keys(ids_ref, start, chunk, m, e_l)
    code_c = key_c * mp + pair_c
    rank_c = jnp.sum((code[None, :] < code_c[:, None]).astype(jnp.int32), axis=1)
    plt.store(rank_ref.at[pl.ds(start, chunk)], rank_c, mask=pair_c < m)
    at = (rank_c[None, :] == pair[:, None]) & (pair_c < m)[None, :]  # [M, chunk]
    order += jnp.sum(jnp.where(at, pair_c[None, :], 0), axis=1)
    sizes += jnp.sum((key_c[None, :] == group[:, None]).astype(jnp.int32), axis=1)
    ends += jnp.sum((key_c[None, :] <= group[:, None]).astype(jnp.int32), axis=1)
    return order, sizes, ends

  zeros = lambda n: jnp.zeros((n,), jnp.int32)
  order, sizes, ends = jax.lax.fori_loop(0, mp // chunk, one_chunk, (zeros(mp), zeros(gp),
                                                                        zeros(gp)))
  real_g = group < e_l
  sizes, ends = jnp.where(real_g, sizes, 0), jnp.where(real_g, ends, 0)
  plt.store(order_ref.at[pl.ds(0, mp)], order, mask=pair < m)
  plt.store(sizes_ref.at[pl.ds(0, gp)], sizes, mask=real_g)
  plt.store(ends_ref.at[pl.ds(0, gp)], ends, mask=real_g)
  if rows is not None:
    _store_work_list(items_ref[0], sizes, ends, group, rows)


def _store_work_list(items_ref, sizes, ends, group, rows):
  """`work.work_list(sizes, M, rows, ends, items_upto)` over padded experts (size 0: no item)."""
  n_items = items_ref.shape[1]
  starts = ends - sizes
  base = starts - starts % work.ALIGN
  chunks = jnp.where(sizes > 0, (ends - base + rows - 1) // rows, 0)  # ends - base >= 0
  upto = jnp.sum(jnp.where(group[None, :] <= group[:, None], chunks[None, :], 0), axis=1)
  first = upto - chunks
  item = jnp.arange(pl.next_power_of_2(n_items), dtype=jnp.int32)
  it = item[:, None]
  hit = (first[None, :] <= it) & (it < upto[None, :])  # [I, G]: at most one expert per item
  win = base[None, :] + (it - first[None, :]) * rows
  lo = jnp.maximum(starts[None, :], win)
  size = jnp.maximum(jnp.minimum(ends[None, :], win + rows) - lo, 0)
  live = item < n_items
  for f, field in enumerate((jnp.broadcast_to(group[None, :], hit.shape), win, lo - win, size)):
    plt.store(items_ref.at[jnp.int32(f), pl.ds(0, item.shape[0])],
              jnp.sum(jnp.where(hit, field, 0), axis=1), mask=live)
