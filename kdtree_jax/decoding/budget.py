"""budget='auto': per step, verify the prefix of DDTree's node order that maximises expected
accepted tokens per modelled step time.

DDTree pops nodes best-first, so its first n nodes are the best n-node tree for every n (tested
against `build_ddtree(logits, n)`): one tree of the largest compiled size is built and a prefix
of it verified. Under DDTree's surrogate a node u is accepted with probability q(u), the product
of the draft's marginals along its path, so a prefix of n - 1 nodes accepts 1 + sum q(u) tokens
in expectation (root/bonus included). `AcceptCalibration` replaces q by the acceptance rate
observed in an eval run (per bin of q and width slot of the node's index); `step_cost` models
the step time per width. The chosen width is data; `lax.switch` runs the verify compiled at
that width, so the step compiles once.

Letters (the package glossary, kdtree_jax/__init__.py): B batch, J draft depth, V vocab,
N verify width (root + nodes), I compiled widths.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.decoding.spec_config import AUTO_NODE_COUNTS

DEFAULT_CONTEXTS = (0, 4096, 16384, 65536, 262144)


# Path log-prob bin edges of the acceptance calibration (finer near certainty).
DEFAULT_EDGES = (-8.0, -6.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.7, -0.4, -0.2, -0.1,
                 -0.05)


@dataclasses.dataclass(frozen=True)
class AcceptCalibration:
  """P(node accepted) = rate[slot][bin]: slot = which compiled-width increment the node's index
  in DDTree's order falls in (index < bounds[0], < bounds[1], ...), bin = its path log-prob q
  between `edges`. Empty `rate` (or a cell with rate < 0: nothing observed) = q itself,
  DDTree's surrogate. Slots rather than depths: with per-depth cells the nodes of short prefixes
  were under-predicted by 0.4-1.0 tokens even on the data fitted (WORKSPACE.md, issue 15).
  """

  bounds: tuple[int, ...] = ()
  edges: tuple[float, ...] = ()
  rate: tuple[tuple[float, ...], ...] = ()

  def node_prob(self, logq_bn):
    """Calibrated acceptance probability of the nodes (in DDTree order) of each row."""
    q = jnp.exp(logq_bn)
    if not self.rate:
      return q
    table = jnp.asarray(self.rate, jnp.float32)
    slot = jnp.searchsorted(jnp.asarray(self.bounds, jnp.int32), jnp.arange(logq_bn.shape[-1]),
                            side="right")
    b = jnp.searchsorted(jnp.asarray(self.edges, jnp.float32), logq_bn)
    r = table[slot, b]
    return jnp.where(r >= 0, r, q)

  def to_dict(self):
    return dict(bounds=list(self.bounds), edges=list(self.edges), rate=[list(r) for r in self.rate])

  @classmethod
  def from_dict(cls, d):
    return cls(tuple(int(x) for x in d["bounds"]), tuple(float(x) for x in d["edges"]),
               tuple(tuple(float(x) for x in r) for r in d["rate"]))


def fit_calibration(logq_sn, depth_sn, accepted_sn, bounds, edges=DEFAULT_EDGES,
                    prior=1.0) -> AcceptCalibration:
  """Acceptance rate per (slot, bin) over recorded steps' nodes [S, N] (DDTree order; depth 0 =
  padding, ignored), shrunk toward the cell's mean q by `prior` pseudo-nodes:
  (accepted + prior * mean q) / (nodes + prior); -1 where no node was seen."""
  logq, depth, acc = (np.asarray(x) for x in (logq_sn, depth_sn, accepted_sn))
  slot = np.broadcast_to(np.searchsorted(np.asarray(bounds), np.arange(logq.shape[1]),
                                         side="right"), logq.shape)
  b = np.searchsorted(np.asarray(edges, float), logq)
  ok = depth > 0
  shape = (len(bounds) + 1, len(edges) + 1)
  hits, count, qsum = np.zeros(shape), np.zeros(shape), np.zeros(shape)
  np.add.at(hits, (slot[ok], b[ok]), acc[ok].astype(float))
  np.add.at(count, (slot[ok], b[ok]), 1.0)
  np.add.at(qsum, (slot[ok], b[ok]), np.exp(logq[ok]))
  rate = np.where(count > 0, (hits + prior * qsum / np.maximum(count, 1)) / (count + prior), -1.0)
  return AcceptCalibration(tuple(int(x) for x in bounds), tuple(float(e) for e in edges),
                           tuple(tuple(float(x) for x in row) for row in rate))


@dataclasses.dataclass(frozen=True)
class AutoBudget:
  """Compiled node counts, the step-cost table over context, and the acceptance calibration.

  cost_ms[i][j]: modelled ms of a step verifying node_counts[j] + 1 tokens at cost_contexts[i]
  (empty: filled from the analytic model of the run's own target, `resolve`).
  """

  node_counts: tuple[int, ...] = AUTO_NODE_COUNTS
  cost_contexts: tuple[int, ...] = ()
  cost_ms: tuple[tuple[float, ...], ...] = ()
  calibration: AcceptCalibration = AcceptCalibration()
  cost_source: str = ""

  def __post_init__(self):
    if not self.node_counts or list(self.node_counts) != sorted(set(self.node_counts)):
      raise ValueError(f"node_counts {self.node_counts} must be increasing and non-empty")
    if self.node_counts[0] < 1:
      raise ValueError(f"node_counts {self.node_counts} must be >= 1")
    if self.cost_ms and np.shape(self.cost_ms) != (len(self.cost_contexts), len(self.node_counts)):
      raise ValueError(f"cost_ms shape {np.shape(self.cost_ms)} != (contexts, node_counts) = "
                       f"{(len(self.cost_contexts), len(self.node_counts))}")

  @property
  def max_nodes(self) -> int:
    return self.node_counts[-1]


def from_cost_model(model, node_counts=AUTO_NODE_COUNTS, contexts=DEFAULT_CONTEXTS,
                    calibration=AcceptCalibration()) -> AutoBudget:
  """AutoBudget whose cost table is `model.ms(n + 1, ctx)` (step_cost.AnalyticCost or
  CalibratedCost) at each compiled node count and context."""
  table = tuple(tuple(float(model.ms(n + 1, c)) for n in node_counts) for c in contexts)
  return AutoBudget(tuple(node_counts), tuple(contexts), table, calibration, model.source)


def resolve(auto: AutoBudget | None, tcfg, dcfg) -> AutoBudget:
  """The run's AutoBudget; without a cost table, the analytic floor of its own target on one
  H200 (bf16, no collectives)."""
  from kdtree_jax.decoding import step_cost  # pylint: disable=import-outside-toplevel
  auto = auto or AutoBudget()
  if auto.cost_ms:
    return auto
  return from_cost_model(step_cost.AnalyticCost(tcfg, dcfg), auto.node_counts, DEFAULT_CONTEXTS,
                         auto.calibration)


# ---- on device ----------------------------------------------------------------------------
def node_own_logq(draft_logits_jv, node_tokens_n, depths_n):
  """The draft's log-marginal of every node's token at its depth [N-1] (0 for padding)."""
  logp_jv = jax.nn.log_softmax(draft_logits_jv.astype(jnp.float32), axis=-1)
  own = logp_jv[jnp.maximum(depths_n - 1, 0), node_tokens_n]
  return jnp.where(depths_n > 0, own, 0.0)


def path_sum(values_n, vis_nn):
  """Sum of a per-node value over each node's path (itself and its ancestors, root excluded)."""
  v1 = jnp.concatenate([jnp.zeros(values_n.shape[:-1] + (1,), values_n.dtype), values_n], -1)
  return jnp.sum(jnp.where(vis_nn[..., 1:, :], v1[..., None, :], 0.0), axis=-1)


def node_logq(draft_logits_jv, node_tokens_n, depths_n, vis_nn):
  """DDTree's score of every node: path log-prob under the draft's marginals [N-1]."""
  return path_sum(node_own_logq(draft_logits_jv, node_tokens_n, depths_n), vis_nn)


def expected_accept(calibration, logq_bn, depths_bn):
  """[B, N]: expected tokens committed by verifying the first n tree indices (root + n - 1
  nodes, DDTree order), n = 1..N: 1 + the sum of those nodes' acceptance probabilities."""
  p = jnp.where(depths_bn > 0, calibration.node_prob(logq_bn), 0.0)
  return 1.0 + jnp.concatenate([jnp.zeros_like(p[:, :1]), jnp.cumsum(p, axis=1)], axis=1)


def cost_at(auto: AutoBudget, ctx):
  """[I] modelled ms per compiled width at context ctx (linear between grid contexts)."""
  table = jnp.asarray(auto.cost_ms, jnp.float32)
  if table.shape[0] == 1:
    return table[0]
  grid = jnp.asarray(auto.cost_contexts, jnp.float32)
  return jax.vmap(lambda col: jnp.interp(ctx.astype(jnp.float32), grid, col), 1)(table)


def choose_width(auto: AutoBudget, expected_bn, live_b, ctx):
  """Index into node_counts maximising the batch's expected tokens / modelled ms; also the
  expected tokens and ms at the chosen width."""
  n = jnp.asarray(auto.node_counts)
  tokens_i = jnp.sum(jnp.where(live_b[:, None], expected_bn[:, n], 0.0), axis=0)
  ms_i = cost_at(auto, ctx)
  idx = jnp.argmax(tokens_i / ms_i).astype(jnp.int32)
  return idx, tokens_i[idx], ms_i[idx]


def prefix_tree(tree, nodes: int):
  """The first `nodes` nodes of a tree in DDTree order (prefix-closed: parents come first)."""
  return tree.replace(node_tokens=tree.node_tokens[:, :nodes], depths=tree.depths[:, :nodes],
                      parents=tree.parents[:, :nodes + 1],
                      vis=tree.vis[:, :nodes + 1, :nodes + 1])


def _pad_nodes(x, n):
  """Pads axis 1 to n (a width-n verify's outputs in the shape of the widest branch)."""
  return x if x is None else jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def verify_auto(auto: AutoBudget, tree, draft_logits_bjv, state, verify_fn, width_index=None):
  """Chooses the width, verifies that prefix of `tree` (lax.switch over the compiled widths).

  verify_fn(tree) -> (logits [B, n, V], cache, taps [B, n, F]). width_index (traced int, or
  None) overrides the choice (calibration); a Python int compiles that width's verify alone.
  Returns (logits, cache, taps padded to the widest width, the tree with nodes beyond the
  verified prefix detached (parent -1: never accepted), and a record {nodes, expected_tokens,
  modelled_ms} of the step).
  """
  logq = jax.vmap(node_logq)(draft_logits_bjv, tree.node_tokens, tree.depths, tree.vis)
  expected = expected_accept(auto.calibration, logq, tree.depths)
  idx, tokens, ms = choose_width(auto, expected, ~state.done, jnp.max(state.cache.lengths))
  if width_index is not None:
    idx = jnp.asarray(width_index, jnp.int32)
    tokens = jnp.sum(jnp.where(~state.done, expected[:, jnp.asarray(auto.node_counts)[idx]], 0.0))
    ms = cost_at(auto, jnp.max(state.cache.lengths))[idx]
  n_max = auto.max_nodes + 1

  def branch(nodes):
    def run(tr):
      logits, cache, taps = verify_fn(prefix_tree(tr, nodes))
      return _pad_nodes(logits, n_max), cache, _pad_nodes(taps, n_max)
    return run

  branches = [branch(n) for n in auto.node_counts]
  if isinstance(width_index, int):  # one width compiled alone (calibration), no switch
    logits, cache, taps = branches[width_index](tree)
  else:
    logits, cache, taps = jax.lax.switch(idx, branches, tree)
  nodes = jnp.asarray(auto.node_counts, jnp.int32)[idx]
  keep = jnp.arange(n_max)[None, :] <= nodes
  tree = tree.replace(parents=jnp.where(keep, tree.parents, -1))
  return logits, cache, taps, tree, dict(nodes=nodes, expected_tokens=tokens, modelled_ms=ms)
