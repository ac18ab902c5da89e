"""One speculative step, phase by phase: draft -> tree -> verify -> accept -> commit.

Every phase is a pure function of arrays so it can be compiled alone (phase profiler) or fused
into `speculative_step`, which the device loop runs with no host round trip.
Letters (the package glossary, kdtree_jax/__init__.py): B batch, N verify width (root + tree
nodes), J draft depth, W commit width (J + 1), V vocab.
"""

import flax.struct
import jax
import jax.numpy as jnp

from kdtree_jax import tree as ddtree
from kdtree_jax.target.cache import compact_rows
from kdtree_jax.decoding import budget
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.decoding.state import DecodeState
from kdtree_jax.draft import model as draft_model
from kdtree_jax.pair import Pair
from kdtree_jax.target import transformer


@flax.struct.dataclass
class Tree:
  """A verify tree per row: node_tokens/depths [B, N-1]; parents [B, N] (-1 root); vis [B, N, N]."""

  node_tokens: jax.Array
  depths: jax.Array
  parents: jax.Array
  vis: jax.Array


def draft_phase(dcfg, dparams, tparams, spec: SpecConfig, state: DecodeState):
  """Materialises pending context K/V, then drafts [bonus, MASK x (B-1)] in one forward.

  Returns (draft cache, draft logits [B, J, V] for block positions 1..J).
  """
  dc = draft_context_phase(dcfg, dparams, state)
  return dc, draft_block_phase(dcfg, dparams, tparams, spec, state, dc)


def draft_context_phase(dcfg, dparams, state: DecodeState):
  """The draft cache with the pending committed tokens' context K/V written (one fused GEMM)."""
  w = state.pending_taps.shape[1]
  dc = state.draft_cache
  positions = dc.ctx_len[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
  return draft_model.materialize_context(dparams, dcfg, dc, state.pending_taps, positions,
                                         state.pending_count)


def draft_block_phase(dcfg, dparams, tparams, spec: SpecConfig, state: DecodeState, dc):
  """Draft logits [B, J, V] of one non-causal block forward against the draft cache `dc`."""
  b = state.pending_count.shape[0]
  block = jnp.full((b, spec.block_size), dcfg.mask_token_id, jnp.int32).at[:, 0].set(state.bonus)
  logits = draft_model.draft_block(dparams, dcfg, dc, block, state.cache.lengths,
                                   tparams["embed"], tparams["lm_head"])
  return logits[:, 1:]


def tree_phase(spec: SpecConfig, draft_logits_bjv, batch: int) -> Tree:
  """The verify tree: root only ('ar'), the greedy chain, or the DDTree of `budget` nodes (of
  the largest compiled width for budget='auto': the verify step picks a prefix of it)."""
  if spec.mode == "ar":
    return Tree(jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0), jnp.int32),
                jnp.full((batch, 1), -1, jnp.int32), jnp.ones((batch, 1, 1), bool))
  if spec.mode == "chain":
    return Tree(*jax.vmap(ddtree.build_chain)(draft_logits_bjv))
  build = lambda x: ddtree.build_ddtree(x, spec.max_budget, impl=spec.tree_impl)
  return Tree(*jax.vmap(build)(draft_logits_bjv))


def verify_phase(tcfg, tparams, spec: SpecConfig, state: DecodeState, tree: Tree, tap_layers,
                 routes=None, moe_inputs=None):
  """One target forward over [bonus, tree nodes] at positions len + depth, under the tree mask.
  routes: a list receiving each MoE layer's expert ids (the step-cost router probe), or None;
  moe_inputs: a list receiving each MoE layer's input (the phase profiler), or None."""
  tokens = jnp.concatenate([state.bonus[:, None], tree.node_tokens], axis=1)
  depth = jnp.concatenate([jnp.zeros_like(state.bonus)[:, None], tree.depths], axis=1)
  positions = state.cache.lengths[:, None] + depth
  return transformer.decode(tcfg, tparams, state.cache, tokens, positions, tree.vis, tap_layers,
                            attn_backend=spec.attn_backend, routes=routes,
                            moe_inputs=moe_inputs)


def accept_phase(spec: SpecConfig, tree: Tree, logits_bnv, key, room_b):
  """Target choice at every node, then the root walk. Returns (path [B, W], accepted a [B], next).

  `room_b` caps a (the cache's free committed rows minus one), so commit never overflows.
  """
  choice, room_b = spec.target_choice(spec, tree, logits_bnv, key, room_b)  # [B, N], [B]
  if spec.mode == "ar":  # root only: nothing to walk
    return jnp.zeros_like(choice), jnp.zeros_like(choice[:, 0]), choice[:, 0]
  walk = jax.vmap(lambda p, t, c, v: ddtree.accept_walk(p, t, c, spec.depth, v))
  path, a, _ = walk(tree.parents, tree.node_tokens, choice, tree.vis)
  a = jnp.minimum(a, room_b)
  last = jnp.take_along_axis(path, a[:, None], axis=1)
  nxt = jnp.take_along_axis(choice, last, axis=1)[:, 0]
  return jnp.maximum(path, 0), a, nxt


def commit_phase(spec: SpecConfig, eos_id, state: DecodeState, cache, draft_cache, tree: Tree,
                 taps, path, a, nxt, key) -> DecodeState:
  """Compacts accepted rows onto [len, len + a + 1), emits tokens, stages taps, updates stops."""
  live = ~state.done
  count = jnp.where(live, a + 1, 0)
  latent = cache.latent
  if spec.mode == "ddtree":  # ar and chain accept a prefix of rows that already sit in place
    latent = compact_rows(latent, cache.lengths, path, count)
  lengths = cache.lengths + count
  tokens = jnp.concatenate([state.bonus[:, None], tree.node_tokens], axis=1)
  k = jnp.arange(spec.commit_width)[None]
  nodes = jnp.take_along_axis(tokens, jnp.roll(path, -1, axis=1), axis=1)
  emitted = jnp.where(k < a[:, None], nodes, nxt[:, None])  # d_1..d_a, then the new bonus
  n_emit = a + 1
  if eos_id is not None:
    is_eos = (emitted == eos_id) & (k <= a[:, None])
    first = jnp.argmax(is_eos, axis=1)
    hit = jnp.any(is_eos, axis=1)
    n_emit = jnp.where(hit, first + 1, n_emit)
  else:
    hit = jnp.zeros_like(live)
  n_emit = jnp.where(live, n_emit, 0)
  # Finished rows write into the last W slots, which no row ever emits into (see loop.out_size).
  write_at = jnp.where(live, state.n_out, state.out.shape[1] - spec.commit_width)
  out = jax.vmap(lambda o, e, s: jax.lax.dynamic_update_slice(o, e, (s,)))(
      state.out, emitted, write_at)
  n_out = state.n_out + n_emit
  done = state.done | hit | (n_out >= spec.max_new_tokens) | (lengths >= state.capacity)
  pending = None if taps is None else jnp.take_along_axis(taps, path[:, :, None], axis=1)
  return state.replace(
      cache=cache.replace(latent=latent, lengths=lengths), draft_cache=draft_cache,
      bonus=jnp.where(live, nxt, state.bonus), pending_taps=pending,
      pending_count=jnp.where(live, a + 1, 0), out=out, n_out=n_out, done=done, key=key,
      accepted=state.accepted.at[state.steps].set(jnp.where(live, a + 1, 0)),
      steps=state.steps + 1)


def verify_chosen_width(tcfg, tparams, dcfg, spec: SpecConfig, state: DecodeState, tree: Tree,
                        draft_logits, tap_layers, width_index=None):
  """Verify phase; budget='auto' verifies the prefix of the tree chosen by `budget.verify_auto`.

  Returns (logits, cache, taps, tree as verified, nodes verified or None).
  """
  verify = lambda tr: verify_phase(tcfg, tparams, spec, state, tr, tap_layers)
  if spec.budget != "auto":
    return (*verify(tree), tree, None)
  auto = budget.resolve(spec.auto, tcfg, dcfg)
  logits, cache, taps, tree, rec = budget.verify_auto(auto, tree, draft_logits, state, verify,
                                                      width_index)
  return logits, cache, taps, tree, rec["nodes"]


def speculative_step(pair: Pair, spec: SpecConfig, state: DecodeState, width_index=None):
  """The whole step as one pure function (jit it, or run it inside the device loop).

  width_index (budget='auto' only; traced int, Python int or None): verify this compiled width
  instead of the chosen one (step-cost calibration; a Python int compiles only that width).
  """
  tcfg, tparams, dcfg, dparams = pair.tcfg, pair.tparams, pair.dcfg, pair.dparams
  key, sub = jax.random.split(state.key)
  tap_layers = () if spec.mode == "ar" else tuple(dcfg.target_layer_ids)
  b = state.bonus.shape[0]
  draft_cache, draft_logits = None, None
  if spec.mode != "ar":
    with jax.named_scope("draft"):
      draft_cache, draft_logits = draft_phase(dcfg, dparams, tparams, spec, state)
  with jax.named_scope("tree"):
    tree = tree_phase(spec, draft_logits, b)
  with jax.named_scope("verify"):
    logits, cache, taps, tree, nodes = verify_chosen_width(
        tcfg, tparams, dcfg, spec, state, tree, draft_logits, tap_layers, width_index)
  with jax.named_scope("accept"):
    room = jnp.maximum(state.capacity - cache.lengths - 1, 0)
    path, a, nxt = accept_phase(spec, tree, logits, sub, room)
  with jax.named_scope("commit"):
    new = commit_phase(spec, tcfg.eos_token_id, state, cache, draft_cache, tree, taps, path, a,
                       nxt, key)
  if nodes is not None and state.widths is not None:  # budget='auto': the width verified
    new = new.replace(widths=state.widths.at[state.steps].set(nodes))
  return new
