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
and the expert kernels.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.grouped_matmul import work

# Up to this many tokens the kernel runs (one program each); more: the XLA path. 128 covers every
# decode verify; the kernel's work per program does not depend on T. At 65 tokens (a DDTree
# budget-64 verify; the cap was 64) one K2.6-share MoE layer took 427.4 us with the kernel vs
# 443.2 with XLA's routing (its T x E x E compare reduction alone 13.2 us), H100, one process:
# results/h100/2026-12-06/s20_route65.log.
MAX_TOKENS = 128
# One warp per token: each of the K argmax reductions is warp shuffles only (no shared memory
# barrier), E = 384 is 16 lanes per thread. 4 warps measured no faster (H100, the MoE layer at
# T=9: 118.1 vs 117.1 us; results/h100/2026-12-07/s23_align_layer.log).
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
