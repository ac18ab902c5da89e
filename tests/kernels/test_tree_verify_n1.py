"""The N=1, H=8 probes of notes/kernel.md ("Why N=1, H=8 costs 17 + 3 us"): balanced splits
(every split streams floor or ceil(tiles / S) KV tiles) and the Triton merge that loads its
partial blocks first. Interpret mode on the CPU against the f32 reference; lowering for an
abstract H200 at the ar shape (1x1x8x46000)."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import test_tree_verify_attention as tva  # tests/kernels is on sys.path (pytest's prepend mode)
from pallas_kernels.tree_verify import api, kernel, merge_triton
from pallas_kernels.tree_verify.tuning import Tuning, default_tuning


def split_sizes(nt, splits, balanced):
  """Tiles [lo, hi) of every split for `nt` KV tiles of 64 keys (kernel._split_range, concrete)."""
  t = Tuning(num_splits=splits, balanced_splits=balanced)
  end = jnp.int32(nt * 64)
  ranges = [kernel._split_range(end, end, jnp.int32(s), t)[:2] for s in range(splits)]
  return [(int(lo), int(hi)) for lo, hi in ranges]


def clear_traces():
  """Forget the jitted kernel calls traced so far (a patched kernel function must be re-traced)."""
  tva._kernel_call.clear_cache()
  api.tree_verify_attention_mgpu.clear_cache()


class TestBalancedSplits:

  @pytest.mark.parametrize("nt,splits", [(719, 132), (719, 128), (5, 8), (8, 8), (1, 3), (0, 4),
                                         (11, 3)])
  def test_ranges_cover_every_tile_once(self, nt, splits):
    """The splits' tiles are consecutive, disjoint, cover [0, nt), and differ by at most one."""
    ranges = split_sizes(nt, splits, True)
    assert ranges[0][0] == 0 and ranges[-1][1] == nt
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)

  def test_ar_shape_streams_on_every_sm(self):
    """L = 46000 (719 tiles) over 132 splits: the default leaves 12 splits empty (119 x 6 + 5),
    balanced gives 59 x 6 + 73 x 5."""
    default = [hi - lo for lo, hi in split_sizes(719, 132, False)]
    balanced = [hi - lo for lo, hi in split_sizes(719, 132, True)]
    assert default.count(6) == 119 and default.count(5) == 1 and default.count(0) == 12
    assert balanced.count(6) == 59 and balanced.count(5) == 73

  @pytest.mark.parametrize("b,n,h,l,lengths,tuning", [
      # swap-AB at M = 8 (the ar shape's kernel): 12 tiles over 5 splits (3 + 3 + 2 + 2 + 2),
      # ragged with a row of len 0 (one tile: four empty splits), Triton merge of 4 + 1 pieces
      (2, 1, 8, 760, [759, 0], Tuning(num_splits=5, swap_ab=True, merge="triton",
                                      balanced_splits=True)),
      # swap-AB at M = 40, tree over a masked tile in the last split, XLA merge
      (2, 5, 8, 330, [300, 140], Tuning(num_splits=4, swap_ab=True, balanced_splits=True)),
      # the 64-row kernel (M = 16 in one tile), more splits than tiles
      (1, 2, 8, 200, [190], Tuning(num_splits=6, balanced_splits=True)),
  ])
  def test_correct(self, b, n, h, l, lengths, tuning):
    q, cache, ln, mask = tva.make_inputs(b, n, h, l, lengths, seed=n * h + l)
    tva.check_against_reference(q, cache, ln, mask, tuning)

  def test_dropped_tile_is_caught(self, monkeypatch):
    """Mutation: balanced splits that drop each long split's extra tile fail the check."""
    real = kernel._split_range

    def drop_extra(length, end, s_idx, t):
      lo, hi, full_hi = real(length, end, s_idx, t)
      short = jnp.maximum(hi - 1, lo)
      return lo, short, jnp.minimum(full_hi, short)
    monkeypatch.setattr(kernel, "_split_range", drop_extra)
    clear_traces()
    q, cache, ln, mask = tva.make_inputs(1, 1, 8, 760, [759], seed=3)
    with pytest.raises(AssertionError):
      tva.check_against_reference(q, cache, ln, mask, Tuning(num_splits=5, swap_ab=True,
                                                             balanced_splits=True))
    monkeypatch.undo()
    clear_traces()


class TestMergeLoadsFirst:

  @pytest.mark.parametrize("s,cols", [(132, 64), (66, 32), (128, 32), (3, 512)])
  def test_same_as_default_merge(self, s, cols):
    """loads_first gives the default merge's result bit for bit at the same columns (same
    arithmetic), f32 and bf16 partials, pieces 128 + 4 / 64 + 2 / 128 / 2 + 1, a row with no
    visible key; 32 columns a program equal 64 to f32 rounding."""
    rng = np.random.default_rng(s)
    b, m, r, rows = 2, 8, 512, 8
    lse_np = (rng.normal(size=(b, s, m)) * 3).astype(np.float32)
    lse_np[1, :, 3] = -np.inf
    for dtype in (jnp.float32, jnp.bfloat16):
      o_p = jnp.asarray(rng.normal(size=(b, s, m, r)), dtype)
      merge = functools.partial(merge_triton.merge_splits_triton, o_p, jnp.asarray(lse_np), rows,
                                jnp.float32, interpret=True)
      (out, lse), (want, want_lse) = merge(cols=cols, loads_first=True), merge(cols=cols)
      np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
      np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
      wide, _ = merge()  # 64 columns a program: the sums' order may differ in the last bit
      np.testing.assert_allclose(np.asarray(out), np.asarray(wide), rtol=1e-6, atol=1e-6)

  @pytest.mark.parametrize("tuning", [
      Tuning(num_splits=4, swap_ab=True, merge="triton", merge_loads_first=True),
      Tuning(num_splits=5, swap_ab=True, merge="triton", merge_loads_first=True, merge_cols=32,
             balanced_splits=True)])
  def test_correct(self, tuning):
    q, cache, ln, mask = tva.make_inputs(2, 1, 8, 700, [699, 130], seed=11)
    tva.check_against_reference(q, cache, ln, mask, tuning)


AR = (1, 1, 8, 46000)


@pytest.mark.parametrize("fields", [
    dict(balanced_splits=True), dict(num_splits=128), dict(merge_loads_first=True),
    dict(merge_cols=32), dict(num_splits=128, balanced_splits=True, merge_loads_first=True),
    dict(swap_ab=False, balanced_splits=True)])
def test_ar_probes_lower(fields):
    """The bench rows at 1x1x8x46000 lower (Mosaic kernel and Triton merge) for an abstract H200."""
    t = Tuning(**(default_tuning(*AR).__dict__ | fields))
    text = tva.TestLowersForGpu.lower_text(*AR, t)
    assert "mosaic_gpu" in text and "triton" in text.lower()
