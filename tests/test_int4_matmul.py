"""The INT4 grouped-matmul kernel (interpret mode on CPU) against its XLA reference, and its work list."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.model import experts, int4
from pallas_kernels.int4_matmul import int4_grouped_matmul, int4_grouped_matmul_reference, work


def _items_brute_force(sizes, block_m):
  """(group, block, lo, size) for every (block, group) overlap, in row order."""
  out, start = [], 0
  for g, s in enumerate(sizes):
    for r in range(start, start + s):
      blk = r // block_m
      if out and out[-1][0] == g and out[-1][1] == blk:
        out[-1][3] += 1
      else:
        out.append([g, blk, r - blk * block_m, 1])
    start += s
  return out


@pytest.mark.parametrize("sizes,m", [([30, 0, 50, 3, 10], 100), ([7], 7), ([0, 0, 5, 0], 64),
                                     ([64, 64, 1, 127], 300), ([0, 0, 0], 10)])
def test_work_list_covers_every_row_once(sizes, m):
  items = np.asarray(work.work_list(jnp.asarray(sizes, jnp.int32), m, 64)).T
  assert len(items) == work.num_items(m, len(sizes), 64)
  live = [list(map(int, it)) for it in items if it[3] > 0]
  assert live == _items_brute_force(sizes, 64)


def _operands(m, k, n, g, group, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
  q = jnp.asarray(rng.integers(-8, 8, size=(g, k, n)), jnp.int4)
  s = jnp.asarray(rng.uniform(0.01, 0.1, size=(g, k // group, n)), jnp.bfloat16)
  return x, q, s


@pytest.mark.parametrize("sizes,m,k,n,group", [
    ([30, 0, 50, 3, 10], 100, 128, 256, 32),   # empty expert, groups straddling a 64-row block
    ([7], 7, 64, 128, 32),                     # fewer rows than one block
    ([20, 0, 44, 64], 140, 256, 128, 128),     # one scale per step, rows past the sum unused
])
def test_kernel_interpret_matches_reference(sizes, m, k, n, group):
  x, q, s = _operands(m, k, n, len(sizes), group)
  gs = jnp.asarray(sizes, jnp.int32)
  got = np.asarray(int4_grouped_matmul(x, q, s, gs, backend="interpret"), np.float32)
  want = np.asarray(int4_grouped_matmul_reference(x, q, s, gs), np.float32)
  rows = sum(sizes)  # rows past the sum are undefined in the kernel
  # Same bf16 weights and f32 accumulation: at most one bf16 rounding apart (2^-7 relative).
  np.testing.assert_allclose(got[:rows], want[:rows], rtol=2 ** -7,
                             atol=1e-4 * np.abs(want).max())


def test_reference_equals_dequantised_ragged_dot_in_f32():
  x, q, s = _operands(50, 64, 128, 3, 32, seed=1)
  gs = jnp.asarray([10, 25, 15], jnp.int32)
  w = int4.dequantize(int4.Int4Weight(q, s), jnp.float32)
  want = np.concatenate([np.asarray(x[a:b], np.float32) @ np.asarray(w[i])
                         for i, (a, b) in enumerate([(0, 10), (10, 35), (35, 50)])])
  got = int4_grouped_matmul_reference(x.astype(jnp.float32), q, s, gs)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_expert_ffn_with_int4_kernel_equals_xla_path():
  """The whole routed-expert FFN: fused-kernel INT4 == dequantise + XLA (bf16 tolerance)."""
  t, e, k, d, f = 24, 6, 2, 128, 128
  ks = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
  idx = jnp.argsort(jax.random.uniform(ks[1], (t, e)), axis=1)[:, :k].astype(jnp.int32)
  w = jax.random.uniform(ks[2], (t, k), jnp.float32)
  mats = [int4.quantize(np.asarray(jax.random.normal(ks[3], s)) * 0.05)
          for s in [(e, d, f), (e, d, f), (e, f, d)]]
  a = experts.expert_ffn(x, idx, w, *mats, impl="interpret")
  b = experts.expert_ffn(x, idx, w, *mats, impl="xla")
  assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-2


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.skipif(not ON_GPU, reason="compiled kernel runs on the GPU only")
@pytest.mark.parametrize("sizes,m,k,n,group", [
    ([30, 0, 50, 3, 10], 100, 128, 256, 32),
    ([7], 7, 64, 128, 32),
    ([20, 0, 44, 64], 140, 256, 128, 128),
    (list(np.bincount(np.random.default_rng(2).integers(0, 48, 520), minlength=48)), 520, 7168,
     2048, 32),                               # a K2.6 verify step's experts on one of 8 GPUs
])
def test_kernel_gpu_matches_reference(sizes, m, k, n, group):
  x, q, s = _operands(m, k, n, len(sizes), group)
  gs = jnp.asarray(sizes, jnp.int32)
  got = np.asarray(int4_grouped_matmul(x, q, s, gs, backend="pallas"), np.float32)
  want = np.asarray(int4_grouped_matmul_reference(x, q, s, gs), np.float32)
  rows = sum(sizes)
  np.testing.assert_allclose(got[:rows], want[:rows], rtol=2 ** -7,
                             atol=1e-4 * np.abs(want).max())


def test_bad_input_errors():
  x, q, s = _operands(8, 64, 128, 2, 32)
  gs = jnp.asarray([4, 4], jnp.int32)
  with pytest.raises(ValueError, match="int4"):
    int4_grouped_matmul(x, q.astype(jnp.int8), s, gs)
  with pytest.raises(ValueError, match="disagree on K"):
    int4_grouped_matmul(x[:, :32], q, s, gs)
  with pytest.raises(ValueError, match="group_sizes"):
    int4_grouped_matmul(x, q, s, gs[:1])
  with pytest.raises(ValueError, match="backend"):
    int4_grouped_matmul(x, q, s, gs, backend="triton")
