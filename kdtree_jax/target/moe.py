"""Sigmoid-routed, group-limited, dropless MoE (DeepSeek-V3 `noaux_tc`, Kimi K2).

Letters: T tokens, D hidden, E routed experts, F expert width, K experts per token (routing
groups: cfg.n_group, no letter).
"""

import jax
import jax.numpy as jnp

from kdtree_jax import sharding
from kdtree_jax.target.config import TargetConfig
from kdtree_jax.target import route_kernel
from kdtree_jax.target.experts import (Weighting, dense_glue_fits, expert_ffn, expert_ffn_dense,
                                       one_token_ffn)
from kdtree_jax.target.mlp import swiglu, swiglu_down
from kdtree_jax.target.pack import dot_t
from kdtree_jax.target.moe_parallel import experts_ep, route_local


def route(p, cfg: TargetConfig, x_td, logits=None):
  """Returns (expert ids [T, K] int32, weights [T, K] f32).

  Scores are sigmoid(x @ W_g) in f32; `bias` (e_score_correction_bias) shifts them for SELECTION
  only; the weights are the unbiased scores, optionally normalised, times routed_scaling_factor.
  logits: x @ W_g [T, E] f32 when already computed (the packed layer's joint dot; its first E
  columns where wider: `router_and_shared(wide=True)`), else None.
  cfg.router_impl "pallas": one kernel launch after the logits where it takes the shape.
  """
  if _routing_kernel(cfg, x_td.shape[0]):
    return route_kernel.route_pallas(_logits(p, x_td, logits), p["bias"],
                                     cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                     cfg.routed_scaling_factor)
  choice, scores = _choice_and_scores(p, cfg, x_td, logits)
  k = cfg.num_experts_per_tok
  idx, w = top_k_select(choice, scores, k)
  weighting = Weighting(k, cfg.norm_topk_prob, cfg.routed_scaling_factor)
  return idx.astype(jnp.int32), weighting.of_choices(w)  # the sum over k: element-wise adds


# Up to this many T x E x E comparisons (T = 455 at E = 384) top-k is two fused reductions
# instead of XLA's TopK kernel plus a gather (~6 us at any T on an H200).
COMPARE_TOP_K_MAX = 1 << 26


def top_k_select(choice_te, values_te, k):
  """(indices [T, k] int32 of the k largest `choice` per row, descending, ties to the lower index
  as jax.lax.top_k; `values` at those indices [T, k]). The values are a gather at the indices
  (a masked sum over [T, k, E] beside the indices' made XLA:GPU write that [T, k, E] in f32)."""
  t, e = choice_te.shape
  if t * e * e > COMPARE_TOP_K_MAX:
    _, idx = jax.lax.top_k(choice_te, k)
    return idx.astype(jnp.int32), jnp.take_along_axis(values_te, idx, axis=-1)
  ids = jnp.arange(e, dtype=jnp.int32)
  rank = compare_rank(choice_te)
  hit = rank[:, None, :] == jnp.arange(k, dtype=jnp.int32)[None, :, None]  # [T, k, E]
  idx = jnp.sum(jnp.where(hit, ids, 0), axis=2, dtype=jnp.int32)
  return idx, jnp.take_along_axis(values_te, idx, axis=-1)


def compare_rank(choice_te):
  """[T, E] int32: how many experts beat each (larger choice, or equal at a lower index), so the
  top k are rank < k, in lax.top_k's order (one fused reduction of T x E x E comparisons)."""
  ids = jnp.arange(choice_te.shape[1], dtype=jnp.int32)
  mine, other = choice_te[:, :, None], choice_te[:, None, :]
  beaten_by = (other > mine) | ((other == mine) & (ids[None, None, :] < ids[None, :, None]))
  return jnp.sum(beaten_by, axis=2, dtype=jnp.int32)


def route_dense(p, cfg: TargetConfig, x_td, logits=None):
  """`route` as [T, E] arrays: (each expert's place in the token's choice, int32, selected where
  < num_experts_per_tok; the unbiased scores, f32). The same choices as `route` (the same
  comparison rank); the weights (normalised, scaled) are the consumer's (`expert_ffn_dense`).
  logits: as in `route`."""
  choice, scores = _choice_and_scores(p, cfg, x_td, logits)
  return compare_rank(choice), scores


def route_one_token(p, cfg: TargetConfig, x_td, logits=None):
  """One token's routing as the routing kernel's one-token form (cfg.router_impl "pallas"):
  (its work list [4, K] int32, `experts.one_token_work_list`'s rows, row 0 the expert ids in
  `route`'s order; its weights [K] f32). logits: as in `route`."""
  return route_kernel.route_one_token(_logits(p, x_td, logits), p["bias"],
                                      cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                      cfg.routed_scaling_factor, cfg.experts_held)


def _routing_kernel(cfg: TargetConfig, t: int) -> bool:
  """Whether T tokens route through the one-launch kernel (router_impl "pallas", or "auto" on a
  GPU; no group limit, T <= route_kernel.MAX_TOKENS); else the XLA path."""
  wanted = cfg.router_impl == "pallas" or (cfg.router_impl == "auto"
                                           and jax.default_backend() == "gpu")
  return wanted and route_kernel.supports(t, cfg.n_group)


def _logits(p, x_td, logits):
  return _router_logits(x_td, p["router"]) if logits is None else logits


def _narrow_logits(p, x_td, logits):
  """[T, E] logits for the XLA routing (the first E columns where wider)."""
  return _logits(p, x_td, logits)[:, :p["bias"].shape[0]]


def _choice_and_scores(p, cfg: TargetConfig, x_td, logits):
  """(selection scores: biased, group-limited; the unbiased sigmoid scores), both [T, E] f32;
  logits as in `route`."""
  logits = _narrow_logits(p, x_td, logits)
  scores = jax.nn.sigmoid(logits)
  choice = scores + p["bias"].astype(jnp.float32)
  if cfg.n_group > 1:
    choice = _limit_groups(choice, cfg.n_group, cfg.topk_group)
  return choice, scores


def _router_logits(x_td, router_de, dot=jnp.dot):
  """x @ W_g in f32. HF computes it on f32 copies; for 16-bit x and W every product is exact in
  f32, so a 16-bit matmul with f32 accumulation is the same sum (order aside) without the f32
  copies or a 6-pass HIGHEST matmul. f32 inputs keep the f32 HIGHEST matmul (parity fixtures).
  dot: pack.dot_t for an out-major [E, D] weight."""
  if x_td.dtype.itemsize == 2 and router_de.dtype == x_td.dtype:
    return dot(x_td, router_de, preferred_element_type=jnp.float32)
  return dot(x_td.astype(jnp.float32), router_de.astype(jnp.float32),
             precision=jax.lax.Precision.HIGHEST)


def _limit_groups(choice_te, n_group, topk_group):
  """Keeps the topk_group groups with the largest sum of their top-2 scores; others -> -inf."""
  t, e = choice_te.shape
  grouped = choice_te.reshape(t, n_group, e // n_group)
  group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
  _, keep = jax.lax.top_k(group_score, topk_group)
  # A comparison, not a scatter over arange(t): GSPMD keeps it local to data-split tokens.
  keep_mask = jnp.any(keep[:, :, None] == jnp.arange(n_group)[None, None, :], axis=1)
  return jnp.where(keep_mask[:, :, None], grouped, -jnp.inf).reshape(t, e)


def routed_experts(p, cfg: TargetConfig, x_td, idx_tk, w_tk):
  """The routed experts this device holds (all, or cfg.num_local_experts of them)."""
  return expert_ffn(x_td, idx_tk, w_tk, p["gate"], p["up"], p["down"], impl=cfg.expert_backend,
                    lean=cfg.lean_glue, aligned=_aligns_expert_rows(cfg, x_td.shape[0]))


def _aligns_expert_rows(cfg: TargetConfig, t: int) -> bool:
  """Whether T tokens' expert rows take the 8-aligned layout (align_expert_rows_from)."""
  return cfg.align_expert_rows_from is not None and t >= cfg.align_expert_rows_from


def moe(p, cfg: TargetConfig, x, routes: list | None = None):
  """MoE block on x [..., D]: routed experts (expert-parallel under a mesh) + shared experts.

  routes: a list to which this layer's expert ids [T, K] are appended (training's load
  balancing, the step-cost router probe); None records nothing."""
  shape = x.shape
  x_td = x.reshape(-1, shape[-1])
  mesh = sharding.current_mesh()
  if mesh is not None:  # one psum for routed + shared where they split alike (moe_parallel)
    if "router_gate_up_t" in p:
      raise ValueError("packed target params (target/pack.py) are one device's layout; "
                       "load them unpacked under a mesh")
    idx, w = route_local(lambda rp, x: route(rp, cfg, x), p, x_td, mesh)
    _record(routes, idx)
    return experts_ep(p, x_td, idx, w, mesh, impl=cfg.expert_backend).reshape(shape)
  if _dense_glue(cfg, x_td.shape[0]) and x_td.shape[0] == 1 and _routing_kernel(cfg, 1):
    return _one_token_moe(p, cfg, x_td, routes).astype(x.dtype).reshape(shape)
  logits, shared = router_and_shared(p, x_td, wide=_routing_kernel(cfg, x_td.shape[0]))
  if _dense_glue(cfg, x_td.shape[0]):  # (router_impl "pallas" above one token: XLA's rank)
    rank, scores = route_dense(p, cfg, x_td, logits)
    if routes is not None:  # the ids in top-k order (the same logits and rank, shared by XLA)
      _record(routes, route(p, cfg, x_td, logits)[0])
    y = expert_ffn_dense(x_td, rank, scores, p["gate"], p["up"], p["down"],
                         Weighting(cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                   cfg.routed_scaling_factor),
                         impl=cfg.expert_backend, lean=cfg.lean_glue and x_td.shape[0] > 1)
  else:
    idx, w = route(p, cfg, x_td, logits)
    _record(routes, idx)
    y = routed_experts(p, cfg, x_td, idx, w)
  if shared is not None:
    y = y + shared.astype(jnp.float32)
  return y.astype(x.dtype).reshape(shape)


def _one_token_moe(p, cfg: TargetConfig, x_td, routes):
  """One token through the routing kernel's path (no XLA glue up to the expert kernels) -> [1, D]
  f32. With cfg.one_token_rows_first the experts' K rows of x_td [1, D] are broadcast FIRST (behind
  an optimization barrier, else XLA folds slice(broadcast) back) and the router | shared dot
  reads row 0: the normalise that made x_td (transformer's mlp_norm) then has the broadcast as
  its only consumer and fuses into it, where it was its own kernel feeding both (XLA:GPU,
  deviceless H200 compile of the K2.6 share: one kernel per MoE layer fewer at one token; the
  same values, so the same routing)."""
  rows = x_td
  if cfg.one_token_rows_first:
    rows = jax.lax.optimization_barrier(
        jnp.broadcast_to(x_td, (cfg.num_experts_per_tok, x_td.shape[1])))
    x_td = rows[:1]
  logits, shared = router_and_shared(p, x_td, wide=True)
  items, w = route_one_token(p, cfg, x_td, logits)
  _record(routes, items[:1])
  y = one_token_ffn(rows, items, w, p["gate"], p["up"], p["down"], impl=cfg.expert_backend)
  return y if shared is None else y + shared.astype(jnp.float32)


def router_and_shared(p, x_td, wide: bool = False):
  """(router logits [T, E] f32 or None: `route` computes them, the shared experts' output
  [T, D] in x's dtype or None). Packed (target/pack.py "router_gate_up_t"): ONE dot for the
  router and the shared gate | up, with the router's f32 accumulation (`_router_logits`); the
  gate and up columns are rounded to x's dtype, as their own dot would.
  wide (the routing kernel's path): the logits are the dot's whole [T, E + 2 F] output, the
  router's E columns first (the kernel reads those), so no slice of them is made for the kernel
  (H200, full depth, s7: -60 launches and -55 us per ar step, -34 us per DDTree 15 step, where
  the split-K sum is then made once for both consumers: results/h200/2026-12-01/s7_target_ab.log)."""
  if "router_gate_up_t" not in p:
    return None, (swiglu(p["shared"], x_td) if "shared" in p else None)
  e = p["bias"].shape[0]
  y = _router_logits(x_td, p["router_gate_up_t"], dot=dot_t)
  gate, up = jnp.split(y[:, e:].astype(x_td.dtype), 2, axis=-1)
  return y if wide else y[:, :e], swiglu_down(gate, up, p["shared"])


def _dense_glue(cfg: TargetConfig, t: int) -> bool:
  """The dense glue for cfg.moe_glue == "dense", or "auto" at one token (the H200, one
  bench_k26_full layer: T=1 49.1 vs 53.8 us sorted; T=9 134.8 vs 131.6, T=65 631.6 vs 625.4:
  WORKSPACE.md, third session), where its comparisons stay small (else the sorted glue runs)."""
  e = cfg.n_routed_experts
  dense = cfg.moe_glue == "dense" or (cfg.moe_glue == "auto" and t == 1)
  return (dense and t * e * e <= COMPARE_TOP_K_MAX
          and dense_glue_fits(t, cfg.experts_held))


def _record(routes: list | None, idx_tk):
  if routes is not None:
    routes.append(idx_tk)
