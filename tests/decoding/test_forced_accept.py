"""The benchmark-only target choice: ForcedAccept(n) accepts the first-child spine, n per step."""

import numpy as np

from kdtree_jax import forced_accept
from kdtree_jax.decoding import loop, sampling, step
from kdtree_jax.decoding.spec_config import SpecConfig

from test_decoding import BLOCK, make_pair


def _first_child_reference(parents, node_tokens, choice):
  """Plain loops: node i takes the token of its lowest-index child, else keeps its choice."""
  out = np.array(choice)
  for b in range(parents.shape[0]):
    for i in range(parents.shape[1]):
      kids = [k for k in range(1, parents.shape[1]) if parents[b, k] == i]
      if kids:
        out[b, i] = node_tokens[b, kids[0] - 1]
  return out


def test_first_child_tokens_match_a_loop_reference():
  rng = np.random.default_rng(0)
  parents = np.array([[-1, 0, 0, 1, 1, 3], [-1, 0, 1, 2, 0, 4]])
  node_tokens = rng.integers(0, 100, (2, 5))
  choice = rng.integers(100, 200, (2, 6))
  tree = step.Tree(node_tokens, None, parents, None)
  got = forced_accept.first_child_tokens(tree, choice)
  assert (np.asarray(got) == _first_child_reference(parents, node_tokens, choice)).all()


def test_forced_accept_commits_n_plus_one_tokens_per_step():
  pair = make_pair(2)
  n = 2
  spec = SpecConfig(mode="chain", max_new_tokens=13, block_size=BLOCK,
                    target_choice=forced_accept.target_choice(n))
  res = loop.generate(pair, spec, [[1, 2, 3]], max_len=64)
  assert res.accepted_per_step[0] == [n + 1] * 4  # 1 prefill token + 4 steps of 3 = 13
  assert forced_accept.forced_count(spec) == n


def test_real_acceptance_is_the_default():
  assert SpecConfig().target_choice is sampling.target_choice
  assert forced_accept.target_choice(-1) is sampling.target_choice
  assert forced_accept.forced_count(SpecConfig()) == -1
