"""Tests for the tree-verify attention kernel (Mosaic GPU; interpret mode on CPU) and its reference."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_verify import api, kernel, reference
from pallas_kernels.tree_verify.tuning import Tuning, default_tuning

ON_GPU = jax.default_backend() == "gpu"
BACKEND = "pallas" if ON_GPU else "interpret"
TOL = {jnp.bfloat16: 1e-2, jnp.float32: 1e-5}
C, R = 576, 512


def random_tree_mask(rng, b, n):
  """[B, N, N] bool: node i sees its ancestors and itself (random parent among earlier nodes)."""
  mask = np.zeros((b, n, n), bool)
  for bb in range(b):
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    for i in range(n):
      j = i
      while j >= 0:
        mask[bb, i, j] = True
        j = parent[j]
  return mask


def make_inputs(b, n, h, l, lengths, seed=0, dtype=jnp.bfloat16):
  """Random q [B, N, H, C], cache [B, L, C], lengths [B], tree mask [B, N, N]."""
  kq, kc = jax.random.split(jax.random.key(seed))
  q = jax.random.normal(kq, (b, n, h, C), jnp.float32).astype(dtype)
  cache = jax.random.normal(kc, (b, l, C), jnp.float32).astype(dtype)
  mask = random_tree_mask(np.random.default_rng(seed), b, n)
  return q, cache, jnp.asarray(lengths, jnp.int32), jnp.asarray(mask)


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


def check_against_reference(q, cache, lengths, mask, tuning=None, scale=0.05):
  """Runs the kernel backend, compares with the f32 reference; returns (out, lse)."""
  out, lse = api.tree_verify_attention(q, cache, lengths, mask, scale=scale, backend=BACKEND,
                                       return_lse=True, tuning=tuning)
  ref_o, ref_l = reference.tree_verify_attention_reference(q, cache, lengths, mask, scale=scale)
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


  def test_merge_matches_direct_softmax_merge(self):
    """kernel.merge (partials in the kernel's layout + the unnormalised tree block) == f64 merge,
    with empty splits (lse -inf) and rows that see no tree node (D = 0)."""
    rng = np.random.default_rng(5)
    b, s, n, h, r = 2, 3, 3, 4, 8
    mp = 64
    o_p = rng.normal(size=(b, s, mp, r)).astype(np.float32)
    lse_p = rng.normal(size=(b, s, mp)).astype(np.float32) * 3
    lse_p[0, 1] = -np.inf                                  # an empty split
    lse_p[1, :, :h] = -np.inf                              # node 0 of batch 1: no prefix at all
    o_t = rng.normal(size=(b, n, h, r)).astype(np.float32)
    m_t = rng.normal(size=(b, n, h)).astype(np.float32)
    den_t = rng.uniform(0.5, 3.0, size=(b, n, h)).astype(np.float32)
    den_t[0, 2] = 0.0                                      # node 2 of batch 0 sees no tree node
    o_t[0, 2] = 0.0
    out, lse = kernel.merge(*map(jnp.asarray, (o_p, lse_p, o_t, m_t, den_t)), jnp.float32)
    # f64: every part as (weight 2^lse, normalised O), summed.
    lse_tree = np.where(den_t > 0, m_t + np.log2(np.where(den_t > 0, den_t, 1)), -np.inf)
    o_tree = o_t / np.where(den_t > 0, den_t, 1)[..., None]
    parts_w = np.concatenate([np.exp2(lse_p[:, :, :n * h].reshape(b, s, n, h).astype(np.float64)),
                              np.exp2(lse_tree[:, None].astype(np.float64))], axis=1)
    parts_o = np.concatenate([o_p[:, :, :n * h].reshape(b, s, n, h, r), o_tree[:, None]], axis=1)
    tot = parts_w.sum(axis=1)
    want = (parts_w[..., None] * parts_o).sum(axis=1) / tot[..., None]
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.log(tot), rtol=1e-5, atol=1e-6)

# Small shapes for CPU interpret mode: (B, N, H, L, lengths, tuning)
SMALL = [
    (1, 1, 1, 64, [63], Tuning(num_splits=1)),                     # one row, padded tile
    (3, 5, 8, 200, [130, 0, 195], Tuning(num_splits=2)),           # ragged, len 0, L % 64 != 0
    (3, 5, 8, 200, [130, 0, 195], Tuning(num_splits=2, shared_p=False)),
    (1, 2, 64, 150, [148], Tuning(num_splits=3)),                  # 2 row tiles, empty split
    (2, 16, 8, 40, [10, 24], Tuning(num_splits=1)),                # L < block_kv
]


class TestKernelSmall:
  """Small shapes; interpret mode on CPU, the compiled kernel on GPU."""

  @pytest.mark.parametrize("b,n,h,l,lengths,tuning", SMALL)
  def test_correct(self, b, n, h, l, lengths, tuning):
    q, cache, ln, mask = make_inputs(b, n, h, l, lengths, seed=n * h + l)
    check_against_reference(q, cache, ln, mask, tuning)

  def test_every_partial_written_and_deterministic(self):
    """Interpret mode fills fresh buffers with NaN; on GPU a freed NaN buffer is reused."""
    b, n, h, l, lengths = 3, 5, 8, 200, [130, 0, 195]
    q, cache, ln, mask = make_inputs(b, n, h, l, lengths, seed=7)
    t = Tuning(num_splits=3)
    mp = kernel.BLOCK_M * -(-(n * h) // kernel.BLOCK_M)
    q_rows = kernel._rows(q, mp)  # pylint: disable=protected-access
    run = jax.jit(lambda qr, c, le: kernel.prefix_partials(
        qr, c, le, scale=0.05, tuning=t, value_dim=R, interpret=not ON_GPU))
    results = []
    for _ in range(2):
      poison = jnp.full((b, t.num_splits, mp, R + 1), jnp.nan, jnp.float32).block_until_ready()
      del poison
      o, lse = run(q_rows, cache, ln)
      results.append((np.asarray(o), np.asarray(lse)))
    o, lse = results[0]
    assert np.isfinite(o).all()
    assert not np.isnan(lse).any()
    assert np.isneginf(lse[1]).all() and (o[1] == 0).all()  # length 0: every split empty
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])

  def test_public_api_bit_identical(self):
    q, cache, ln, mask = make_inputs(2, 2, 16, 100, [90, 33], seed=3)
    f = lambda: api.tree_verify_attention(q, cache, ln, mask, scale=0.1, backend=BACKEND,
                                          tuning=Tuning(num_splits=2))
    np.testing.assert_array_equal(np.asarray(f(), np.float32), np.asarray(f(), np.float32))

  def test_default_tuning(self):
    assert default_tuning(1, 1, 8, 46000).num_splits > 1
    assert default_tuning(1, 64, 128, 46000).num_splits == 1


@pytest.mark.gpu
class TestKernelFullGPU:
  """Every (N, H) pair with ragged batches, and a sweep over L; compiled kernel."""

  @pytest.mark.parametrize("n,h", list(itertools.product([1, 2, 5, 16, 64], [1, 8, 16, 64, 128])))
  def test_nh_grid(self, n, h):
    l = 1000
    q, cache, ln, mask = make_inputs(3, n, h, l, [l - n, 0, 517], seed=n * 131 + h)
    check_against_reference(q, cache, ln, mask)

  @pytest.mark.parametrize("l", [64, 100, 4096, 4100, 46000])
  @pytest.mark.parametrize("b", [1, 3])
  def test_lengths(self, l, b):
    n, h = 16, 8
    lengths = [l - n] if b == 1 else [l - n, 0, max(l // 3, 1)]
    q, cache, ln, mask = make_inputs(b, n, h, l, lengths, seed=l + b)
    check_against_reference(q, cache, ln, mask)

  @pytest.mark.parametrize("tuning", [Tuning(num_splits=1), Tuning(num_splits=7),
                                      Tuning(shared_p=False, num_splits=4),
                                      Tuning(shared_p=False, num_splits=1)])
  def test_tunings(self, tuning):
    q, cache, ln, mask = make_inputs(3, 64, 8, 3000, [2936, 1, 1500], seed=11)
    check_against_reference(q, cache, ln, mask, tuning)
