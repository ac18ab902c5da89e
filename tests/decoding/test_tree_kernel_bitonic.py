"""The bitonic-selection DDTree kernel (pallas_kernels.ddtree_bitonic, ddtree_build's
`selection="bitonic"`) against the XLA builder `tree._build_from_topk` (itself tested against the
published heap in test_ddtree.py), node for node in interpret mode: budgets 7..63 at K = n and
K < n, batches of random, quantised (tied), constant and masked logits, exhaustion; the bitonic
networks against numpy's lexsort; mutations (a compare direction flipped) that must fail; the
lowering for an abstract H200; `default_selection` is bitonic (faster on an H100 at every Cp)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import tree
from pallas_kernels import bitonic, ddtree_bitonic, ddtree_build
# test_tree_kernel's logits kinds (Gaussian, quantised / tied, repeated, constant, masked);
# tests/decoding is on sys.path (pytest's prepend mode)
from test_tree_kernel import _logits  # pylint: disable=wrong-import-order


def _topk(logits, budget):
  """topk_logprobs per batch row at K = min(budget, V)."""
  k = min(budget, logits.shape[-1])
  return jax.jit(jax.vmap(lambda x: tree.topk_logprobs(x, k)))(logits)


def _trees(budget, lp, ids, selection="bitonic"):
  """(XLA's trees, the interpret-mode kernel's trees) for a batch of top-k inputs."""
  xla = jax.jit(jax.vmap(functools.partial(tree._build_from_topk, n=budget)))  # pylint: disable=protected-access
  kern = jax.jit(jax.vmap(functools.partial(ddtree_build.build_from_topk, n=budget,
                                            interpret=True, selection=selection)))
  return xla(lp, ids), kern(lp, ids)


def _mismatch(budget, logits):
  """The names of the outputs where the bitonic kernel differs from the XLA builder."""
  ref, got = _trees(budget, *_topk(logits, budget))
  names = ("tokens", "depths", "parents", "vis")
  return [name for name, a, b in zip(names, ref, got)
          if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b)]


# (budget, block, vocab): K = n (vocab >= n) and K < n (vocab 10) at the bench's budgets, edge
# sizes (one node, one depth), exhaustion (budget > the valid nodes).
@pytest.mark.parametrize("budget,block,vocab", [
    (b, 16, 80) for b in (7, 15, 31, 47, 63)] + [
    (b, 16, 10) for b in (15, 47, 63)] + [
    (1, 16, 40), (2, 8, 40), (5, 2, 40), (31, 16, 5), (63, 8, 2)])
def test_bitonic_kernel_equals_xla(budget, block, vocab):
  logits = _logits(budget * 100 + block + vocab, 10, block - 1, vocab)
  assert _mismatch(budget, logits) == []


def _before3(a, b):
  """(float key, int key, unique index) ascending."""
  return ddtree_build._beats([a[0], a[1]], [b[0], b[1]], a[2], b[2])  # pylint: disable=protected-access


def _random_entries(rng, length, offset=0):
  """Three arrays: a float and an int key with many ties, a unique index."""
  return (jnp.asarray(rng.integers(0, 4, length).astype(np.float32)),
          jnp.asarray(rng.integers(0, 3, length).astype(np.int32)),
          jnp.asarray(rng.permutation(length).astype(np.int32) + offset))


def _lexsorted(xs):
  """xs sorted by (key 0, key 1, index) with numpy."""
  order = np.lexsort(tuple(np.asarray(x) for x in reversed(xs)))
  return [np.asarray(x)[order] for x in xs]


@pytest.mark.parametrize("length,best", [(512, 64), (256, 64), (64, 64), (16, 4), (8, 8),
                                         (2, 1), (4, 1)])
def test_top_sorted_is_lexsort(length, best):
  rng = np.random.default_rng(length + best)
  for _ in range(3):
    xs = _random_entries(rng, length)
    got = jax.jit(lambda xs: bitonic.top_sorted(xs, _before3, best))(xs)
    want = _lexsorted(xs)
    assert all(np.array_equal(np.asarray(g), w[:best]) for g, w in zip(got, want))


@pytest.mark.parametrize("size", [1, 2, 16, 64])
def test_merge_best_is_lexsort_of_both(size):
  rng = np.random.default_rng(size)
  a = _lexsorted(_random_entries(rng, size))
  b = _lexsorted(_random_entries(rng, size, offset=size))
  acc_desc = tuple(jnp.asarray(x[::-1]) for x in a)
  got = bitonic.merge_best(acc_desc, tuple(jnp.asarray(x) for x in b), _before3)
  want = _lexsorted([np.concatenate([x, y]) for x, y in zip(a, b)])
  assert all(np.array_equal(np.asarray(g)[::-1], w[:size]) for g, w in zip(got, want))


def _mutated_trees_differ(monkeypatch, module, name, mutant):
  """Whether the kernel with `module.name` replaced by mutant(original) builds other trees than
  XLA's on tie-heavy logits (block 8, budget 15)."""
  monkeypatch.setattr(module, name, mutant(getattr(module, name)))
  ref, got = _trees(15, *_topk(_logits(7, 10, 7, 40), 15))
  return any(not np.array_equal(a, b) for a, b in zip(ref, got))


def test_flipped_exchange_direction_fails(monkeypatch):
  """Every compare-exchange with its order reversed (sorts descending) must change trees."""
  flip = lambda honest: lambda xs, before, h, d: honest(xs, lambda a, b: before(b, a), h, d)
  assert _mutated_trees_differ(monkeypatch, bitonic, "exchange", flip)


def test_reversed_candidate_tie_break_fails(monkeypatch):
  """The candidates' packed tie key (tie, then index) compared descending must change trees: the
  tie order is what makes the kernel equal XLA's stable sort."""
  def flip(_):
    return lambda a, b: ddtree_build._beats(list(a[:2]), list(b[:2]), -a[2], -b[2])  # pylint: disable=protected-access
  assert _mutated_trees_differ(monkeypatch, ddtree_bitonic, "_candidate_before", flip)


def test_selection_defaults_and_checks():
  """`default_selection` is the bitonic network at every Cp (measured faster on an H100); bad
  names and keys that do not fit 30 bits are refused."""
  assert all(ddtree_build.default_selection(1 << i) == "bitonic" for i in range(12))
  lp, ids = jnp.zeros((3, 4)), jnp.zeros((3, 4), jnp.int32)
  with pytest.raises(ValueError, match="selection"):
    ddtree_build.build_from_topk(lp, ids, 4, interpret=True, selection="heap")
  with pytest.raises(ValueError, match="30 bits"):
    ddtree_bitonic.key_layout(4000, 4000, 1 << 15)


def _lower_h200(budget, block, vocab):
  """The lowered module of the bitonic builder for an abstract H200."""
  k = min(budget, vocab)
  f = functools.partial(ddtree_build.build_from_topk, n=budget, selection="bitonic")
  h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h200)):
    return jax.jit(f).trace(jax.ShapeDtypeStruct((block - 1, k), jnp.float32),
                            jax.ShapeDtypeStruct((block - 1, k), jnp.int32)).lower(
                                lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("budget", [15, 63])
def test_bitonic_lowers_for_h200(budget):
  """One Triton call, no sort."""
  text = _lower_h200(budget, 16, 20480)
  assert text.count("__gpu$xla.gpu.triton") == 1
  assert "stablehlo.sort" not in text


@pytest.mark.gpu  # skipped without a GPU by tests/conftest.py; `-m gpu` selects it
@pytest.mark.parametrize("budget", [7, 15, 31, 47, 63])
@pytest.mark.parametrize("num_warps", [4, 8])
def test_compiled_bitonic_equals_xla_on_gpu(budget, num_warps, request):
  """On a GPU: the compiled bitonic program == the XLA builder, node for node. The default GPU
  set (kept under 2 minutes) compiles two of the ten programs (~20-50 s each): the deciding
  budget 63 at 8 warps and budget 15 at 4; the rest with pytest's --gpu-full-grid."""
  if (budget, num_warps) not in ((63, 8), (15, 4)) and not request.config.getoption(
      "--gpu-full-grid"):
    pytest.skip("bitonic builder GPU grid: pass --gpu-full-grid")
  lp, ids = _topk(_logits(budget + num_warps, 10, 15, 80), budget)
  xla = jax.jit(jax.vmap(functools.partial(tree._build_from_topk, n=budget)))  # pylint: disable=protected-access
  kern = jax.jit(jax.vmap(functools.partial(ddtree_build.build_from_topk, n=budget,
                                            num_warps=num_warps, selection="bitonic")))
  assert all(np.array_equal(a, b) for a, b in zip(xla(lp, ids), kern(lp, ids)))
