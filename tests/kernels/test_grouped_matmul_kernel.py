"""The grouped expert matmul kernel (bf16 and INT4 weights) against its XLA references, its work
list against a brute-force enumeration, and the routed-expert FFN through it.

On CPU the kernel runs in GPU interpret mode; `-m gpu` runs the compiled kernel on a GPU.
"""

import collections
import dataclasses

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax.experimental.mosaic.gpu import core
import numpy as np
import pytest

from kdtree_jax.checkpoint import int4
from kdtree_jax.target import experts
from pallas_kernels.grouped_matmul import expert_mlp as pallas_expert_mlp
from pallas_kernels.grouped_matmul import (Tuning, gated_grouped_matmul, grouped_matmul,
                                           grouped_matmul_reference,
                                           int4_grouped_matmul_reference, work)
from pallas_kernels.grouped_matmul import kpack
from pallas_kernels.grouped_matmul import tuning as tuning_module
from pallas_kernels.grouped_matmul.tuning import apply_variant, default_tuning, scale_splits
from gpu_grid import full_grid  # tests/gpu_grid.py


def _items_brute_force(sizes, rows):
  """(expert, window, lo, size) by walking each expert's rows in windows from its 8-aligned start."""
  out, start = [], 0
  for g, s in enumerate(sizes):
    win = start - start % 8
    while s and win < start + s:
      lo, hi = max(start, win), min(start + s, win + rows)
      out.append([g, win, lo - win, hi - lo])
      win += rows
    start += s
  return out


@pytest.mark.parametrize("sizes,m,rows", [([30, 0, 50, 3, 10], 100, 32), ([7], 7, 8),
                                          ([0, 0, 5, 0], 64, 16), ([64, 64, 1, 127], 300, 64),
                                          ([0, 0, 0], 10, 8), ([1] * 8 + [0] * 40, 8, 8)])
def test_work_list_covers_every_row_once(sizes, m, rows):
  items = np.asarray(work.work_list(jnp.asarray(sizes, jnp.int32), m, rows)).T
  assert len(items) == work.num_items(m, len(sizes), rows)
  live = [list(map(int, it)) for it in items if it[3] > 0]
  assert live == _items_brute_force(sizes, rows)
  assert all(it[1] % 8 == 0 and it[2] + it[3] <= rows for it in live)
  assert not items[len(live):].any()  # live items first, then all-0 ones


@pytest.mark.parametrize("choices,g", [([40, 2, 99, 6, 5, 47, 70, 71], 48), ([0], 4), ([], 8)])
def test_one_token_work_list_equals_brute_force(choices, g):
  """One token's work list: row j = its j-th choice, alone in its window, live if local (< g)."""
  m, e = max(len(choices), 1), 128
  rank = np.full(e, 10 ** 6, np.int32)
  rank[choices] = np.arange(len(choices))
  items = np.asarray(experts.one_token_work_list(jnp.asarray(rank), m, g)).T
  want = [[c, j - j % 8, j % 8, int(c < g)] for j, c in enumerate(choices)]
  assert [list(map(int, it)) for it in items][:len(choices)] == want
  assert all(it[3] == 0 for it in items[len(choices):])


@pytest.mark.parametrize("sizes", [[3, 0, 9, 1, 0, 9, 7], [0, 0, 2], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
def test_one_window_work_list_equals_brute_force(sizes):
  """Few tokens (every expert <= T rows, R >= T + 7): one item per live expert, in order."""
  t = max(sizes)
  m = max(sum(sizes), 1)
  gs = jnp.asarray(sizes, jnp.int32)
  items = experts.one_window_work_list(gs > 0, gs, jnp.cumsum(gs), min(len(sizes), m))
  items = np.asarray(items).T
  live = [list(map(int, it)) for it in items if it[3] > 0]
  assert live == _items_brute_force(sizes, t + 7)
  assert all(it[3] == 0 for it in items[len(live):])


@pytest.mark.slow
def test_work_list_bound_holds_for_adversarial_sizes():
  """Random sizes and near-worst cases (experts starting 7 rows past an 8-aligned row): every row
  covered by a live item, never more live items than the static bound."""
  rng = np.random.default_rng(0)
  cases = [[7] + [1] * 40, [1] * 64, [9, 8, 8, 8, 8, 8, 8, 8]]
  cases += [[int(v) for v in rng.integers(0, 12, size=rng.integers(1, 30))] for _ in range(40)]
  work_list = jax.jit(work.work_list, static_argnums=(1, 2))  # one compile per case, not per op
  for sizes in cases:
    m = max(sum(sizes), 1)
    for rows in (8, 16, 32, 64):
      want = _items_brute_force(sizes, rows)
      assert len(want) <= work.num_items(m, len(sizes), rows), (sizes, rows)
      items = np.asarray(work_list(jnp.asarray(sizes, jnp.int32), m, rows)).T
      assert [list(map(int, it)) for it in items if it[3] > 0] == want, (sizes, rows)


def _operands(m, k, n, g, group, seed=0):
  """x bf16 [M, K]; bf16 weights [G, K, N]; INT4 q [G, N, K] + scales [G, K/S, N]."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(g, k, n)) * 0.05, jnp.bfloat16)
  q = jnp.asarray(rng.integers(-8, 8, size=(g, n, k)), jnp.int4)
  s = jnp.asarray(rng.uniform(0.01, 0.1, size=(g, k // group, n)), jnp.bfloat16)
  return x, (w,), (q, s)


def _check(got, want, rows):
  """Rows past the sum are not the kernel's; every live row matches within one bf16 rounding."""
  got, want = np.asarray(got, np.float32)[:rows], np.asarray(want, np.float32)[:rows]
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-4 * np.abs(want).max())


CASES = [  # sizes, m, k, n, group, tuning
    ([30, 0, 50, 3, 10], 100, 128, 128, 32, Tuning(rows=32, block_n=64, block_k=64, stages=2)),
    ([7], 7, 128, 128, 32, Tuning(rows=8, block_n=128, block_k=128, stages=2)),
    ([20, 0, 44, 64], 140, 256, 128, 128, Tuning(rows=16, block_n=64, block_k=128, stages=3)),
    ([1, 0, 1, 1, 0, 1], 4, 256, 128, 32, Tuning(rows=8, block_n=64, block_k=256, stages=2)),
    ([3, 0, 9], 13, 256, 64, 32, Tuning(rows=16, block_n=64, block_k=64, stages=2, splits=2)),
    ([30, 0, 50, 3, 10], 100, 128, 128, 32,  # 2 CTA columns looping over the items
     Tuning(rows=32, block_n=64, block_k=64, stages=2, splits=2, slots=2)),
]


@pytest.mark.slow
@pytest.mark.parametrize("sizes,m,k,n,group,tuning", CASES)
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_kernel_interpret_matches_reference(sizes, m, k, n, group, tuning, fmt):
  x, w_bf16, w_int4 = _operands(m, k, n, len(sizes), group)
  ws = w_int4 if fmt == "int4" else w_bf16
  if fmt == "bf16":  # a bf16 tile is 4x an INT4 tile's bytes: the default tunings halve block_k
    tuning = dataclasses.replace(tuning, block_k=min(tuning.block_k, 128))
  gs = jnp.asarray(sizes, jnp.int32)
  tuning = dataclasses.replace(tuning, a_operand="smem")  # interpret mode's wgmma: SMEM only
  got = grouped_matmul(x, ws, gs, backend="interpret", tuning=tuning)
  want = grouped_matmul(x, ws, gs, backend="xla")
  _check(got, want, sum(sizes))


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_gated_kernel_interpret_matches_reference(fmt):
  """gate and up in one call: two accumulators, silu(gate) * up in the epilogue."""
  sizes, m, k, n = [5, 0, 12, 3], 20, 128, 128
  x, w_a, q_a = _operands(m, k, n, len(sizes), 32, seed=3)
  _, w_b, q_b = _operands(m, k, n, len(sizes), 32, seed=4)
  gate, up = (q_a, q_b) if fmt == "int4" else (w_a, w_b)
  gs = jnp.asarray(sizes, jnp.int32)
  t = Tuning(rows=16, block_n=64, block_k=64, stages=2, a_operand="smem")
  got = gated_grouped_matmul(x, gate, up, gs, backend="interpret", tuning=t)
  ref = lambda w: grouped_matmul_reference(x, w[0], gs, jnp.float32) if fmt == "bf16" else \
      int4_grouped_matmul_reference(x, *w, gs, jnp.float32)
  g, u = ref(gate), ref(up)
  _check(got, jax.nn.silu(g) * u, sum(sizes))


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_gated_split_k_interpret_matches_reference(fmt):
  """Gated call with split-K: gate and up partials from one call, summed and SiLU-multiplied."""
  sizes, m, k, n = [3, 0, 9], 13, 256, 64
  x, w_a, q_a = _operands(m, k, n, len(sizes), 32, seed=5)
  _, w_b, q_b = _operands(m, k, n, len(sizes), 32, seed=6)
  gate, up = (q_a, q_b) if fmt == "int4" else (w_a, w_b)
  gs = jnp.asarray(sizes, jnp.int32)
  t = Tuning(rows=16, block_n=64, block_k=64, stages=2, splits=2, a_operand="smem")
  got = gated_grouped_matmul(x, gate, up, gs, backend="interpret", tuning=t)
  _check(got, gated_grouped_matmul(x, gate, up, gs, backend="xla"), sum(sizes))


@pytest.mark.parametrize("t,k,e_l,e0", [(5, 3, 4, 2), (9, 8, 48, 0), (300, 8, 48, 0)])
def test_sorted_pair_layout_equals_stable_argsort(t, k, e_l, e0):
  """The comparison order (and the sort past COMPARE_SORT_MAX_PAIRS) == a stable argsort."""
  rng = np.random.default_rng(t)
  idx = np.stack([rng.permutation(64)[:k] for _ in range(t)]).astype(np.int32)
  order, rank, sizes, ends, mine = experts.sorted_pair_layout(jnp.asarray(idx), e_l, e0)
  local = idx.reshape(-1) - e0
  ok = (local >= 0) & (local < e_l)
  key = np.where(ok, local, e_l)
  want = np.argsort(key, kind="stable")
  np.testing.assert_array_equal(np.asarray(order), want)
  np.testing.assert_array_equal(np.asarray(rank)[want], np.arange(t * k))
  np.testing.assert_array_equal(np.asarray(sizes), np.bincount(key, minlength=e_l + 1)[:e_l])
  np.testing.assert_array_equal(np.asarray(mine), ok)
  np.testing.assert_array_equal(np.asarray(ends),
                                np.cumsum(np.bincount(key, minlength=e_l + 1)[:e_l]))


def test_expert_mlp_split_k_interpret_matches_xla():
  """Both calls on one work list, down with split-K partials, combined by the caller's sum."""
  sizes, m, d, f = [3, 0, 9, 2], 16, 256, 128
  x, _, gate = _operands(m, d, f, len(sizes), 32, seed=7)
  _, _, up = _operands(m, d, f, len(sizes), 32, seed=8)
  _, _, down = _operands(m, f, d, len(sizes), 32, seed=9)
  gs = jnp.asarray(sizes, jnp.int32)
  tg = Tuning(rows=16, block_n=64, block_k=64, stages=2, splits=2, slots=1, a_operand="smem")
  td = Tuning(rows=16, block_n=64, block_k=64, stages=2, splits=2, a_operand="smem")
  got = pallas_expert_mlp(x, gate, up, down, gs, backend="interpret", tunings=(tg, td))
  want = pallas_expert_mlp(x, gate, up, down, gs, backend="xla")
  assert got.shape == (2, m, d) and want.shape == (1, m, d)
  _check(got.sum(axis=0), want[0], sum(sizes))


def test_int4_reference_equals_dequantised_matmul_in_f32():
  x, _, (q, s) = _operands(50, 64, 128, 3, 32, seed=1)
  gs = jnp.asarray([10, 25, 15], jnp.int32)
  qn, sn = np.asarray(q, np.float32), np.asarray(s, np.float32)
  w = [qn[i].T * np.repeat(sn[i], 32, axis=0) for i in range(3)]  # [K, N] per expert
  want = np.concatenate([np.asarray(x[a:b], np.float32) @ w[i]
                         for i, (a, b) in enumerate([(0, 10), (10, 35), (35, 50)])])
  got = int4_grouped_matmul_reference(x.astype(jnp.float32), q, s, gs)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_expert_ffn_through_the_kernel_equals_xla_path():
  """The whole routed-expert FFN, INT4 and bf16: interpret-mode kernel == XLA (bf16 tolerance)."""
  t, e, k, d, f = 24, 6, 2, 128, 128
  ks = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
  idx = jnp.argsort(jax.random.uniform(ks[1], (t, e)), axis=1)[:, :k].astype(jnp.int32)
  w = jax.random.uniform(ks[2], (t, k), jnp.float32)
  mats = [int4.quantize(np.asarray(jax.random.normal(ks[3], s)) * 0.05)
          for s in [(e, d, f), (e, d, f), (e, f, d)]]
  dense = [int4.dequantize(m, jnp.bfloat16) for m in mats]
  for ws in (mats, dense):
    a = experts.expert_ffn(x, idx, w, *ws, impl="interpret")
    b = experts.expert_ffn(x, idx, w, *ws, impl="xla")
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-2


# The default GPU set (`pytest -m gpu`, issue 16's < 2 minutes; tests/GPU_TESTS.md): every kernel
# and every tuning branch a default run or a promoted default takes, once. bf16 / INT4 (register
# operand) plain calls: RAGGED with one tuning; gated INT4 fused (1 split) and bf16 split-K
# through the slots loop: RAGGED; the routed-expert FFN at K2.6's T=1 shape with the promoted
# tunings through both glues; expert_mlp with the T=16 and T=65 classes' promoted tunings on
# plain stacks (the model's layout under a mesh). With --gpu-full-grid: the old shape x path
# grid, and the cases whose branches the set above already compiles or that only an A/B takes
# (the SMEM operand, INT4 split-K without store_once, the lean options incl. dequant_batch 4,
# the promoted tunings on K-packed stacks: kpack's loads run in test_grouped_matmul_small_t).
RAGGED = ([30, 0, 50, 3, 10], 100, 1024, 256)  # empty groups, a 2-window expert, 8k+r rows
AR_SIZES = [1] * 8 + [0] * 40                  # one ar token: 8 experts of 48, one row each
K26_VERIFY = list(np.bincount(np.random.default_rng(2).integers(0, 48, 520), minlength=48))


def _ragged_tuning(fmt, **kw):
  """One tuning per format for RAGGED: 4 K steps (2 per split at splits=2)."""
  return Tuning(rows=32, block_n=64, block_k=256 if fmt == "int4" else 128, stages=2, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,a_operand", [("bf16", "registers"), ("int4", "registers"),
                                          full_grid("int4", "smem")])
def test_kernel_gpu_ragged_matches_reference(fmt, a_operand):
  """One call per operand path (a_operand: INT4 only) on ragged sizes. The SMEM operand (an A/B
  on a GPU: every default tuning takes registers there) with --gpu-full-grid."""
  sizes, m, k, n = RAGGED
  x, w_bf16, w_int4 = _operands(m, k, n, len(sizes), 32)
  ws = w_int4 if fmt == "int4" else w_bf16
  gs = jnp.asarray(sizes, jnp.int32)
  t = _ragged_tuning(fmt, a_operand=a_operand)
  _check(grouped_matmul(x, ws, gs, backend="pallas", tuning=t),
         grouped_matmul(x, ws, gs, backend="xla"), sum(sizes))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,splits,slots", [("int4", 1, 0), full_grid("int4", 2, 2),
                                               ("bf16", 2, 2)])
def test_gated_kernel_gpu_ragged_matches_reference(fmt, splits, slots):
  """gate and up in one call: the fused SiLU epilogue (1 split) or split-K partials with 2 CTA
  columns looping over the items. INT4 split-K here (no store_once: no default INT4 call) with
  --gpu-full-grid: its branches are bf16's split-K and INT4's fused case."""
  sizes, m, k, n = RAGGED
  x, w_a, q_a = _operands(m, k, n, len(sizes), 32, seed=3)
  _, w_b, q_b = _operands(m, k, n, len(sizes), 32, seed=4)
  gate, up = (q_a, q_b) if fmt == "int4" else (w_a, w_b)
  gs = jnp.asarray(sizes, jnp.int32)
  t = _ragged_tuning(fmt, splits=splits, slots=slots)
  _check(gated_grouped_matmul(x, gate, up, gs, backend="pallas", tuning=t),
         gated_grouped_matmul(x, gate, up, gs, backend="xla"), sum(sizes))


@pytest.mark.gpu
def test_expert_ffn_gpu_k26_ar_token_both_glues():
  """The routed-expert FFN at K2.6's T=1 shape (8 of 48 local INT4 experts, D 7168, F 2048),
  default tunings (gated split-K + slots loop, down split-K), sorted and dense glue (one
  compile pair shared: same shapes) == the f32 XLA FFN within bf16 rounding."""
  check_one_token_ffn_both_glues(48, 7168, 2048, "pallas")


def check_one_token_ffn_both_glues(e_l, d, f, impl, k=8, e=384):
  """One token routed to 6 of the e_l local INT4 experts and 2 elsewhere, through expert_ffn
  (sorted glue) and expert_ffn_dense (dense glue) on `impl` vs the f32 XLA FFN."""
  ks = jax.random.split(jax.random.key(3), 4)
  mats = [int4.random_int4(kk, s, 0.02) for kk, s in zip(ks[:3], [(e_l, d, f), (e_l, d, f),
                                                                   (e_l, f, d)])]
  x = jax.random.normal(ks[3], (1, d), jnp.bfloat16)
  local = [3, e_l - 8, 7, 11, e_l - 1, 0]
  idx = jnp.asarray([local[:3] + [e_l + 52] + local[3:] + [e - 1]], jnp.int32)
  w = jnp.linspace(0.05, 0.4, k, dtype=jnp.float32)[None]
  ref = experts.expert_ffn(x.astype(jnp.float32), idx, w,
                           *[int4.dequantize(m_, jnp.float32) for m_ in mats], impl="xla")
  rank = jnp.full((1, e), e, jnp.int32).at[0, idx[0]].set(jnp.arange(k, dtype=jnp.int32))
  scores = jnp.zeros((1, e), jnp.float32).at[0, idx[0]].set(w[0])  # weights = scores:
  weighting = experts.Weighting(k, norm=False, scale=1.0)
  both = jax.jit(lambda x, ms: (experts.expert_ffn(x, idx, w, *ms, impl=impl),
                                 experts.expert_ffn_dense(x, rank, scores, *ms, weighting,
                                                          impl=impl)))
  for got in both(x, mats):  # one jit: the kernels are lowered once for both glues
    assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 1e-2


@pytest.mark.gpu
@pytest.mark.gpu_full_grid
@pytest.mark.parametrize("fmt,a_operand", [("bf16", "registers"), ("int4", "registers"),
                                             ("int4", "smem")])  # a_operand: INT4 only
@pytest.mark.parametrize("sizes,m,k,n", [
    ([30, 0, 50, 3, 10], 100, 256, 256),
    ([7], 7, 128, 128),
    (K26_VERIFY, 520, 7168, 2048),      # a K2.6 verify step's experts on one of 8 GPUs
    (AR_SIZES, 8, 7168, 2048),          # one ar token
])
def test_kernel_gpu_full_grid(sizes, m, k, n, fmt, a_operand):
  """--gpu-full-grid: each shape x operand path with its default tuning, split-K 2, gated."""
  x, w_bf16, w_int4 = _operands(m, k, n, len(sizes), 32)
  ws = w_int4 if fmt == "int4" else w_bf16
  gs = jnp.asarray(sizes, jnp.int32)
  t = dataclasses.replace(default_tuning(m, len(sizes), k, n, fmt == "int4"), a_operand=a_operand)
  want = grouped_matmul(x, ws, gs, backend="xla")
  _check(grouped_matmul(x, ws, gs, backend="pallas", tuning=t), want, sum(sizes))
  if k % (2 * t.block_k) == 0:  # split-K over 2 (f32 partials), whatever the default chose
    t2 = dataclasses.replace(t, splits=2)
    _check(grouped_matmul(x, ws, gs, backend="pallas", tuning=t2), want, sum(sizes))
  gated = gated_grouped_matmul(x, ws, ws, gs, backend="pallas")
  _check(gated, gated_grouped_matmul(x, ws, ws, gs, backend="xla"), sum(sizes))


def test_bad_input_errors():
  x, (w,), (q, s) = _operands(8, 64, 128, 2, 32)
  gs = jnp.asarray([4, 4], jnp.int32)
  with pytest.raises(ValueError, match="int4"):
    grouped_matmul(x, (q.astype(jnp.int8), s), gs)
  with pytest.raises(ValueError, match="disagree on K"):
    grouped_matmul(x[:, :32], (w,), gs)
  with pytest.raises(ValueError, match="group_sizes"):
    grouped_matmul(x, (w,), gs[:1])
  with pytest.raises(ValueError, match="backend"):
    grouped_matmul(x, (w,), gs, backend="triton")
  assert grouped_matmul_reference(x, w, gs).shape == (8, 128)


# The options of issue 12's decode-shape analysis (store_once, items_smem, dequant_batch):
# interpret mode on ragged sizes (gated split-K through the slots loop, and plain), lowering for
# an abstract H200 at K2.6's shapes, and on the GPU. Interpret mode runs the SMEM-operand path
# only and ignores swizzles, so an option that changes the register operand or an SMEM layout
# needs its GPU test (the removed 32-column pieces passed here and were wrong on the H200).
LEAN = dict(store_once=True, items_smem=True)


@pytest.mark.slow
@pytest.mark.parametrize("opts", [dict(store_once=True), dict(items_smem=True),
                                  dict(LEAN, dequant_batch=2), dict(LEAN, dequant_batch=4),
                                  dict(LEAN, int4_scale_concat=True)])
def test_fixed_cost_options_interpret_match_reference(opts):
  sizes, m, k, n = [30, 0, 50, 3, 10], 100, 512, 128
  x, _, q_a = _operands(m, k, n, len(sizes), 32, seed=12)
  _, _, q_b = _operands(m, k, n, len(sizes), 32, seed=13)
  gs = jnp.asarray(sizes, jnp.int32)
  t = Tuning(rows=32, block_n=64, block_k=256, stages=2, a_operand="smem", **opts)
  _check(grouped_matmul(x, q_a, gs, backend="interpret", tuning=t),
         grouped_matmul(x, q_a, gs, backend="xla"), sum(sizes))
  t = dataclasses.replace(t, splits=2, slots=2)
  _check(gated_grouped_matmul(x, q_a, q_b, gs, backend="interpret", tuning=t),
         gated_grouped_matmul(x, q_a, q_b, gs, backend="xla"), sum(sizes))


def test_scale_splits_spreads_one_expert_over_more_ctas():
  """T=1 gated K2.6 call: default 7 splits (224 CTAs) -> 14 at x2, 28 at x4, slots >= 1;
  T=16 (no split by default) -> 2 with slots for ~2 CTAs per SM; factors past the K steps cap.
  (The base tunings: variant 'default'.)"""
  t1 = default_tuning(8, 48, 7168, 2048, True, gated=True, variant="default")
  assert (t1.splits, t1.slots) == (7, 1)
  assert [scale_splits(t1, 7168, 2048, f).splits for f in (2, 4, 8)] == [14, 28, 28]
  t16 = default_tuning(128, 48, 7168, 2048, True, gated=True, variant="default")
  x2 = scale_splits(t16, 7168, 2048, 2)
  assert (t16.splits, x2.splits, x2.slots) == (1, 2, 4)
  down = scale_splits(default_tuning(8, 48, 2048, 7168, True, variant="default"), 2048, 7168, 4)
  assert (down.splits, down.slots) == (8, 1)


def test_apply_variant_parses_every_change():
  t = default_tuning(128, 48, 7168, 2048, True, gated=True, variant="default")
  v = apply_variant("once+ismem+dq4+k512+s3+r32+cat+kp", t, 7168, 2048)
  assert (v.store_once, v.items_smem, v.dequant_batch, v.block_k, v.stages, v.rows,
          v.int4_scale_concat, v.int4_k_packed) == (True, True, 4, 512, 3, 32, True, True)
  assert apply_variant("default", t, 7168, 2048) == t
  c4 = apply_variant("x4c4", t, 7168, 2048)
  assert (c4.splits, c4.slots) == (4, 4)  # 4 x 132 CTAs // (32 N tiles x 4 splits)
  w4 = apply_variant("w4", t, 7168, 2048)
  assert (w4.splits, w4.slots) == (1, 16)  # T=16: 512 CTAs looping over 56 items
  with pytest.raises(ValueError, match="unknown"):
    apply_variant("once+fast", t, 7168, 2048)


def test_default_variants_promote_per_row_count():
  """default_tuning gives INT4 calls DEFAULT_VARIANTS' entry for their M, the gated and the down
  call their own half of a 'GATED|DOWN' name: T=1 (M 8) fixed-cost options, gate|up in 8 splits
  of K 128 with interleaved stacks and two accumulator chains, down in 4 splits; T=2..32 (M
  9..263, R = 8 since s27: the T=13..32 class's R 16 merged into the T=9 class) gate|up unsplit
  (since s29; SiLU in the kernel) with il+a2 in 8 slot columns, down unsplit at block_n 128 in
  9 slot columns of its 56 N tiles (~4 CTAs per SM) with two chains; T=33..65 (M 264..520)
  R = 8 in a persistent grid, gate|up on 3 stages, down on 2 with two chains; larger M
  (prefill) the base; bf16 calls and variant='default' the base."""
  d, f = 7168, 2048
  base = lambda m, k, n, **kw: default_tuning(m, 48, k, n, True, variant="default", **kw)
  t1 = ("once+ismem+cat+il+a2+k128+p8", "once+ismem+cat+a2+p4")
  t9 = ("once+ismem+s2+cat+il+a2+r8+w2", "once+ismem+cat+n128+s2+r8+w4+a2")
  t65 = ("once+ismem+r8+s3+w16+cat", "once+ismem+r8+s2+w16+cat+a2")
  want = {8: t1, 9: t9, 72: t9, 96: t9, 97: t9, 128: t9, 263: t9, 264: t65, 520: t65,
          521: ("default",) * 2, 4096: ("default",) * 2}
  for m, (gated_name, down_name) in want.items():
    assert tuning_module.promoted_variant(m, gated=True) == gated_name, m
    assert tuning_module.promoted_variant(m) == down_name, m
    assert default_tuning(m, 48, d, f, True, gated=True) == \
        apply_variant(gated_name, base(m, d, f, gated=True), d, f), m
    assert default_tuning(m, 48, f, d, True) == apply_variant(down_name, base(m, f, d), f, d), m
  g1, d1 = default_tuning(8, 48, d, f, True, gated=True), default_tuning(8, 48, f, d, True)
  assert (g1.store_once, g1.items_smem, g1.splits, g1.stages, g1.block_k) == (True, True, 8, 4, 128)
  assert g1.int4_interleave_stacks and g1.int4_acc_chains == 2 and d1.int4_acc_chains == 2
  assert g1.int4_scale_concat and not g1.int4_k_packed  # kp follows the weights (api k_packed)
  g16, d16 = default_tuning(128, 48, d, f, True, gated=True), default_tuning(128, 48, f, d, True)
  assert (g16.splits, g16.slots, g16.stages, g16.rows) == (1, 8, 2, 8)
  assert (d16.splits, d16.slots, d16.stages, d16.rows, d16.block_n) == (1, 9, 2, 8, 128)
  assert default_tuning(8, 48, f, d, True).splits == 4
  g65 = default_tuning(520, 48, d, f, True, gated=True)
  assert (g65.rows, g65.stages, g65.splits, g65.items_smem) == (8, 3, 1, True)
  for m in (8, 72, 128, 520):  # gated and down calls of one work list share R
    assert default_tuning(m, 48, d, f, True, gated=True).rows == default_tuning(m, 48, f, d,
                                                                               True).rows
    assert default_tuning(m, 48, d, f, False) == default_tuning(m, 48, d, f, False,
                                                                variant="default")
  assert tuning_module.DEFAULT_VARIANTS[-1][0] is None  # every M has an entry


def test_default_tuning_takes_every_row_class_at_shapes_the_kernel_does_not_take():
  """Every DEFAULT_VARIANTS entry applies at a K below one 64-column block (the small models'
  INT4 experts run the XLA path there): no error, the split count left as the base's (1)."""
  for max_rows, _, _ in tuning_module.DEFAULT_VARIANTS:
    m = max_rows or 4096
    for k, n in ((32, 64), (48, 128), (96, 64)):
      t = default_tuning(m, 4, k, n, True, gated=True)
      assert t.splits == default_tuning(m, 4, k, n, True, gated=True, variant="default").splits
    for k, n in ((128, 128), (256, 128), (384, 64), (128, 32)):  # 1-3 K steps, N below a tile
      for gated in (True, False):
        t = default_tuning(m, 4, k, n, True, gated=gated)
        assert (k // t.block_k) % t.splits == 0, (m, k, n, gated, t)


def test_gated_and_plain_calls_take_their_own_variant(monkeypatch):
  """'GATED|PLAIN' names each call's variant (the bench's per-call times can promote each); a
  name without '|' is both calls'; two '|' are an error."""
  assert tuning_module.call_variant("once+r8|r8+s2", True) == "once+r8"
  assert tuning_module.call_variant("once+r8|r8+s2", False) == "r8+s2"
  assert tuning_module.call_variant("once", False) == "once"
  with pytest.raises(ValueError, match="at most one"):
    tuning_module.call_variant("a|b|c", True)
  monkeypatch.setattr(tuning_module, "DEFAULT_VARIANTS", ((None, "once+r8+s2|ismem+r8", "test"),))
  gated = default_tuning(520, 48, 7168, 2048, True, gated=True)
  plain = default_tuning(520, 48, 2048, 7168, True)
  assert (gated.store_once, gated.items_smem, gated.stages, gated.rows) == (True, False, 2, 8)
  assert (plain.store_once, plain.items_smem, plain.stages, plain.rows) == (False, True, 4, 8)
  # pylint: disable-next=import-outside-toplevel
  from pallas_kernels.grouped_matmul import bench
  assert bench.mlp_tunings("once+r8+s2|ismem+r8", 520, 48, 7168, 2048) == (gated, plain)


# Each promoted tuning at its row class (T tokens x top-8 rows over 48 local experts, ~T local
# rows spread over the experts touched) on a small D / F in interpret mode: both calls of
# expert_mlp on one work list vs the dequantise-first XLA reference (bf16 tolerance).
PROMOTED_CLASSES = [(1, 1), (9, 8), (16, 4), (65, 36)]  # (T, experts touched), as bench mlp_tune


def _class_sizes(t, touched, e_l=48):
  sizes = np.zeros(e_l, np.int32)
  where = np.linspace(0, e_l - 1, touched).round().astype(int)
  sizes[where] = t // touched
  sizes[where[:t % touched]] += 1
  return jnp.asarray(sizes)


@pytest.mark.slow
@pytest.mark.parametrize("t,touched", PROMOTED_CLASSES)
def test_promoted_tunings_interpret_match_reference(t, touched):
  e_l, d, f = 48, 512, 256
  m = 8 * t
  gs = _class_sizes(t, touched)
  x, _, gate = _operands(m, d, f, e_l, 32, seed=20)
  _, _, up = _operands(m, d, f, e_l, 32, seed=21)
  _, _, down = _operands(m, f, d, e_l, 32, seed=22)
  tg = default_tuning(m, e_l, d, f, True, interpret=True, gated=True)
  td = default_tuning(m, e_l, f, d, True, interpret=True)
  gated_name, down_name = (tuning_module.promoted_variant(m, gated=g) for g in (True, False))
  assert tg == apply_variant(gated_name, default_tuning(m, e_l, d, f, True, interpret=True,
                                                        gated=True, variant="default"), d, f)
  assert td == apply_variant(down_name, default_tuning(m, e_l, f, d, True, interpret=True,
                                                       variant="default"), f, d)
  got = pallas_expert_mlp(x, gate, up, down, gs, backend="interpret", tunings=(tg, td))
  want = pallas_expert_mlp(x, gate, up, down, gs, backend="xla")
  _check(got.sum(axis=0), want[0], int(gs.sum()))


def _lower_expert_mlp_h200(m, tunings, e_l=48, d=7168, f=2048):
  """expert_mlp's two kernels at K2.6's INT4 shapes lowered for an abstract H200 (CPU host)."""
  sd = jax.ShapeDtypeStruct
  stack = lambda n, k: (sd((e_l, n, k), jnp.int4), sd((e_l, k // 32, n), jnp.bfloat16))
  fn = lambda x, g, u, dn, s: pallas_expert_mlp(x, g, u, dn, s, backend="pallas",
                                                tunings=tunings)
  h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h200)):
    return jax.jit(fn).trace(sd((m, d), jnp.bfloat16), stack(f, d), stack(f, d), stack(d, f),
                             sd((e_l,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()


def _bench_tunings(name, m, e_l=48, d=7168, f=2048):
  """An mlp_tune row's (gated, down) tunings, as the bench makes them."""
  # pylint: disable-next=import-outside-toplevel
  from pallas_kernels.grouped_matmul import bench
  return bench.mlp_tunings(name, m, e_l, d, f)


def test_lean_options_lower_for_h200():
  text = _lower_expert_mlp_h200(8, _bench_tunings("once+ismem+dq4+x2", 8))
  assert "gmm_int4_gated_mosaic_gpu" in text and "gmm_int4_mosaic_gpu" in text  # both calls


def test_k_packing_matches_the_register_relabel():
  """pack_int4_k's column table vs the relabel kpack.relabel_registers does, from the two
  layouts' column formulas (jax 0.11.2 fragmented_array: WGMMA (64, 8) tiles, 2-vectors, lane
  % 4 across; WGMMA_UPCAST_4X (64, 32) tiles, 8-vectors): WGMMA register i, piece e of lane l
  (column 8i + 2l + e) is piece i % 4 of UPCAST_4X word i // 4 of the same lane (storage column
  32 (i // 4) + 8l + 2 (i % 4) + e), and a 32-column scale group stays in its half."""
  assert sorted(kpack.STORED_COLUMN) == list(range(64))
  for lane, i, e in np.ndindex(4, 8, 2):
    storage = 32 * (i // 4) + 8 * lane + 2 * (i % 4) + e
    assert kpack.STORED_COLUMN[storage] == 8 * i + 2 * lane + e
  assert (kpack.STORED_COLUMN // 32 == np.arange(64) // 32).all()
  q = jnp.asarray(np.arange(2 * 128) % 16 - 8, jnp.int4).reshape(2, 128)
  packed = np.asarray(kpack.pack_int4_k(q), np.int32)
  np.testing.assert_array_equal(packed[:, 64 + kpack.STORAGE_OF], np.asarray(q, np.int32)[:, 64:])
  np.testing.assert_array_equal(kpack.logical_order(packed[:, :64]),
                                np.asarray(q, np.int32)[:, :64])


@pytest.mark.parametrize("gated", [False, True])
def test_k_packed_weights_interpret_match_reference(gated):
  """Tuning.int4_k_packed on pack_int4_k'd stacks == the reference on the stacks as stored
  (interpret mode: the gather emulation of the relabel; the relabel itself is the GPU test's)."""
  sizes, m, k, n = [30, 0, 50, 3, 10], 100, 256, 128
  x, _, (q_a, s_a) = _operands(m, k, n, len(sizes), 32, seed=14)
  _, _, (q_b, s_b) = _operands(m, k, n, len(sizes), 32, seed=15)
  gs = jnp.asarray(sizes, jnp.int32)
  t = Tuning(rows=32, block_n=64, block_k=128, stages=2, a_operand="smem", int4_k_packed=True,
             store_once=True, items_smem=True)
  pa, pb = (kpack.pack_int4_k(q_a), s_a), (kpack.pack_int4_k(q_b), s_b)
  if gated:
    t = dataclasses.replace(t, splits=2, slots=2)
    got = gated_grouped_matmul(x, pa, pb, gs, backend="interpret", tuning=t)
    want = gated_grouped_matmul(x, (q_a, s_a), (q_b, s_b), gs, backend="xla")
  else:
    got = grouped_matmul(x, pa, gs, backend="interpret", tuning=t)
    want = grouped_matmul(x, (q_a, s_a), gs, backend="xla")
  _check(got, want, sum(sizes))


def _module_op_counts(m, tunings):
  """Op counts of the Mosaic modules of expert_mlp's two calls lowered for an H200 (summed)."""
  # pylint: disable=import-outside-toplevel
  from jax._src.interpreters import mlir as jax_mlir
  from jax.experimental.mosaic.gpu import dialect as mgpu_dialect
  core.KNOWN_KERNELS.clear()
  jax.clear_caches()  # a cached lowering would not register its modules again
  _lower_expert_mlp_h200(m, tunings, d=512, f=256)
  assert len(core.KNOWN_KERNELS) == 2, len(core.KNOWN_KERNELS)  # gated + down
  counts = collections.Counter()
  ctx = jax_mlir._create_ir_context()  # pylint: disable=protected-access
  with ctx, ir.Location.unknown():
    mgpu_dialect.register_dialect(ctx)  # as Mosaic's own lowering context does
    ctx.append_dialect_registry(jax_mlir.upstream_dialects)
    ctx.load_all_available_dialects()
    ctx.allow_unregistered_dialects = True  # the serialised ops: stable_mosaic_gpu.*
    for module_bytes in core.KNOWN_KERNELS.values():
      module = core._run_serde_pass(  # pylint: disable=protected-access
          ir.Module.parse(module_bytes), serialize=False)  # kept alive while walked
      stack = [module.operation]
      while stack:
        for region in stack.pop().regions:
          for block in region:
            for op in block:
              counts[op.operation.name] += 1
              if op.operation.name == "llvm.inline_asm":  # wgmma, its waits: by instruction
                asm = ir.StringAttr(op.operation.attributes["asm_string"]).value.split()
                counts["asm:" + (asm[0] if asm else "")] += 1
              stack.append(op.operation)
  return counts


def test_dequant_options_cut_the_lowered_ops_per_chunk():
  """Per thread and [64, 64] chunk (32 values, 2 per register) in the lowered modules:
  int4_scale_concat drops the 16 selects (and their 16 compares) of a chunk's scales, same
  multiplies; int4_k_packed replaces the 16 one-byte tile loads (and their 16 sign extends) by
  one ldmatrix (4 words). Modules: gated (2 stacks) + down, one K step of 4 chunks each."""
  t = Tuning(rows=8, block_n=64, block_k=256, stages=2)
  base, cat, kp = (_module_op_counts(8, (dataclasses.replace(t, **kw),) * 2) for kw in (
      {}, dict(int4_scale_concat=True), dict(int4_k_packed=True)))
  chunks = 2 * 256 // 64 + 256 // 64
  assert base["arith.select"] - cat["arith.select"] == 16 * chunks
  assert base["arith.cmpi"] - cat["arith.cmpi"] == 16 * chunks
  assert base["arith.mulf"] == cat["arith.mulf"] == kp["arith.mulf"] >= 16 * chunks
  assert base["llvm.load"] - kp["llvm.load"] == 16 * chunks
  assert base["arith.extsi"] - kp["arith.extsi"] == 16 * chunks
  assert (base["nvvm.ldmatrix"], kp["nvvm.ldmatrix"]) == (0, chunks)


@pytest.mark.slow
def test_bench_mlp_variants_lower_for_h200():
  """Every mlp_tune row the bench times (default --mlp_variants x --mlp_cases) lowers: the GPU
  run spends no time on one that cannot compile."""
  # pylint: disable-next=import-outside-toplevel
  from pallas_kernels.grouped_matmul import bench
  rows = 0
  for case in bench._MLP_CASES.default:  # pylint: disable=protected-access
    t = int(case.split(":")[0])
    for name in bench.case_rows(t):
      assert "mosaic_gpu" in _lower_expert_mlp_h200(8 * t, _bench_tunings(name, 8 * t)), (t, name)
      rows += 1
  assert rows <= 18  # one compile each: moe_tune stays inside its ~300 s (WORKSPACE queue)


@pytest.mark.gpu
@pytest.mark.gpu_full_grid
@pytest.mark.parametrize("opts", [dict(LEAN, dequant_batch=4),
                                  dict(LEAN, int4_scale_concat=True, int4_k_packed=True),
                                  dict(LEAN, int4_scale_concat=True, int4_k_packed=True,
                                       int4_interleave_stacks=True, int4_acc_chains=2)])
def test_gated_kernel_gpu_lean_options_match_reference(opts):
  """store_once + items_smem + dequant_batch 4 (or the select-free scales, or those + K-packed
  weights through 32-bit loads relabelled as registers: the register operand, which interpret
  mode cannot run; or those + gate and up interleaved over two accumulators each) on the GPU:
  gated split-K with the slots loop. --gpu-full-grid: the promoted tunings' cases compile these
  branches (dequant_batch 4: no default tuning takes it)."""
  sizes, m, k, n = RAGGED
  x, _, q_a = _operands(m, k, n, len(sizes), 32, seed=3)
  _, _, q_b = _operands(m, k, n, len(sizes), 32, seed=4)
  gs = jnp.asarray(sizes, jnp.int32)
  t = _ragged_tuning("int4", splits=2, slots=2, **opts)
  pack = kpack.pack_int4_k if t.int4_k_packed else lambda q: q
  packed_a, packed_b = (pack(q_a[0]), q_a[1]), (pack(q_b[0]), q_b[1])
  _check(gated_grouped_matmul(x, packed_a, packed_b, gs, backend="pallas", tuning=t),
         gated_grouped_matmul(x, q_a, q_b, gs, backend="xla"), sum(sizes))


def test_k_packed_stacks_follow_into_the_tuning_and_the_reference():
  """K-packed INT4 stacks (kpack.pack_int4_k) with k_packed=True: the kernel (interpret, the
  promoted T=16 class: gated split-K through the slots loop) and the XLA path give the
  unpacked stacks' dequantise-first reference (XLA: exactly, the permutation undone); the
  chosen tuning reads them K-packed; k_packed on bf16 stacks is an error."""
  e_l, d, f, t = 8, 256, 128, 16
  m = 8 * t
  gs = _class_sizes(t, 4, e_l)
  x, (w_bf16,), gate = _operands(m, d, f, e_l, 32, seed=30)
  _, _, up = _operands(m, d, f, e_l, 32, seed=31)
  _, _, down = _operands(m, f, d, e_l, 32, seed=32)
  packed = [(kpack.pack_int4_k(q), s) for q, s in (gate, up, down)]
  want = pallas_expert_mlp(x, gate, up, down, gs, backend="xla")[0]
  xla = pallas_expert_mlp(x, *packed, gs, backend="xla", k_packed=True)[0]
  np.testing.assert_array_equal(np.asarray(xla), np.asarray(want))
  got = pallas_expert_mlp(x, *packed, gs, backend="interpret", k_packed=True)
  _check(got.sum(axis=0), want, int(gs.sum()))
  tg = default_tuning(m, e_l, d, f, True, interpret=True, gated=True)
  assert not tg.int4_k_packed  # the tuning alone does not say; the call's k_packed does
  with pytest.raises(ValueError, match="k_packed is for INT4"):
    grouped_matmul(x, (w_bf16,), gs, backend="xla", k_packed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("k_packed", [False, full_grid(True)])
@pytest.mark.parametrize("t,touched", [(9, 8), (16, 4), (65, 36)])
def test_expert_mlp_gpu_promoted_tunings_k26(t, touched, k_packed):
  """expert_mlp at K2.6's INT4 shapes (48 local experts, D 7168, F 2048) with the promoted
  default tunings of the T=2..32 class at T=9 on 8 experts and T=16 on 4 (s2+il+a2+r8+w2:
  gate|up unsplit with the SiLU in its epilogue, 8 slot columns; down at block_n 128) and the
  T=65 class (R = 8, 2 stages), on plain or K-packed stacks (int4.pack_k, as the decode layout
  holds them) == the f32 dequantise-first XLA path on the plain stacks within bf16 rounding
  (T=1's is test_expert_ffn_gpu_k26_ar_token_both_glues). K-packed stacks with --gpu-full-grid
  (the same tunings; kpack's and kpairs' loads: test_grouped_matmul_small_t)."""
  e_l, d, f, m = 48, 7168, 2048, 8 * t
  gs = _class_sizes(t, touched)
  ks = jax.random.split(jax.random.key(t), 4)
  stacks = [int4.random_int4(kk, s, 0.02)
            for kk, s in zip(ks[:3], [(e_l, d, f), (e_l, d, f), (e_l, f, d)])]
  gate, up, down = [(w.packed, w.scale) for w in stacks]
  x = jax.random.normal(ks[3], (m, d), jnp.bfloat16)
  run = [(w.packed, w.scale) for w in map(int4.pack_k, stacks)] if k_packed else [gate, up, down]
  got = pallas_expert_mlp(x, *run, gs, backend="pallas", k_packed=k_packed).sum(axis=0)
  want = pallas_expert_mlp(x, gate, up, down, gs, backend="xla")[0]
  live = int(gs.sum())
  assert float(jnp.linalg.norm(got[:live] - want[:live]) / jnp.linalg.norm(want[:live])) < 1e-2


def _mlp_row(name, us, rel_err, t=1):
  return dict(part="mlp_tune", fmt="int4", tuning=name, T=t, experts_touched=1, us=us,
              tbps=1.0, pct_copy=20.0, gmm_int4_gated_us=us / 2, gmm_int4_us=us / 3,
              x_floor=4.0, bound_us=20.9, rel_err=rel_err)


def test_bench_marks_wrong_rows_fail_and_never_fastest(capsys):
  """A row off the f32 reference by more than bf16 rounding is FAIL in the table and in the
  summary, and never the fastest, however fast (the s5 `half` rows: rel_err 1.0)."""
  # pylint: disable-next=import-outside-toplevel
  from pallas_kernels.grouped_matmul import bench
  rows = [_mlp_row("promoted", 26.6, 2.7e-5), _mlp_row("wrong", 9.0, 1.0),
          _mlp_row("nan", 8.0, float("nan")), _mlp_row("x2", 27.2, 4.4e-6)]
  assert [bench.failed(r) for r in rows] == [False, True, True, False]
  for key in ("us", "gmm_int4_gated_us", "gmm_int4_us"):
    assert bench.fastest(rows, key)["tuning"] == "promoted"
  bench._table(rows)  # pylint: disable=protected-access
  bench._mlp_summary(rows)  # pylint: disable=protected-access
  lines = capsys.readouterr().out.splitlines()
  marked = [ln.split()[2] for ln in lines if ln.startswith("mlp_tune int4") and "FAIL" in ln]
  assert marked == ["wrong", "nan"]
  assert any("FAIL wrong" in ln for ln in lines) and any("FAIL nan" in ln for ln in lines)
  assert not any("fastest" in ln and ("wrong" in ln or "nan" in ln) for ln in lines)


# Issue 12, small T (moe9): gate and up chunks dequantised together (int4_interleave_stacks,
# variant il) and the split count set exactly (pN: CTAs that fill the SMs evenly), nBN.
@pytest.mark.parametrize("batch", [1, 2])
def test_interleaved_stacks_interpret_match_reference(batch):
  """Tuning.int4_interleave_stacks on gated calls (fused SiLU epilogue, and split-K partials
  through the slots loop; interpret mode's SMEM-operand buffers per stack and batch) == the
  dequantise-first reference; on a plain call it changes nothing."""
  sizes, m, k, n = [30, 0, 50, 3, 10], 100, 256, 128
  x, _, q_a = _operands(m, k, n, len(sizes), 32, seed=16)
  _, _, q_b = _operands(m, k, n, len(sizes), 32, seed=17)
  gs = jnp.asarray(sizes, jnp.int32)
  t = Tuning(rows=32, block_n=64, block_k=128, stages=2, a_operand="smem", dequant_batch=batch,
             int4_interleave_stacks=True, **LEAN)
  want = gated_grouped_matmul(x, q_a, q_b, gs, backend="xla")
  for tun in (t, dataclasses.replace(t, splits=2, slots=2)):
    _check(gated_grouped_matmul(x, q_a, q_b, gs, backend="interpret", tuning=tun), want,
           sum(sizes))
  _check(grouped_matmul(x, q_a, gs, backend="interpret", tuning=t),
         grouped_matmul(x, q_a, gs, backend="xla"), sum(sizes))


@pytest.mark.parametrize("opts", [dict(int4_acc_chains=2), dict(int4_acc_chains=2, dequant_batch=2),
                                  dict(int4_acc_chains=2, int4_interleave_stacks=True)])
def test_acc_chains_interpret_match_reference(opts):
  """Tuning.int4_acc_chains = 2 (chunks alternating over two accumulators per stack, summed in
  the epilogue; alone, with 2-chunk batches, with interleaved stacks): plain, gated fused and
  gated split-K through the slots loop == the dequantise-first reference."""
  sizes, m, k, n = [30, 0, 50, 3, 10], 100, 512, 128
  x, _, q_a = _operands(m, k, n, len(sizes), 32, seed=18)
  _, _, q_b = _operands(m, k, n, len(sizes), 32, seed=19)
  gs = jnp.asarray(sizes, jnp.int32)
  t = Tuning(rows=32, block_n=64, block_k=256, stages=2, a_operand="smem", **LEAN, **opts)
  _check(grouped_matmul(x, q_a, gs, backend="interpret", tuning=t),
         grouped_matmul(x, q_a, gs, backend="xla"), sum(sizes))
  want = gated_grouped_matmul(x, q_a, q_b, gs, backend="xla")
  for tun in (t, dataclasses.replace(t, splits=2, slots=2)):
    _check(gated_grouped_matmul(x, q_a, q_b, gs, backend="interpret", tuning=tun), want,
           sum(sizes))


def test_acc_chains_need_two_chunks_per_step():
  with pytest.raises(ValueError, match="acc_chains"):
    Tuning(block_k=64, int4_acc_chains=2)
  with pytest.raises(ValueError, match="acc_chains"):
    Tuning(int4_acc_chains=3)
  t = default_tuning(8, 48, 2048, 7168, True, variant="default")
  assert apply_variant("a2+il", t, 2048, 7168).int4_acc_chains == 2


def test_interleaved_stacks_wait_once_per_chunk_pair():
  """Lowered for an H200 (gated + down modules, one K step of 4 chunks each): interleaving
  keeps every wgmma and drops the gated call's per-stack waits (2 x (4 + 1) -> 4 + 1)."""
  t = Tuning(rows=8, block_n=64, block_k=256, stages=2, int4_scale_concat=True)
  base, il = (_module_op_counts(8, (dataclasses.replace(t, int4_interleave_stacks=v), t))
              for v in (False, True))
  commit, wait = "asm:wgmma.commit_group.sync.aligned;", "asm:wgmma.wait_group.sync.aligned"
  assert base[commit] == il[commit] == 3 * 4  # one group per chunk: gate, up, down
  assert base["asm:{"] == il["asm:{"]  # the wgmma (and other multi-line asm) bodies
  # + one per accumulator outside the K steps (3: gate, up, down)
  assert (base[wait], il[wait]) == (2 * 5 + 5 + 3, 5 + 5 + 3)
  # int4_acc_chains 2 on both calls: 2 rounds of 2 chunks + the drain per stack and step
  a2 = _module_op_counts(8, (dataclasses.replace(t, int4_acc_chains=2),) * 2)
  assert a2[commit] == base[commit] and a2["asm:{"] == base["asm:{"]
  assert a2[wait] == 2 * 3 + 3 + 6


def test_set_splits_fills_the_sms_evenly():
  """pN: exactly N splits (T=1 gated at block_k 128: 8 splits x 32 N tiles = 256 CTAs, slots
  1); a count that does not divide the K steps takes the largest divisor below it (p8 of 28
  steps: 7; the small models' one-step K: 1); nBN sets block_n before it."""
  t = default_tuning(8, 48, 7168, 2048, True, gated=True, variant="default")
  p8 = apply_variant("once+ismem+cat+kp+il+k128+p8", t, 7168, 2048)
  assert (p8.block_k, p8.splits, p8.slots, p8.int4_interleave_stacks) == (128, 8, 1, True)
  assert (32 * p8.splits * p8.slots) == 256
  n128 = apply_variant("n128+k128+p8c1", t, 7168, 2048)
  assert (n128.block_n, n128.splits, n128.slots) == (128, 8, 1)
  assert apply_variant("p1", t, 7168, 2048).splits == 1
  assert apply_variant("p8", t, 7168, 2048).splits == 7  # 28 K steps of 256
  assert apply_variant("k128+p4", t, 128, 2048).splits == 1  # one K step
  assert apply_variant("p8", t, 48, 2048) == t  # a K the kernel does not take: unchanged


# Tuning.narrow_rows (variant nrN): R 16 work items whose stored rows fit the first 8 rows of
# their window run a second compiled path with an 8-row x tile and wgmma N 8. The sizes give
# items of both paths: 1-5 rows at lo 0-4 (narrow, one ending exactly at row 8), 9-15 rows
# (R), an expert of 20 rows over two windows (R, then a 5-row narrow item), empty experts.
NARROW_SIZES = [2, 0, 1, 5, 12, 0, 3, 9, 1, 20]  # 53 rows, M 56


def _narrow_items(sizes, rows, narrow):
  """(narrow items, R items) of the brute-force work list."""
  items = _items_brute_force(sizes, rows)
  small = sum(lo + size <= narrow for _, _, lo, size in items)
  return small, len(items) - small


def test_narrow_rows_sizes_take_both_paths():
  assert _narrow_items(NARROW_SIZES, 16, 8) == (6, 3)


@pytest.mark.parametrize("fmt", ["int4", "bf16"])
def test_narrow_rows_interpret_match_reference(fmt):
  """narrow_rows 8 under R 16: plain, gated fused and gated split-K through the slots loop (INT4;
  bf16: plain) == the XLA reference on every stored row."""
  sizes, m, k, n = NARROW_SIZES, 56, 256, 128
  x, w_a, q_a = _operands(m, k, n, len(sizes), 32, seed=21)
  gs = jnp.asarray(sizes, jnp.int32)
  t = Tuning(rows=16, narrow_rows=8, block_n=64, block_k=128, stages=2, a_operand="smem", **LEAN)
  ws = q_a if fmt == "int4" else w_a
  _check(grouped_matmul(x, ws, gs, backend="interpret", tuning=t),
         grouped_matmul(x, ws, gs, backend="xla"), sum(sizes))
  if fmt == "bf16":
    return
  _, _, q_b = _operands(m, k, n, len(sizes), 32, seed=22)
  want = gated_grouped_matmul(x, q_a, q_b, gs, backend="xla")
  for tun in (t, dataclasses.replace(t, splits=2, slots=2)):
    _check(gated_grouped_matmul(x, q_a, q_b, gs, backend="interpret", tuning=tun), want,
           sum(sizes))


def test_narrow_rows_compile_a_second_item_path():
  """Lowered for an H200: narrow_rows adds one pipeline per call, so every wgmma (a K step's 4
  chunks per stack) appears twice; the narrow path's are N 8, the R path's N 16."""
  t = Tuning(rows=16, block_n=64, block_k=256, stages=2, int4_scale_concat=True)
  base, nr = (_module_op_counts(16, (dataclasses.replace(t, narrow_rows=v),) * 2)
              for v in (0, 8))
  commit = "asm:wgmma.commit_group.sync.aligned;"
  assert (base[commit], nr[commit]) == (3 * 4, 2 * 3 * 4)


def test_narrow_rows_parse_and_check():
  t = default_tuning(72, 48, 7168, 2048, True, gated=True, variant="default")
  v = apply_variant("r16+nr8", t, 7168, 2048)
  assert (v.rows, v.narrow_rows) == (16, 8)
  for bad in ("r16+nr16", "r16+nr4", "r8+nr8"):
    with pytest.raises(ValueError, match="narrow_rows"):
      apply_variant(bad, t, 7168, 2048)


@pytest.mark.gpu
def test_gated_kernel_gpu_narrow_rows_match_reference():
  """narrow_rows 8 under R 16 on the GPU, the register operand and K-packed weights (what
  interpret mode cannot run): gated fused, then the down-style plain call, both paths taken."""
  sizes, m, k, n = NARROW_SIZES, 56, 1024, 256
  x, _, q_a = _operands(m, k, n, len(sizes), 32, seed=23)
  _, _, q_b = _operands(m, k, n, len(sizes), 32, seed=24)
  gs = jnp.asarray(sizes, jnp.int32)
  t = Tuning(rows=16, narrow_rows=8, block_n=64, block_k=256, stages=2, int4_scale_concat=True,
             int4_k_packed=True, **LEAN)
  packed_a, packed_b = (kpack.pack_int4_k(q_a[0]), q_a[1]), (kpack.pack_int4_k(q_b[0]), q_b[1])
  _check(gated_grouped_matmul(x, packed_a, packed_b, gs, backend="pallas", tuning=t),
         gated_grouped_matmul(x, q_a, q_b, gs, backend="xla"), sum(sizes))
  _check(grouped_matmul(x, packed_a, gs, backend="pallas", tuning=t),
         grouped_matmul(x, q_a, gs, backend="xla"), sum(sizes))


def test_bench_aligned_case_gives_each_expert_whole_windows():
  """mlp_tune's ':a8' cases (`bench.aligned_layout`, the glue's `experts.aligned_rows` on
  sorted rows): expert e's rows start at 8 x the 8-row windows of the experts before it
  (counted here by hand), so at R 8 the work list has ceil(size / 8) items per expert, where
  the packed layout of the same sizes cuts the experts that straddle a window boundary (the
  layer's T=65 routing: 41 items against 36)."""
  # pylint: disable-next=import-outside-toplevel
  from pallas_kernels.grouped_matmul import bench
  sizes = np.array([3, 0, 6, 9, 1], np.int32)
  at, ends = bench.aligned_layout(sizes)
  np.testing.assert_array_equal(at, [0, 1, 2, 8, 9, 10, 11, 12, 13] + list(range(16, 25)) + [32])
  np.testing.assert_array_equal(ends, [3, 8, 14, 25, 33])
  span = 40  # the layout's last window ends here

  def items(group_ends, m):
    got = np.asarray(work.work_list(jnp.asarray(sizes), m, 8, jnp.asarray(group_ends)))
    live = got[:, got[3] > 0]
    return live[0].tolist(), live[3].tolist()
  assert items(ends, span) == ([0, 2, 3, 3, 4], [3, 6, 8, 1, 1])
  # packed: expert 2's rows 3..8 and expert 3's 9..17 each straddle a boundary
  assert items(np.cumsum(sizes), int(sizes.sum())) == ([0, 2, 2, 3, 3, 4], [3, 5, 1, 7, 2, 1])
