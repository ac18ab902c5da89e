"""The one-kernel DDTree builder (pallas_kernels.ddtree_build: bitonic selection; build_ddtree(
impl=...)) against the XLA build_ddtree (itself tested against the published heap in
test_ddtree.py): node for node in interpret mode on random logits with exact ties, masked (-inf)
logits and exhaustion (budget > the valid nodes), at K = n and K < n; the bitonic networks
(pallas_kernels.bitonic) against numpy's lexsort; mutations that must fail; lowering for an
abstract H200 and `auto`'s choice; the option's plumbing (SpecConfig.tree_impl, bench.tree_impl);
the compiled kernel on a GPU."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import tree
from kdtree_jax.cli import UsageError
from kdtree_jax.decoding.spec_config import SpecConfig
from pallas_kernels import bitonic, ddtree_build
from gpu_grid import full_grid  # tests/gpu_grid.py


def _logits(seed, batch, depth, vocab):
  """[B, J, V] logits: Gaussian rows, integer-rounded rows (many exact ties), rows repeated
  across depths, constant rows (every candidate tied) and rows with masked (-inf) columns."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, depth, vocab)).astype(np.float32) * 3
  kind = np.arange(batch) % 5
  x[kind == 1] = np.round(x[kind == 1])
  x[kind == 2] = np.round(x[kind == 2, :1])                        # every depth the same row
  x[kind == 3] = 0.5
  masked = rng.random(x.shape) < 0.4
  x[kind == 4] = np.where(masked[kind == 4], -np.inf, np.round(x[kind == 4]))
  x[kind == 4, :, 0] = 1.0                                         # no row fully masked
  return jnp.asarray(x)


@functools.lru_cache(maxsize=None)
def _builders(budget):
  """(xla, interpret) jitted batch builders for one budget."""
  mk = lambda impl: jax.jit(jax.vmap(lambda x: tree.build_ddtree(x, budget, impl=impl)))
  return mk("xla"), mk("interpret")


def _mismatch(budget, logits):
  """The names of the outputs where the kernel differs from the XLA builder."""
  xla, kern = _builders(budget)
  names = ("tokens", "depths", "parents", "vis")
  return [name for name, a, b in zip(names, xla(logits), kern(logits))
          if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b)]


# block 8 (J = 7): every padding boundary up to 63 (K = min(n, 40)); block 16 (J = 15): the bench's
# budgets at K = n (Cp 16 .. 512) and K = 10 < n; one node, one depth (block 2); exhaustion (tiny
# V). Each budget is one interpret-mode compile, ~3-12 s on this CPU.
@pytest.mark.parametrize("budget,block,vocab", [
    (b, 8, 40) for b in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63)] + [
    (b, 16, 80) for b in (7, 15, 31, 47, 63)] + [
    (b, 16, 10) for b in (15, 47, 63)] + [
    (1, 16, 40), (16, 16, 40), (5, 2, 40), (15, 16, 3), (63, 8, 2), (31, 16, 5)])
def test_kernel_equals_xla(budget, block, vocab):
  logits = _logits(budget * 100 + block + vocab, 10, block - 1, vocab)
  assert _mismatch(budget, logits) == []


def _mutated_trees_differ(monkeypatch, module, name, mutant):
  """Whether build_ddtree (interpret) with `module.name` replaced by mutant(original) builds other
  trees than XLA's on tie-heavy logits (block 8, budget 15). Fresh jits: a cached trace would
  keep the honest kernel."""
  monkeypatch.setattr(module, name, mutant(getattr(module, name)))
  logits = _logits(7, 10, 7, 40)
  fn = jax.jit(jax.vmap(lambda x: tree.build_ddtree(x, 15, impl="interpret")))
  ref = jax.jit(jax.vmap(lambda x: tree.build_ddtree(x, 15, impl="xla")))
  return any(not np.array_equal(a, b) for a, b in zip(ref(logits), fn(logits)))


def test_tie_order_mutation_fails(monkeypatch):
  """The global order's rank tuples compared descending (every integer key after the first of
  each `_beats` call negated: the level's candidate keys are floats) must change trees."""
  def flip(honest):
    def flipped(keys_a, keys_b, idx_a, idx_b):
      neg = lambda keys: keys[:1] + [-x if jnp.issubdtype(x.dtype, jnp.integer) else x
                                     for x in keys[1:]]
      return honest(neg(keys_a), neg(keys_b), idx_a, idx_b)
    return flipped
  assert _mutated_trees_differ(monkeypatch, ddtree_build, "_beats", flip)


def test_flipped_exchange_direction_fails(monkeypatch):
  """Every compare-exchange with its order reversed (sorts descending) must change trees."""
  flip = lambda honest: lambda xs, before, h, d: honest(xs, lambda a, b: before(b, a), h, d)
  assert _mutated_trees_differ(monkeypatch, bitonic, "exchange", flip)


def test_reversed_candidate_tie_break_fails(monkeypatch):
  """The candidates' packed tie key (tie, then index) compared descending must change trees: the
  tie order is what makes the kernel equal XLA's stable sort."""
  def flip(_):
    return lambda a, b: ddtree_build._beats(list(a[:2]), list(b[:2]), -a[2], -b[2])  # pylint: disable=protected-access
  assert _mutated_trees_differ(monkeypatch, ddtree_build, "_candidate_before", flip)


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


def _lower_h200(budget, block, vocab, batch=1, impl="pallas"):
  """The lowered module of the batched builder for an abstract H200."""
  f = jax.vmap(lambda x: tree.build_ddtree(x, budget, impl=impl))
  h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h200)):
    return jax.jit(f).trace(jax.ShapeDtypeStruct((batch, block - 1, vocab), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("budget,block", [(15, 16), (7, 8), (63, 16)])
def test_lowers_for_h200(budget, block):
  """One Triton call and no sort (the XLA builder's levels and assembly are sorts)."""
  text = _lower_h200(budget, block, 20480)
  assert text.count("__gpu$xla.gpu.triton") == 1
  assert "stablehlo.sort" not in text
  assert "stablehlo.sort" in _lower_h200(budget, block, 20480, impl="xla")


def test_auto_is_the_kernel_on_a_gpu_and_xla_elsewhere():
  """impl='auto' (the default) lowers for CUDA to the one Triton call (no sort) and runs the XLA
  builder on this CPU (the same trees; the kernel's Triton lowering never runs here)."""
  text = _lower_h200(15, 16, 20480, impl="auto")
  assert text.count("__gpu$xla.gpu.triton") == 1
  assert "stablehlo.sort" not in text
  logits = _logits(11, 10, 15, 40)
  xla, _ = _builders(15)
  auto = jax.jit(jax.vmap(lambda x: tree.build_ddtree(x, 15)))
  cpu_text = auto.lower(logits).as_text()
  assert "triton" not in cpu_text and "stablehlo.sort" in cpu_text
  assert all(np.array_equal(a, b) for a, b in zip(xla(logits), auto(logits)))


@pytest.mark.parametrize("budget,kernel", [(15, True), (34, True), (63, True), (105, True),
                                           (106, False)])
def test_auto_takes_the_kernel_only_where_measured_fast(budget, kernel):
  """`auto` lowers for CUDA to the Triton call up to Cp = 512 padded candidates (budgets 60-105
  at K = n) and to XLA's sorts above: the bitonic kernel at budget 63 took 84.9 us per build on an
  H100 where XLA's sorts took 352.6 (ddtree_build.AUTO_MAX_PADDED_CANDIDATES); budget 106 pads to
  Cp 1024, never measured."""
  assert ddtree_build.padded_candidates(budget, budget) == {15: 64, 34: 128, 63: 512, 105: 512,
                                                            106: 1024}[budget]
  text = _lower_h200(budget, 16, 20480, impl="auto")
  assert (text.count("__gpu$xla.gpu.triton") == 1) == kernel
  assert ("stablehlo.sort" in text) != kernel


def test_spec_option():
  assert SpecConfig().tree_impl == "auto"
  assert SpecConfig(tree_impl="pallas").tree_impl == "pallas"
  with pytest.raises(UsageError, match="tree builder"):
    SpecConfig(tree_impl="triton")
  with pytest.raises(ValueError, match="impl"):
    tree.build_ddtree(jnp.zeros((3, 5)), 4, impl="sort")


def test_bench_spec_reads_tree_impl():
  from kdtree_jax.bench_setup import bench_spec
  from kdtree_jax.cli import load_config_file
  c = load_config_file(str(pathlib.Path(__file__).parents[2] / "configs" / "bench_k26_core.py"))
  assert bench_spec(c, "ddtree").tree_impl == "auto"
  c.bench.tree_impl = "xla"
  assert bench_spec(c, "ddtree").tree_impl == "xla"


def test_padding_helpers():
  assert [ddtree_build.pow2(x) for x in (1, 2, 3, 15, 16, 17, 64)] == [1, 2, 4, 16, 16, 32, 64]
  bits, per = ddtree_build.digit_packing(15)
  assert (1 << bits) >= 15 + 2 and bits * per <= 31
  assert ddtree_build.key_layout(63, 63, 512) == (9, 12)       # index < 512, tie < 64 * 63
  with pytest.raises(ValueError, match="30 bits"):
    ddtree_build.key_layout(4000, 4000, 1 << 15)


@pytest.mark.gpu  # skipped without a GPU by tests/conftest.py; `-m gpu` selects it
@pytest.mark.parametrize("num_warps,budget", [
    (w, b) if (w, b) == (4, 15) else full_grid(w, b)
    for w in (4, 8) for b in (1, 7, 15, 31, 47, 63)])
def test_compiled_kernel_equals_xla_on_gpu(budget, num_warps):
  """On a GPU: the compiled Triton program == the XLA builder, node for node. The default GPU
  set compiles one of the twelve programs, budget 15 at the default 4 warps (16.7 s on an H100;
  budget 63 took 68.3 s, which alone would break the set's 2 minutes); the rest with pytest's
  --gpu-full-grid. scripts/bench_tree_builder.py checks every budget's trees node for node too."""
  logits = _logits(budget + num_warps, 10, 15, 80)
  lp, ids = jax.jit(jax.vmap(lambda x: tree.topk_logprobs(x, budget)))(logits)
  xla = jax.jit(jax.vmap(functools.partial(tree._build_from_topk, n=budget)))  # pylint: disable=protected-access
  kern = jax.jit(jax.vmap(functools.partial(ddtree_build.build_from_topk, n=budget,
                                            num_warps=num_warps)))
  assert all(np.array_equal(a, b) for a, b in zip(xla(lp, ids), kern(lp, ids)))
