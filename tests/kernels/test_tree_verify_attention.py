"""Tests for the tree-verify attention kernel (Mosaic GPU; interpret mode on CPU) and its reference."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_verify import (api, combine, kernel, kernel_swap, masks, merge_triton,
                                        reference)
from pallas_kernels.tree_verify.tuning import SMEM_BYTES, Tuning, default_tuning

ON_GPU = jax.default_backend() == "gpu"
BACKEND = "pallas" if ON_GPU else "interpret"
TOL = {jnp.bfloat16: 1e-2, jnp.float32: 1e-5}


def GPU(values, full_grid=False):  # pylint: disable=invalid-name
  """A parametrization that is also in the default GPU set (`pytest -m gpu`; TestKernelGPU), or
  with full_grid only in --gpu-full-grid's (a path another default case compiles, or one only
  an A/B tuning takes; tests/GPU_TESTS.md)."""
  return pytest.param(*values, marks=[pytest.mark.gpu] + ([pytest.mark.gpu_full_grid] if full_grid else []))
C, R = 576, 512


def make_inputs(b, n, h, l, lengths, seed=0, dtype=jnp.bfloat16, c=C):
  """Random q [B, N, H, C], cache [B, L, C], lengths [B], tree mask [B, N, N] (host numpy: no
  device program per shape for the random draws)."""
  rng = np.random.default_rng([seed, 1])
  q = rng.standard_normal((b, n, h, c), np.float32).astype(dtype)
  cache = rng.standard_normal((b, l, c), np.float32).astype(dtype)
  mask = masks.random_tree_mask(np.random.default_rng(seed), b, n)
  return q, cache, np.asarray(lengths, np.int32), mask


def rel_err(x, y):
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def naive_numpy(q, cache, lengths, mask, scale):
  """Loop-per-query float64 reference."""
  q, cache = np.asarray(q, np.float64), np.asarray(cache, np.float64)
  lengths, mask = np.asarray(lengths), np.asarray(mask)
  b, n, h, _ = q.shape
  l = cache.shape[1]
  out, lse = np.zeros((b, n, h, R)), np.zeros((b, n, h))
  for bb, i in itertools.product(range(b), range(n)):
    ln = lengths[bb]
    keys = [j for j in range(l) if j < ln or (ln <= j < ln + n and mask[bb, i, j - ln])]
    k = cache[bb, keys]
    for hh in range(h):
      s = k @ q[bb, i, hh] * scale
      m = s.max()
      p = np.exp(s - m)
      out[bb, i, hh] = p @ k[:, :R] / p.sum()
      lse[bb, i, hh] = m + np.log(p.sum())
  return out, lse


@functools.partial(jax.jit, static_argnames=("scale", "tuning"))
def _kernel_call(q, cache, lengths, mask, *, scale, tuning):
  return api.tree_verify_attention(q, cache, lengths, mask, scale=scale, backend=BACKEND,
                                   return_lse=True, tuning=tuning)


# One XLA program per case for each side (not one per jnp op of the wrappers, run eagerly).
_reference_call = jax.jit(reference.tree_verify_attention_reference, static_argnames=("scale",))


def reference_on_cpu(q, cache, lengths, mask, scale):
  """The f32 reference compiled for and run on the host CPU whatever the default backend: on the
  H200 its f32 GEMMs cost ~10 s of XLA GPU compile per shape with N*H >= 64 (s5 log: the
  test_tunings pair, same inputs and reference, took 14.5 s, then 3.9 s), most of the GPU set."""
  args = jax.device_put((q, cache, lengths, mask), jax.devices("cpu")[0])
  return _reference_call(*args, scale=scale)


def check_against_reference(q, cache, lengths, mask, tuning=None, scale=0.05):
  """Runs the kernel backend, compares with the f32 reference (on the CPU); returns (out, lse)."""
  out, lse = _kernel_call(q, cache, lengths, mask, scale=scale, tuning=tuning)
  ref_o, ref_l = reference_on_cpu(q, cache, lengths, mask, scale)
  assert out.shape == ref_o.shape and out.dtype == q.dtype
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert not np.isnan(np.asarray(lse)).any()
  err = rel_err(np.asarray(out, np.float32), np.asarray(ref_o, np.float32))
  assert err <= TOL[jnp.bfloat16], err
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_l), rtol=1e-3, atol=1e-2)
  return out, lse


class TestReference:
  """The f32 XLA reference against a naive float64 loop."""

  @pytest.mark.parametrize("b,n,h,l,lengths", [(1, 1, 1, 7, [7 - 1]), (2, 5, 3, 40, [0, 20]),
                                               (3, 4, 2, 33, [29, 5, 12])])
  def test_matches_naive(self, b, n, h, l, lengths):
    q, cache, ln, mask = make_inputs(b, n, h, l, lengths, seed=b + n, dtype=jnp.float32)
    out, lse = reference.tree_verify_attention_reference(q, cache, ln, mask, scale=0.07,
                                                         value_dim=R)
    ref_o, ref_l = naive_numpy(q, cache, ln, mask, 0.07)
    assert rel_err(out, ref_o) <= TOL[jnp.float32]
    np.testing.assert_allclose(np.asarray(lse), ref_l, rtol=1e-5, atol=1e-5)

  def test_visibility(self):
    mask = jnp.asarray([[[True, False], [True, True]]])
    vis = np.asarray(reference.visibility_bnl(jnp.asarray([2]), mask, 5))[0]
    np.testing.assert_array_equal(vis, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])



class TestMasksAndMerge:
  """The kernel's tree-mask words and the split merge, against plain numpy."""

  @pytest.mark.parametrize("n,h", [(1, 8), (5, 3), (40, 2), (64, 1)])
  def test_tree_mask_words(self, n, h):
    mask = masks.random_tree_mask(np.random.default_rng(n), 2, n)
    m_pad = 64 * -(-(n * h) // 64)
    words = np.asarray(masks.tree_mask_words(jnp.asarray(mask), h, m_pad)).view(np.uint32)
    assert words.shape == (2, masks.num_words(n) + masks.EXTRA_WORDS, m_pad)
    for bb, row, k in itertools.product(range(2), range(m_pad), range(32 * words.shape[1])):
      want = row < n * h and k < n and mask[bb, row // h, k]
      assert bool((words[bb, k // 32, row] >> (k % 32)) & 1) == want, (bb, row, k)

  @pytest.mark.parametrize("how,s", [("xla", 4), ("triton", 4), ("triton", 7), ("triton", 132)])
  def test_merge_splits_matches_f64(self, how, s):
    """Empty splits (lse -inf, O 0), a row with no visible key at all, padding rows past `rows`
    (NaN: must not be read); the Triton merge at power-of-2 and other split counts (its pieces)."""
    rng = np.random.default_rng(5)
    b, m, r, rows = 2, 16, 64, 13
    o_p = rng.normal(size=(b, s, m, r)).astype(np.float32)
    lse_p = (rng.normal(size=(b, s, m)) * 3).astype(np.float32)
    lse_p[0, 1], o_p[0, 1] = -np.inf, 0.0
    lse_p[1, :, 3], o_p[1, :, 3] = -np.inf, 0.0
    o_p[:, :, rows:], lse_p[:, :, rows:] = np.nan, np.nan
    if how == "xla":
      out, lse = combine.merge_splits(jnp.asarray(o_p), jnp.asarray(lse_p), rows, jnp.float32)
    else:  # the Pallas Triton kernel in interpret mode (CPU), compiled on a GPU
      out, lse = merge_triton.merge_splits_triton(jnp.asarray(o_p), jnp.asarray(lse_p), rows,
                                                  jnp.float32, interpret=not ON_GPU)
    w = np.exp2(lse_p[:, :, :rows].astype(np.float64))
    tot = w.sum(axis=1)
    want = (w[..., None] * o_p[:, :, :rows]).sum(axis=1) / np.where(tot > 0, tot, 1)[..., None]
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.log(tot), rtol=1e-5, atol=1e-6)

  @pytest.mark.parametrize("cols", [128, 512])
  def test_triton_merge_columns(self, cols):
    """Tuning.merge_cols: programs of 128 / 512 value columns give the 64-column merge's result
    (f32, same pieces: 66 = 64 + 2), a row with no visible key included."""
    rng = np.random.default_rng(6)
    b, s, m, r, rows = 1, 66, 16, 512, 16
    o_p = jnp.asarray(rng.normal(size=(b, s, m, r)).astype(np.float32))
    lse_np = (rng.normal(size=(b, s, m)) * 3).astype(np.float32)
    lse_np[0, :, 2] = -np.inf
    lse_p = jnp.asarray(lse_np)
    merge = functools.partial(merge_triton.merge_splits_triton, o_p, lse_p, rows, jnp.float32,
                              interpret=not ON_GPU)
    (out, lse), (want, want_lse) = merge(cols=cols), merge()
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    assert not merge_triton.supports(s, r, 96) and not merge_triton.supports(s, 448, 256)

  def test_split_pieces(self):
    for s in (1, 4, 7, 66, 132, 264):
      pieces = merge_triton.split_pieces(s)
      assert [a for a, _ in pieces] == list(np.cumsum([0] + [k for _, k in pieces])[:-1])
      assert sum(k for _, k in pieces) == s and all(k & (k - 1) == 0 for _, k in pieces)


class TestRowWindows:
  """Every TMA row window of Q / O / LSE stays inside its own (batch, split) rows. Interpret mode
  clips a window that runs past a ref, the GPU does not (it wrote the next split's partials:
  v2's first H200 run, N=1, H=8), so the shapes are checked at trace time."""

  @pytest.mark.parametrize("n,h,want", [(1, 8, 8), (2, 8, 16), (5, 8, 40), (8, 8, 64),
                                        (9, 8, 128), (3, 1, 8), (1, 64, 64), (15, 8, 128)])
  def test_kernel_rows(self, n, h, want):
    assert api.kernel_rows(n, h) == want

  @pytest.mark.parametrize("m", [72, 100, 4])
  def test_window_past_ref_rejected(self, m):
    """M = 72 would make the second tile's 64-row window reach 56 rows past the ref."""
    sd = jax.ShapeDtypeStruct
    f = lambda q, c, le, w: kernel.attention_kernel(q, c, le, w, n=m, scale=0.1, tuning=Tuning(
        num_splits=2), value_dim=R, interpret=True)
    with pytest.raises(ValueError, match="windows"):
      jax.jit(f).trace(sd((1, m, C), jnp.bfloat16), sd((1, 128, C), jnp.bfloat16),
                       sd((1,), jnp.int32), sd((1, 5, 64 * -(-m // 64)), jnp.int32))

  @pytest.mark.slow
  @pytest.mark.parametrize("n,h", [(1, 8), (2, 8), (5, 8), (8, 8), (9, 8)])  # M = 8 .. 72
  def test_correct_over_rows(self, n, h):
    """Several splits (partials [B, S, M, R]) and a batch of 2: a window past M would land in the
    next split's or batch row's rows."""
    q, cache, ln, mask = make_inputs(2, n, h, 192, [170, 100], seed=n * h)
    check_against_reference(q, cache, ln, mask, Tuning(num_splits=3))


# Small shapes for CPU interpret mode (GPU(...): also in the default GPU set, `pytest -m gpu`, each
# for the path its "GPU:" comment names; TestKernelGPU's docstring lists the whole set):
# (B, N, H, L, lengths, tuning)
SMALL = [
    (1, 1, 8, 64, [63], Tuning(num_splits=1)),                     # one split: final output
    # GPU: ragged, len 0, L % 64 != 0, XLA merge, 40-row windows
    GPU((3, 5, 8, 200, [130, 0, 195], Tuning(num_splits=2))),
    (1, 15, 8, 136, [100], Tuning(num_splits=3)),                  # N = 8k-1: 2 row tiles, tree
    (1, 8, 8, 192, [120], Tuning(num_splits=1)),                   # N*H = 64: one whole tile
    (1, 40, 2, 192, [140], Tuning(num_splits=2)),                  # 2 mask words, tree over tiles
    (1, 2, 64, 150, [148], Tuning(num_splits=3)),                  # L % 8 != 0, empty split
    GPU((2, 4, 8, 150, [148, 151], Tuning(num_splits=2))),         # GPU: L % 8 != 0 (cache pad),
                                                                   # tree past L, len > L
    GPU((2, 3, 1, 40, [10, 30], Tuning(num_splits=1))),            # GPU: N*H % 8 != 0 (q pad),
                                                                   # L < 64 (one tile), one split
    (2, 9, 8, 300, [290, 0], Tuning(num_splits=4, merge="triton")),  # one-kernel merge
    (2, 9, 8, 300, [290, 0], Tuning(num_splits=3, merge="triton")),  # its 2 + 1 pieces
    # GPU full grid: Triton merge of 2 + 1 pieces at M 128 (2 row tiles unpadded), ragged (the
    # default set's N=15 case: 2 row tiles, 16 + 4 + 2 pieces)
    GPU((2, 16, 8, 3000, [2984, 1000], Tuning(num_splits=3, merge="triton")), full_grid=True),
    # swap_ab (kernel_swap.py: keys as the wgmma M, the M q rows its N): M = 8 one split (final
    # output), M = 40 ragged with len 0 and empty splits, M = 32 past L / len > L / L % 8 != 0,
    # M = 8 from N*H = 3 (q pad) with L < 64, M = 64 (N=8, H=8) over several masked tiles
    (1, 1, 8, 64, [63], Tuning(num_splits=1, swap_ab=True)),
    (3, 5, 8, 200, [130, 0, 195], Tuning(num_splits=2, swap_ab=True)),
    (2, 4, 8, 150, [148, 151], Tuning(num_splits=1, swap_ab=True)),
    (2, 3, 1, 40, [10, 30], Tuning(num_splits=1, swap_ab=True)),
    (1, 8, 8, 300, [250], Tuning(num_splits=4, swap_ab=True)),
    (2, 8, 8, 700, [630, 64], Tuning(num_splits=3, swap_ab=True, merge="triton")),
    # GPU full grid: swap_ab at N=1, H=8 (the ar shape's M = 8), ragged, many tiles a split,
    # Triton merge, unbalanced splits (the default's swap_ab splits are balanced: 1x1x8x46000)
    GPU((2, 1, 8, 3000, [2999, 1000], Tuning(num_splits=5, swap_ab=True, merge="triton")),
        full_grid=True),
    # GPU full grid: swap_ab at M = 16 (two reduction registers; default swap_ab: M <= 8), XLA
    # merge, masked tiles
    GPU((1, 2, 8, 1000, [900], Tuning(num_splits=2, swap_ab=True)), full_grid=True),
    # cluster_rows (the row tiles of a split in one cluster, KV tiles multicast; the interpreter
    # runs the cluster barriers, each CTA loads the whole tile): M = 128 from N = 15 (q pad), tree;
    # M = 256 in one cluster of 4, ragged with len 0 (empty splits); Triton merge, wider programs
    (1, 15, 8, 136, [100], Tuning(num_splits=3, cluster_rows=2)),
    (2, 32, 8, 300, [268, 0], Tuning(num_splits=3, cluster_rows=4, merge="triton",
                                    merge_cols=256)),
    # GPU full grid: cluster_rows=2 at N=16, H=8 (the DDTree 15 verify's M = 128), ragged,
    # Triton merge (an A/B: default_tuning keeps cluster_rows 1)
    GPU((2, 16, 8, 3000, [2984, 1000], Tuning(num_splits=5, cluster_rows=2, merge="triton")),
        full_grid=True),
]


class TestKernelSmall:
  """Small shapes; interpret mode on CPU, the compiled kernel on GPU."""

  @pytest.mark.slow
  @pytest.mark.parametrize("b,n,h,l,lengths,tuning", SMALL)
  def test_correct(self, b, n, h, l, lengths, tuning):
    q, cache, ln, mask = make_inputs(b, n, h, l, lengths, seed=n * h + l)
    check_against_reference(q, cache, ln, mask, tuning)

  @pytest.mark.parametrize("splits,swap_ab", [(1, False), GPU((3, False)), (3, True), (1, True)])
  def test_every_output_written_and_deterministic(self, splits, swap_ab):
    """Outputs land in buffers that held NaN (the interpreter fills fresh buffers with NaN; on
    a GPU a freed NaN buffer of the same size is reused): every row of every split is written."""
    b, n, h, l, lengths = 3, 5, 8, 200, [130, 0, 195]
    q, cache, ln, mask = make_inputs(b, n, h, l, lengths, seed=7)
    t = Tuning(num_splits=splits, swap_ab=swap_ab)
    words = masks.tree_mask_words(mask, h, 64)  # M = 40: one tile, 40-row windows
    # Inputs on the device first: no input transfer takes a freed NaN buffer meant for an output.
    q_rows, cache, ln = (jnp.asarray(x) for x in (q.reshape(b, n * h, C), cache, ln))
    attention_kernel = kernel_swap.attention_kernel if swap_ab else kernel.attention_kernel
    run = jax.jit(lambda qr, c, le, w: attention_kernel(
        qr, c, le, w, n=n, scale=0.05, tuning=t, value_dim=R, interpret=not ON_GPU))
    results = []
    for _ in range(2):
      for shape in kernel.out_types(b, n * h, R, t, q.dtype):
        jnp.full(shape.shape, jnp.nan, shape.dtype).block_until_ready()
      o, lse = run(q_rows, cache, ln, words)
      results.append((np.asarray(o, np.float32), np.asarray(lse)))
    o, lse = results[0]
    assert np.isfinite(o).all() and not np.isnan(lse).any()
    if splits > 1:  # len 0: batch 1 has one KV tile (its 5 tree rows), splits 1 and 2 are empty
      assert np.isneginf(lse[1, 1:]).all() and (o[1, 1:] == 0).all()
      assert np.isfinite(lse[:, 0]).all()
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])

  def test_small_latent_width(self):
    """C = 192, R = 128 (the tiny configs' MLA): 64-wide output halves per warpgroup."""
    q, cache, ln, mask = make_inputs(2, 4, 8, 136, [100, 132], seed=9, c=192)
    check_against_reference(q, cache, ln, mask, Tuning(num_splits=2))

  @pytest.mark.slow
  @pytest.mark.parametrize("n,tuning", [(9, Tuning(num_splits=2)),
                                        (3, Tuning(num_splits=2, swap_ab=True))])
  def test_packed_mask_same_as_bool_mask(self, n, tuning):
    """A mask packed once (pack_tree_mask) gives the bool mask's output bit for bit."""
    q, cache, ln, mask = make_inputs(2, n, 8, 130, [100, 121], seed=4)
    t = tuning
    f = lambda m: api.tree_verify_attention(q, cache, ln, m, scale=0.1, backend=BACKEND, tuning=t)
    np.testing.assert_array_equal(np.asarray(f(mask), np.float32),
                                  np.asarray(f(masks.pack_tree_mask(mask, 8)), np.float32))
    with pytest.raises(ValueError, match="pack_tree_mask"):
      f(masks.pack_tree_mask(mask, 16))

  def test_public_api_bit_identical(self):
    q, cache, ln, mask = make_inputs(2, 2, 16, 100, [90, 33], seed=3)
    f = lambda: api.tree_verify_attention(q, cache, ln, mask, scale=0.1, backend=BACKEND,
                                          tuning=Tuning(num_splits=2))
    np.testing.assert_array_equal(np.asarray(f(), np.float32), np.asarray(f(), np.float32))

  def test_default_tuning_fills_the_sms(self):
    # one GPU's 8 heads at one token: capped at 128 splits, balanced, merge loads first (the
    # measured combination); 132 wherever more rows fill a Q tile
    t = default_tuning(1, 1, 8, 46000)
    assert (t.num_splits, t.balanced_splits, t.merge_loads_first) == (128, True, True)
    assert default_tuning(1, 1, 16, 46000).num_splits == 132
    assert not default_tuning(1, 1, 16, 46000).balanced_splits
    assert default_tuning(4, 1, 8, 46000).num_splits == 33
    assert default_tuning(1, 16, 8, 46000).num_splits == 66
    assert default_tuning(1, 64, 64, 46000).num_splits == 2
    assert default_tuning(1, 64, 128, 46000).num_splits == 1
    assert default_tuning(1, 1, 8, 256).num_splits == 2  # >= 2 KV tiles per split
    # swap-AB only where the Q tile holds <= 8 real rows (the one shape measured faster)
    assert default_tuning(1, 1, 8, 46000).swap_ab and default_tuning(4, 1, 8, 4100).swap_ab
    assert not default_tuning(1, 2, 8, 46000).swap_ab and not default_tuning(1, 1, 64, 46000).swap_ab


class TestLowersForGpu:
  """Every kernel variant lowers to Mosaic GPU (layout inference, TMA shapes) on any host."""

  @staticmethod
  def lower_text(b, n, h, l, tuning):
    """The lowered module for an abstract H200 (the Triton merge, the default where the call
    splits, needs a GPU kind to lower on a CPU host)."""
    sd = jax.ShapeDtypeStruct
    f = lambda *a: api.tree_verify_attention_mgpu(*a, scale=0.1, tuning=tuning)
    h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=h200)):
      return jax.jit(f).trace(sd((b, n, h, C), jnp.bfloat16), sd((b, l, C), jnp.bfloat16),
                              sd((b,), jnp.int32), sd((b, n, n), jnp.bool_)).lower(
                                  lowering_platforms=("cuda",)).as_text()

  @pytest.mark.parametrize("b,n,h,l,tuning", [
      (1, 1, 8, 46000, Tuning(num_splits=132)), (1, 64, 64, 46000, Tuning(num_splits=1)),
      (2, 15, 8, 4096, Tuning(num_splits=3)), (4, 63, 8, 4100, Tuning(num_splits=2)),
      (1, 3, 1, 100, Tuning(num_splits=1)),
      (1, 1, 8, 46000, Tuning(num_splits=132, swap_ab=True, merge="triton")),
      (1, 8, 8, 46000, Tuning(num_splits=132, swap_ab=True, merge="triton")),
      (4, 1, 8, 46000, Tuning(num_splits=33, swap_ab=True, merge="triton")),
      (1, 4, 8, 46000, Tuning(num_splits=132, swap_ab=True)),
      (2, 5, 8, 4100, Tuning(num_splits=1, swap_ab=True)),
      (1, 16, 8, 46000, Tuning(num_splits=66, merge="triton", cluster_rows=2)),
      (1, 64, 8, 46000, Tuning(num_splits=16, merge="triton", cluster_rows=4)),
      (4, 16, 8, 46000, Tuning(num_splits=16, merge="triton", cluster_rows=2)),
      (1, 16, 8, 46000, Tuning(num_splits=66, merge="triton", merge_cols=512))])
  def test_lowers(self, b, n, h, l, tuning):
    assert "mosaic_gpu" in self.lower_text(b, n, h, l, tuning)

  def test_smem_budget(self):
    """Today's default fits; a ring that cannot is refused before Mosaic sees it."""
    assert kernel.smem_bytes(Tuning(), C, R) <= SMEM_BYTES
    with pytest.raises(ValueError, match="SMEM"):
      self.lower_text(1, 1, 8, 4096, Tuning(stages=3, num_splits=2))

  @pytest.mark.parametrize("n,h,tuning", [
      (16, 8, Tuning(swap_ab=True)), (1, 8, Tuning(swap_ab=True, stages=3))])
  def test_swap_ab_rejects(self, n, h, tuning):
    """swap_ab: one row tile (M <= 64), 2 stages (SMEM)."""
    with pytest.raises(ValueError, match="swap_ab|SMEM"):
      self.lower_text(1, n, h, 4096, tuning)
    assert kernel_swap.smem_bytes(Tuning(), 64, C, R) <= SMEM_BYTES

  @pytest.mark.parametrize("n,h,tuning", [
      (40, 8, Tuning(cluster_rows=2, num_splits=2)),  # 5 row tiles: not whole clusters
      (8, 8, Tuning(cluster_rows=2, num_splits=2)),   # one row tile
      (1, 8, Tuning(cluster_rows=2, swap_ab=True))])
  def test_cluster_rows_rejects(self, n, h, tuning):
    """cluster_rows groups whole row tiles of the 64-row kernel; swap_ab is one row tile."""
    with pytest.raises(ValueError, match="cluster_rows"):
      self.lower_text(1, n, h, 4096, tuning)
    for bad in (dict(cluster_rows=3), dict(merge_cols=96), dict(merge="kernel")):
      with pytest.raises(ValueError):  # merge="kernel": tried and removed (notes/kernel.md)
        Tuning(**bad)

  def test_triton_merge_lowers(self):
    """The Pallas Triton merge needs a GPU kind to lower on a CPU host: an abstract H200."""
    for splits in (128, 132):
      text = self.lower_text(1, 1, 8, 46000, Tuning(num_splits=splits, merge="triton"))
      assert "mosaic_gpu" in text and "triton" in text.lower()
    assert default_tuning(1, 1, 8, 46000).merge == "triton"  # the default where it splits

  @pytest.mark.slow
  def test_bench_probes_lower(self):
    """Every variant the bench times (PROBES) lowers for its shape: the GPU run spends no time
    on one that cannot compile."""
    # pylint: disable-next=import-outside-toplevel
    from pallas_kernels.tree_verify import bench
    for (b, n, h, l), spec in bench.PROBES.items():
      for name, tuning, _ in bench.parse_tunings(spec, b, n, h, l)[1:]:
        assert "mosaic_gpu" in self.lower_text(b, n, h, l, tuning), (b, n, h, l, name)

  @pytest.mark.slow
  @pytest.mark.parametrize("b,n,h", list(itertools.product([1, 4], [1, 8, 16, 32, 64], [8, 64])))
  def test_bench_grid_lowers(self, b, n, h):
    """The bench grid's shapes with the default tuning (L = 46000; every L of the grid was
    checked once, 2026-12-01)."""
    assert "mosaic_gpu" in self.lower_text(b, n, h, 46000, default_tuning(b, n, h, 46000))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled kernel: GPU only")
class TestKernelGPU:
  """The default GPU set (`pytest -m gpu`; tests/GPU_TESTS.md): 10 cases, one compiled kernel
  program each, the f32 reference on the CPU. One case per path a default tuning takes (M =
  kernel rows; windows of min(M, 64) rows):
  - SMALL GPU(...): ragged with len 0 + XLA merge (M 40); L % 8 != 0 cache pad, tree past L,
    len > L (M 32); q pad N*H % 8 != 0, L < 64 keys, one split (M 8).
  - test_every_output_written_and_deterministic[3-False]: raw partials in NaN-filled buffers.
  - here, default tuning: 1x1x8x46000 (the ar shape: swap_ab, 128 balanced splits, the Triton
    merge with its loads first, M 8); B=4 ragged with len 0 at L=4100 (the same swap_ab kernel
    at B > 1 with an empty row: 32 balanced splits, one piece); N=15 = 8k-1 (q padded to 2 row tiles, B=3, len 1, 22
    splits = 16 + 4 + 2 pieces); N=100 (13 row tiles, 4 mask words, 5 splits); test_tunings: one
    split over 8 row tiles (N=64: final output, no merge);
    tests/sharding: the kernel in the model's head-sharded shard_map.
  With --gpu-full-grid (gpu_full_grid marks: the same paths at other shapes, or A/B tunings): SMALL's
  Triton merge of 2 + 1 pieces (M 128 unpadded), swap_ab at M 8 with unbalanced splits and at
  M 16, cluster_rows=2 at M 128 (clusters of the 2 row tiles, multicast KV tiles, cluster
  barriers).
  Now CPU-only (their paths run on the GPU in the cases above): test_correct_over_rows[9-8] (q
  padded 72 -> 128, 3 splits, XLA merge: the N=15 case has the same two 64-row windows, the M 40
  case the XLA merge) and SMALL's 2x9x8x300 Triton merge of 4 splits (one power-of-2 piece: the
  ar case's 128). The bench checks its shapes against the reference too."""

  @pytest.mark.parametrize("b,n,h,l,lengths", [
      (1, 1, 8, 46000, [45999]),
      (4, 1, 8, 4100, [4099, 0, 17, 2050]),  # the ar kernel at B > 1, ragged, len 0
      (3, 15, 8, 3000, [2985, 1, 1500]), (2, 100, 8, 1000, [900, 64])])
  def test_default_tuning(self, b, n, h, l, lengths):
    q, cache, ln, mask = make_inputs(b, n, h, l, lengths, seed=n * 131 + h + l)
    check_against_reference(q, cache, ln, mask)

  @pytest.mark.parametrize("tuning", [Tuning(num_splits=1)])
  def test_tunings(self, tuning):
    q, cache, ln, mask = make_inputs(3, 64, 8, 3000, [2936, 1, 1500], seed=11)
    check_against_reference(q, cache, ln, mask, tuning)


@pytest.mark.gpu
@pytest.mark.gpu_full_grid
@pytest.mark.skipif(not ON_GPU, reason="compiled kernel: GPU only")
class TestKernelFullGridGPU:
  """Every (N, H) pair with ragged batches, and a sweep over L; compiled kernel. Runs only with
  pytest's --gpu-full-grid (tests/conftest.py)."""

  @pytest.mark.parametrize("b,n,h,l,lengths", [
      (2, 2, 8, 46000, [45998, 30000]), (2, 5, 8, 8192, [8187, 4000]), (1, 9, 8, 8192, [8183]),
      (1, 16, 8, 16384, [16368]), (2, 63, 8, 2048, [1985, 700]), (1, 64, 64, 4096, [4032]),
      (2, 5, 3, 700, [695, 300])])
  def test_default_tuning(self, b, n, h, l, lengths):
    q, cache, ln, mask = make_inputs(b, n, h, l, lengths, seed=n * 131 + h + l)
    check_against_reference(q, cache, ln, mask)

  @pytest.mark.parametrize("tuning", [Tuning(num_splits=7), Tuning(num_splits=5)])
  def test_tunings(self, tuning):
    q, cache, ln, mask = make_inputs(3, 64, 8, 3000, [2936, 1, 1500], seed=11)
    check_against_reference(q, cache, ln, mask, tuning)

  @pytest.mark.parametrize("n,h", list(itertools.product([1, 2, 7, 8, 16, 31, 32, 64, 127],
                                                         [1, 8, 16, 64, 128])))
  def test_nh_grid(self, n, h):
    l = 1000
    q, cache, ln, mask = make_inputs(3, n, h, l, [l - n, 0, 517], seed=n * 131 + h)
    check_against_reference(q, cache, ln, mask)

  @pytest.mark.parametrize("l", [64, 100, 4096, 4100, 46000, 131072])
  @pytest.mark.parametrize("b", [1, 4])
  def test_lengths(self, l, b):
    n, h = 16, 8
    lengths = [l - n] if b == 1 else [l - n, 0, max(l // 3, 1), l // 2]
    q, cache, ln, mask = make_inputs(b, n, h, l, lengths, seed=l + b)
    check_against_reference(q, cache, ln, mask)
