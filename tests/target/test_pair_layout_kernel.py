"""The one-launch pair layout (`target/pair_layout_kernel.py`, Pallas interpret mode on a CPU):
its five outputs against numpy (a stable argsort of the keys, bincount, cumsum, and a walk of each
expert's rows in R-row windows from its 8-aligned first row), bitwise the XLA glue it replaces,
and a MoE layer on the expert kernel (GPU interpret mode) with it == without it, bitwise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax.target import experts, pair_layout_kernel
from pallas_kernels.grouped_matmul import work
from test_lean_glue import _assert_same_layer_on_the_kernel, _routing  # its neighbour's
from work_reference import items_brute_force  # tests/work_reference.py


def _numpy_layout(idx, e_l, e0, rows, n_items):
  """(rank, sizes, ends, order, items [4, n_items]) from numpy: pairs of other experts last; the
  items by walking each expert's rows in R-row windows from its 8-aligned first row."""
  local = idx.reshape(-1) - e0
  key = np.where((local >= 0) & (local < e_l), local, e_l)
  order = np.argsort(key, kind="stable")
  rank = np.argsort(order)
  sizes = np.bincount(key, minlength=e_l + 1)[:e_l]
  ends = np.cumsum(sizes)
  items = items_brute_force([int(v) for v in sizes], rows)
  table = np.zeros((4, n_items), np.int64)
  table[:, :len(items)] = np.asarray(items, np.int64).reshape(-1, 4).T
  return rank, sizes, ends, order, table


# (T, K, E routed, E_l local, e0, R): a DDTree 15 verify's 128 pairs on 48 local experts, fewer
# tokens (M not a power of 2), one token, R 16, a small model whose E_l is not a power of 2.
CASES = [(16, 8, 384, 48, 96, 8), (9, 8, 384, 48, 0, 8), (1, 8, 384, 48, 336, 8),
         (16, 8, 384, 48, 48, 16), (5, 3, 8, 6, 2, 8), (7, 6, 64, 20, 7, 8)]


@pytest.mark.parametrize("t,k,e,e_l,e0,rows", CASES)
def test_pair_layout_equals_numpy(t, k, e, e_l, e0, rows):
  idx = _routing(t, k, e, seed=t * 10 + e0)
  n_items = work.num_items(t * k, e_l, rows)
  got = pair_layout_kernel.pair_layout(jnp.asarray(idx), e_l, e0, rows, n_items)
  want = _numpy_layout(idx, e_l, e0, rows, n_items)
  for name, g, w in zip(("rank", "sizes", "ends", "order", "items"), got, want):
    assert g.dtype == jnp.int32, name
    np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)
  assert int(np.asarray(got[1]).sum()) > 0  # some pairs are local: the case tests a layout


@pytest.mark.parametrize("t,k,e,e_l,e0,rows", CASES[:2])
def test_pair_layout_equals_the_xla_glue(t, k, e, e_l, e0, rows):
  """The same integers as the three reductions it replaces, with e0 a traced value (an expert
  shard's offset under shard_map)."""
  idx = jnp.asarray(_routing(t, k, e, seed=t + 3))
  m = t * k
  n_items = work.num_items(m, e_l, rows)
  got = jax.jit(lambda i, o: pair_layout_kernel.pair_layout(i, e_l, o, rows, n_items))(
      idx, jnp.int32(e0))
  key, _ = experts._pair_keys(idx, e_l, e0)  # pylint: disable=protected-access
  rank, sizes, ends = experts._pair_counts(key, e_l)  # pylint: disable=protected-access
  order, upto = experts._order_and_item_ends(  # pylint: disable=protected-access
      rank, sizes, ends, rows)
  items = work.work_list(sizes, m, rows, ends, items_upto=upto)
  for g, w in zip(got, (rank, sizes, ends, order, items)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_pair_layout_refuses_more_pairs_than_it_holds():
  idx = jnp.zeros((17, 8), jnp.int32)  # 136 pairs > MAX_PAIRS
  with pytest.raises(ValueError, match="pair layout kernel"):
    pair_layout_kernel.pair_layout(idx, 48, 0, 8, work.num_items(136, 48, 8))


def test_config_refuses_an_unknown_pair_layout_impl():
  with pytest.raises(ValueError, match="pair_layout_impl"):
    C.tiny(pair_layout_impl="triton")


@pytest.mark.slow
@pytest.mark.parametrize("t", [5, 12])
def test_moe_layer_with_the_layout_kernel_bit_identical(t):
  """INT4 MoE layer on the expert kernel (GPU interpret mode): pair_layout_impl "pallas" ==
  "xla", bitwise (T=5, 12: experts over one and several R 8 windows)."""
  _assert_same_layer_on_the_kernel(t, dict(pair_layout_impl="xla"),
                                   dict(pair_layout_impl="pallas"))


def test_expert_ffn_takes_the_kernel_only_where_it_fits(monkeypatch):
  """lean + layout_kernel on the expert kernel: the one launch for M <= MAX_PAIRS; above it, and
  on XLA's expert path (no work list), the XLA glue (the kernel is never called)."""
  calls = []
  real = pair_layout_kernel.pair_layout
  monkeypatch.setattr(pair_layout_kernel, "pair_layout",
                      lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
  cfg = C.tiny(hidden_size=512, moe_intermediate_size=128)
  e_l, d, f = 6, cfg.hidden_size, cfg.moe_intermediate_size
  ks = jax.random.split(jax.random.key(0), 4)
  gate, up = (jax.random.normal(kk, (e_l, d, f), jnp.bfloat16) * 0.05 for kk in ks[:2])
  down = jax.random.normal(ks[2], (e_l, f, d), jnp.bfloat16) * 0.05
  for t, impl in ((4, "interpret"), (17, "interpret"), (4, "xla")):
    idx = jnp.asarray(_routing(t, 8, 8, seed=t))
    x = jax.random.normal(ks[3], (t, d), jnp.bfloat16)
    w = jnp.full((t, 8), 0.125, jnp.float32)
    jax.eval_shape(lambda x, i, w, impl=impl: experts.expert_ffn(
        x, i, w, gate, up, down, impl=impl, lean=True, layout_kernel=True), x, idx, w)
  assert calls == [(4, 8)]
