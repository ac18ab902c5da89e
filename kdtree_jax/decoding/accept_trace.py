"""Node-level acceptance records of DDTree steps: the data budget='auto' is calibrated on.

A node of DDTree's order is accepted iff its parent is and its token is the target's choice at
the parent, whatever else the tree holds; so one step verified at the largest width tells, for
every prefix n of the node order, how many tokens a width-n verify would have accepted from the
same state. Per step and node: its path log-prob under the draft's marginals (DDTree's score),
its depth, and whether it is on the accepted path.

Letters: B batch, N verify width (records cover its N - 1 nodes, root excluded), W commit width.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.decoding import budget, loop, step


def trace_step(pair, spec, state):
  """One fixed-budget ddtree step (the phases of `step.speculative_step`) and its record."""
  tcfg, tparams, dcfg, dparams = pair.tcfg, pair.tparams, pair.dcfg, pair.dparams
  key, sub = jax.random.split(state.key)
  b = state.bonus.shape[0]
  draft_cache, draft_logits = step.draft_phase(dcfg, dparams, tparams, spec, state)
  tree = step.tree_phase(spec, draft_logits, b)
  logits, cache, taps = step.verify_phase(tcfg, tparams, spec, state, tree,
                                          tuple(dcfg.target_layer_ids))
  room = jnp.maximum(state.capacity - cache.lengths - 1, 0)
  path, a, nxt = step.accept_phase(spec, tree, logits, sub, room)
  new = step.commit_phase(spec, tcfg.eos_token_id, state, cache, draft_cache, tree, taps, path,
                          a, nxt, key)
  logq = jax.vmap(budget.node_logq)(draft_logits, tree.node_tokens, tree.depths, tree.vis)
  on = (jnp.arange(path.shape[1])[None] >= 1) & (jnp.arange(path.shape[1])[None] <= a[:, None])
  node = jnp.arange(1, tree.node_tokens.shape[1] + 1)
  on_path = jnp.any((path[:, :, None] == node[None, None]) & on[:, :, None], axis=1)
  return new, dict(logq=logq, depth=tree.depths, on_path=on_path, live=~state.done,
                   ctx=state.cache.lengths)


@functools.partial(jax.jit, static_argnames=("spec",))
def _jit_step(pair, state, *, spec):
  return trace_step(pair, spec, state)


def collect(pair, spec, prompts, max_len, cache_dtype=jnp.float32):
  """Records of every live step of each prompt decoded alone: dict of [steps, N] / [steps]."""
  if spec.mode != "ddtree" or spec.budget == "auto":
    raise ValueError(f"collect needs a fixed-budget ddtree spec, got {spec.mode=} {spec.budget=}")
  recs = []
  for p in prompts:
    state = loop.prefill_device(pair, jnp.asarray([p], jnp.int32),
                                jnp.asarray([len(p)], jnp.int32), jax.random.key(0), spec=spec,
                                max_len=max_len, cache_dtype=cache_dtype)
    while not bool(state.done.all()) and int(state.steps) < spec.max_new_tokens:
      state, rec = _jit_step(pair, state, spec=spec)
      rec = jax.device_get(rec)
      recs.append({k: np.asarray(v)[rec["live"]] for k, v in rec.items()})
  return {k: np.concatenate([r[k] for r in recs]) for k in recs[0]}


def prefix_accept(records, nodes):
  """Observed tokens per step (root included) had only the first `nodes` nodes been verified."""
  return 1 + records["on_path"][:, :nodes].sum(axis=1)


def prefix_expected(records, nodes, calibration):
  """Modelled tokens per step for the first `nodes` nodes (budget.expected_accept)."""
  exp = budget.expected_accept(calibration, jnp.asarray(records["logq"]),
                               jnp.asarray(records["depth"]))
  return np.asarray(exp[:, nodes])


def fit(records, node_counts, edges=budget.DEFAULT_EDGES):
  """AcceptCalibration for `node_counts` (the compiled widths) from records of steps verified
  at the largest."""
  return budget.fit_calibration(records["logq"], records["depth"], records["on_path"],
                                node_counts[:-1], edges)
