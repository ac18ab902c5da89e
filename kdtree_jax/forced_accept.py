"""Benchmark-only target choice: a fixed acceptance pattern for random-weight timing runs.

Random weights accept (almost) nothing, so a timed step would commit one token and never move
the caches like a trained pair does. `ForcedAccept(n)` stands in for the target's choice
(`SpecConfig.target_choice`): every node "chooses" its first (lowest-index) child's token, so the
walk accepts the first-child spine, capped at `n` nodes per step. Never used by decoding itself.
"""

import dataclasses

import jax.numpy as jnp

from kdtree_jax.decoding import sampling


@dataclasses.dataclass(frozen=True)
class ForcedAccept:
  """Accept the first-child spine, at most `n` nodes per step (hashable: part of the spec)."""

  n: int

  def __call__(self, spec, tree, logits_bnv, key, room_b):
    choice_bn, room_b = sampling.target_choice(spec, tree, logits_bnv, key, room_b)
    if spec.mode == "ar":  # root only: nothing to force
      return choice_bn, room_b
    return first_child_tokens(tree, choice_bn), jnp.minimum(room_b, self.n)


def first_child_tokens(tree, choice_bn):
  """Each node's first (lowest-index) child's token; nodes without children keep `choice_bn`."""
  n = choice_bn.shape[1]
  child_parent = tree.parents[:, 1:]  # [B, N-1]: parent of tree index k + 1
  is_child = child_parent[:, None, :] == jnp.arange(n)[None, :, None]  # [B, N, N-1]
  first = jnp.argmax(is_child, axis=-1)
  tok = jnp.take_along_axis(tree.node_tokens, first, axis=1)
  return jnp.where(jnp.any(is_child, axis=-1), tok, choice_bn)


def target_choice(n: int):
  """The spec's target choice for a run config's `forced_accept`: ForcedAccept(n), or the
  target's own choice for n < 0 (real acceptance)."""
  return ForcedAccept(n) if n >= 0 else sampling.target_choice


def forced_count(spec) -> int:
  """n of a ForcedAccept spec, -1 for real acceptance (recorded with benchmark rows)."""
  return spec.target_choice.n if isinstance(spec.target_choice, ForcedAccept) else -1
