"""TargetConfig.lean_glue (experts.py `_lean_expert_ffn`; above one token only): the index
reductions against numpy, and the MoE layer bit-identical to the fifth session's glue on the
kernel (GPU interpret mode) and within f32 rounding of a numpy per-token loop on XLA."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax.target import experts, moe
from kdtree_jax.target import params as P
from pallas_kernels.grouped_matmul import work
from test_moe_glue import _numpy_routed  # its neighbour's f64 numpy reference (pytest imports by folder)


def _routing(t, k, e, seed):
  """Random distinct experts per token [T, K] int32 (as top-k gives)."""
  rng = np.random.default_rng(seed)
  return np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)


@pytest.mark.parametrize("t,k,e,e_l,rows", [(16, 8, 384, 48, 16), (16, 8, 384, 48, 8),
                                            (65, 8, 384, 48, 8), (5, 3, 8, 6, 8),
                                            (3, 2, 4, 4, 8)])
def test_order_and_item_ends_match_numpy(t, k, e, e_l, rows):
  idx = _routing(t, k, e, seed=t * 100 + rows)
  key, _ = experts._pair_keys(jnp.asarray(idx), e_l, 0)  # pylint: disable=protected-access
  rank, sizes, ends = experts._pair_counts(key, e_l)  # pylint: disable=protected-access
  order, upto = experts._order_and_item_ends(  # pylint: disable=protected-access
      rank, sizes, ends, rows)
  key_np = np.where(idx.reshape(-1) < e_l, idx.reshape(-1), e_l)
  np.testing.assert_array_equal(np.asarray(order), np.argsort(key_np, kind="stable"))
  size_np = np.bincount(key_np, minlength=e_l + 1)[:e_l]
  end_np = np.cumsum(size_np)
  start_np = end_np - size_np
  windows = np.where(size_np > 0, -(-(end_np - (start_np - start_np % 8)) // rows), 0)
  np.testing.assert_array_equal(np.asarray(upto), np.cumsum(windows))
  np.testing.assert_array_equal(
      np.asarray(work.work_list(sizes, t * k, rows, ends, items_upto=upto)),
      np.asarray(work.work_list(jnp.asarray(size_np, jnp.int32), t * k, rows)))


@pytest.mark.parametrize("t,router", [(6, "xla"), (6, "pallas"), (7, "xla")])
def test_lean_glue_equals_numpy_f32(t, router):
  cfg = C.tiny(n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
               num_local_experts=5, expert_backend="xla", lean_glue=True, router_impl=router)
  p = P.init_params(jax.random.key(0), cfg, jnp.float32)["layers"][cfg.first_k_dense_replace]
  p = dict(p["moe"])
  p.pop("shared")
  x = np.asarray(jax.random.normal(jax.random.key(t), (t, cfg.hidden_size)), np.float32)
  want = _numpy_routed(p, cfg, x)
  got = np.asarray(moe.moe(p, cfg, jnp.asarray(x)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.slow
@pytest.mark.parametrize("t,glue", [(5, "auto"), (12, "auto"), (12, "dense")])
def test_lean_glue_bit_identical_on_the_kernel_interpret(t, glue):
  """INT4 experts on the kernel (GPU interpret mode), D 512 so the gated call splits K in 2
  (its partials go through the live-rows pass): lean == the fifth session's glue, bitwise.
  T=5, 12 (R=8): experts over one and several windows; the dense glue at T=12."""
  _assert_same_layer_on_the_kernel(t, dict(moe_glue=glue, lean_glue=False), dict(lean_glue=True))


def _assert_same_layer_on_the_kernel(t, base, other):
  """One INT4 MoE layer on the kernel (GPU interpret mode, D 512: the gated call splits K in 2)
  under the tiny config with `base` fields and with `other` on top: bitwise equal, not all 0."""
  cfg = C.tiny(hidden_size=512, moe_intermediate_size=128, n_routed_experts=8,
               num_experts_per_tok=3, n_group=1, topk_group=1, num_local_experts=6,
               expert_backend="interpret", **base)
  p = P.init_params(jax.random.key(1), cfg, jnp.bfloat16, int4_experts=True)["layers"]
  p = p[cfg.first_k_dense_replace]["moe"]
  x = jax.random.normal(jax.random.key(10 + t), (t, cfg.hidden_size), jnp.bfloat16)
  want = jax.jit(lambda p, x: moe.moe(p, cfg, x))(p, x)
  changed = dataclasses.replace(cfg, **other)
  got = jax.jit(lambda p, x: moe.moe(p, changed, x))(p, x)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert float(jnp.max(jnp.abs(want.astype(jnp.float32)))) > 0


@pytest.mark.parametrize("t,k,e,e_l", [(65, 8, 384, 48), (16, 8, 384, 48), (5, 3, 8, 6)])
def test_aligned_rows_match_numpy(t, k, e, e_l):
  """TargetConfig.align_expert_rows_from's layout (`experts.aligned_rows`) against a numpy count:
  expert e's rows start at 8 x the 8-row windows of the experts before it, in the stable order
  of its pairs; non-local pairs sit past every row; at R 8 the work list then has exactly
  ceil(size / 8) items per expert, each holding that expert's rows only."""
  idx = _routing(t, k, e, seed=t)
  key, _ = experts._pair_keys(jnp.asarray(idx), e_l, 0)  # pylint: disable=protected-access
  rank, sizes, ends = experts._pair_counts(key, e_l)  # pylint: disable=protected-access
  row, end = experts.aligned_rows(key, rank, sizes, ends)
  key_np = np.where(idx.reshape(-1) < e_l, idx.reshape(-1), e_l)
  size_np = np.bincount(key_np, minlength=e_l + 1)[:e_l]
  start_np, want, bound = 0, np.full(t * k, experts.aligned_row_bound(t * k, e_l)), None
  starts = []
  for x in range(e_l):
    starts.append(start_np)
    want[np.flatnonzero(key_np == x)] = start_np + np.arange(size_np[x])
    start_np += 8 * -(-size_np[x] // 8)
  bound = experts.aligned_row_bound(t * k, e_l)
  assert start_np <= bound
  np.testing.assert_array_equal(np.asarray(row), want)
  np.testing.assert_array_equal(np.asarray(end), np.array(starts) + size_np)
  order, upto = experts._order_and_item_ends(  # pylint: disable=protected-access
      row, sizes, end, 8, bound)
  where = np.zeros(bound, np.int64)
  where[want[key_np < e_l]] = np.flatnonzero(key_np < e_l)
  np.testing.assert_array_equal(np.asarray(order), where)  # gaps and the tail: pair 0
  n_items = work.num_items_aligned(t * k, e_l, 8)
  items = np.asarray(work.work_list(sizes, bound, 8, end, items_upto=upto, max_items=n_items))
  live = items[:, items[3] > 0]
  assert items.shape[1] == n_items
  assert live.shape[1] == int(np.sum(-(-size_np // 8))) == int(upto[-1])
  for x, win, lo, n in live.T:
    assert win % 8 == 0 and starts[x] <= win + lo and win + lo + n <= starts[x] + size_np[x]


@pytest.mark.slow
@pytest.mark.parametrize("t", [5, 12])
def test_aligned_rows_bit_identical_on_the_kernel_interpret(t):
  """align_expert_rows_from on the kernel (GPU interpret mode; INT4, D 512: the gated call's split
  partials go through the live-rows pass) == the packed lean layout, bitwise: each row's dots
  are the same wherever its window starts."""
  _assert_same_layer_on_the_kernel(t, dict(lean_glue=True, align_expert_rows_from=None),
                                   dict(align_expert_rows_from=1))


def test_aligned_rows_on_xla_is_the_packed_layout():
  """On XLA (no work list; ragged_dot's groups are contiguous) align_expert_rows_from changes
  nothing: the same values as the numpy reference."""
  cfg = C.tiny(n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
               num_local_experts=5, expert_backend="xla", align_expert_rows_from=1)
  p = P.init_params(jax.random.key(0), cfg, jnp.float32)["layers"][cfg.first_k_dense_replace]
  p = dict(p["moe"])
  p.pop("shared")
  x = np.asarray(jax.random.normal(jax.random.key(6), (6, cfg.hidden_size)), np.float32)
  want = _numpy_routed(p, cfg, x)
  got = np.asarray(moe.moe(p, cfg, jnp.asarray(x)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("m,g,rows", [(520, 48, 8), (72, 48, 8), (30, 48, 8), (128, 48, 16)])
def test_num_items_aligned_is_tight(m, g, rows):
  """`work.num_items_aligned`: no split of m pairs over g experts needs more items at R rows when
  every expert starts 8-aligned (random splits, counted as sum ceil(n / R)), and the worst split
  (min(g, m) - 1 experts of one row, the rest on one) needs exactly that many."""
  bound = work.num_items_aligned(m, g, rows)
  rng = np.random.default_rng(m + g + rows)
  for _ in range(200):
    sizes = np.bincount(rng.integers(0, rng.integers(1, g + 1), m), minlength=g)
    assert np.sum(-(-sizes // rows)) <= bound
  j = min(g, m)
  worst = np.array([1] * (j - 1) + [m - j + 1])
  assert np.sum(-(-worst // rows)) == bound
