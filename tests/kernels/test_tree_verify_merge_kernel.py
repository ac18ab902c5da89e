"""Tuning(merge="kernel"): the split merge inside the tree-verify kernel (merge_in_kernel.py),
rebuilt 2026-12-05 with 128-byte LSE ring slots (its 2026-12-01 build faulted on the H200 with
CUDA_ERROR_MISALIGNED_ADDRESS; notes/kernel.md). Interpret mode on the CPU against the f32
reference (the interpreter runs the grid in order and has no GMEM semaphores: the signal / wait
are left out there), the ring's TMA alignment from the SMEM plan, CUDA lowering for an abstract
H200 at the ar shape and the 64-row kernel's shapes, and one compiled GPU case (`pytest -m gpu`,
this file alone: a fault loses the CUDA context of its process)."""

import jax
import jax.numpy as jnp
import pytest

import test_tree_verify_attention as tva  # tests/kernels is on sys.path (pytest's prepend mode)
from pallas_kernels.tree_verify import kernel, kernel_swap, masks, merge_in_kernel
from pallas_kernels.tree_verify.tuning import BLOCK_M, SMEM_BYTES, Tuning, default_tuning

C, R = tva.C, tva.R
MK = dict(merge="kernel")


class TestRingAlignment:
  """The PTX rule the 2026-12-01 build broke: a tensor TMA's SMEM destination is 128-byte
  aligned (Pallas starts each buffer at 1 KiB; a slot's offset is its index times its size)."""

  @pytest.mark.parametrize("rows", [8, 16, 24, 32, 40, 48, 56, 64])
  def test_lse_slots_are_128_byte_multiples(self, rows):
    assert merge_in_kernel.lse_slot_floats(rows) * 4 % merge_in_kernel.TMA_SMEM_ALIGN == 0
    assert merge_in_kernel.lse_slot_floats(rows) >= rows

  @pytest.mark.parametrize("rows,splits", [(8, 128), (8, 3), (40, 20), (BLOCK_M, 132)])
  def test_scratch_plan(self, rows, splits):
    """Every ring slot's LSE row and O half start at a legal tensor-TMA address: LSE slots
    128-byte multiples, O halves 1 KiB multiples (the 128-byte swizzle's pattern)."""
    t = Tuning(num_splits=splits, **MK)
    space = (kernel._operand_bytes(t, C) if rows == BLOCK_M
             else kernel_swap._operand_bytes(t, rows, C))
    (ring, lse_ring), barriers = merge_in_kernel.scratch(t, rows, R, space, ())
    k = ring.shape[0]
    assert 1 <= k <= min(splits - 1, merge_in_kernel.MAX_RING_SLOTS) and len(barriers) == 4
    assert lse_ring.shape == (k, merge_in_kernel.lse_slot_floats(rows))
    assert lse_ring.shape[1] * 4 % 128 == 0
    assert ring.shape[2] * ring.shape[3] * 2 % 1024 == 0  # one O half
    lse_bytes = -(-merge_in_kernel.MAX_RING_SLOTS * lse_ring.shape[1] * 4 // 1024) * 1024
    assert k * 2 * rows * (R // 2) * 2 + lse_bytes <= space  # inside the union's first member

  def test_ar_ring_depth(self):
    """The ar call's swap-AB kernel (M = 8): 16 slots of 8 KB; the 64-row kernel: 3 of 64 KB."""
    t = Tuning(num_splits=128, swap_ab=True, **MK)
    assert merge_in_kernel.ring_slots(t, 8, R, kernel_swap._operand_bytes(t, 8, C)) == 16
    assert merge_in_kernel.ring_slots(t, BLOCK_M, R, kernel._operand_bytes(t, C)) == 3


# (B, N, H, L, lengths, tuning): interpret mode vs the f32 reference.
CASES = [
    # N=1, H=8: swap-AB (M = 8, the ar kernel) and the 64-row kernel (8-row windows)
    (1, 1, 8, 700, [699], Tuning(num_splits=5, swap_ab=True, **MK)),
    (1, 1, 8, 700, [699], Tuning(num_splits=5, **MK)),
    # today's ar default (balanced splits) with the merge in the kernel
    (1, 1, 8, 700, [699], Tuning(num_splits=6, swap_ab=True, balanced_splits=True, **MK)),
    # swap-AB with more splits than ring slots (19 others through 16 slots: the ring wraps)
    (1, 1, 8, 2600, [2599], Tuning(num_splits=20, swap_ab=True, **MK)),
    # N=16 (2 row tiles, the 64-row kernel's 3-slot ring wrapping), N=64 (8 row tiles)
    (1, 16, 8, 600, [584], Tuning(num_splits=5, **MK)),
    (1, 64, 8, 300, [236], Tuning(num_splits=2, **MK)),
    # ragged B=4 with len 0 and empty splits, both kernels
    (4, 5, 8, 400, [395, 0, 17, 200], Tuning(num_splits=4, **MK)),
    (4, 1, 8, 400, [399, 0, 17, 200], Tuning(num_splits=6, swap_ab=True, **MK)),
    # two levels: chunks of 6 of 20 splits (the last chunk's 1 member + 3 leaders), swap-AB;
    # chunks of 3 of 7, ragged with len 0 (the last split alone in its chunk), 64-row kernel
    (1, 1, 8, 2600, [2599], Tuning(num_splits=20, swap_ab=True, merge_chunk=6, **MK)),
    (4, 5, 8, 900, [895, 0, 17, 600], Tuning(num_splits=7, merge_chunk=3, **MK)),
]


class TestMergeInKernelInterpret:

  @pytest.mark.parametrize("b,n,h,l,lengths,tuning", CASES)
  def test_correct(self, b, n, h, l, lengths, tuning):
    q, cache, ln, mask = tva.make_inputs(b, n, h, l, lengths, seed=n * h + l + b)
    tva.check_against_reference(q, cache, ln, mask, tuning)

  def test_packed_mask(self):
    """The model's call form (mask words packed once outside the call)."""
    q, cache, ln, mask = tva.make_inputs(2, 1, 8, 700, [699, 300], seed=7)
    packed = masks.pack_tree_mask(jnp.asarray(mask), 8)
    out, _ = tva._kernel_call(q, cache, ln, packed, scale=0.05,
                              tuning=Tuning(num_splits=5, swap_ab=True, **MK))
    ref, _ = tva.reference_on_cpu(q, cache, ln, mask, 0.05)
    assert tva.rel_err(jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)) <= 1e-2

  def test_wrong_source_is_caught(self, monkeypatch):
    """Mutation: a leader that folds source j + 1's partial instead of j's (one split twice,
    one never) fails the check."""
    real = merge_in_kernel._source_split
    monkeypatch.setattr(merge_in_kernel, "_source_split",
                        lambda c, j: jnp.minimum(real(c, j) + 1, c.t.num_splits - 2))
    jax.clear_caches()  # every jitted call traced so far (the wrapper's and api's) re-traces
    q, cache, ln, mask = tva.make_inputs(1, 1, 8, 700, [699], seed=5)
    with pytest.raises(AssertionError):
      tva.check_against_reference(q, cache, ln, mask, Tuning(num_splits=5, swap_ab=True, **MK))
    monkeypatch.undo()
    jax.clear_caches()


class TestMergeInKernelLowers:
  """CUDA lowering for an abstract H200: the release signal (red.release.gpu), the waiting CTA's
  acquire (fence.acquire.gpu) and the proxy fences are in the module, no merge kernel follows."""

  @pytest.mark.parametrize("b,n,h,tuning", [
      (1, 1, 8, Tuning(**(default_tuning(1, 1, 8, 46000).__dict__ | MK))),  # ar's + the merge
      (1, 1, 8, Tuning(num_splits=132, swap_ab=True, **MK)),
      (1, 1, 8, Tuning(num_splits=132, **MK)),
      (4, 1, 8, Tuning(num_splits=33, swap_ab=True, **MK)),
      (1, 8, 8, Tuning(num_splits=132, **MK)),
      (1, 16, 8, Tuning(num_splits=66, **MK)),
      (1, 64, 8, Tuning(num_splits=16, **MK)),
      (1, 1, 8, Tuning(num_splits=128, swap_ab=True, merge_chunk=12, **MK)),
      (1, 1, 8, Tuning(num_splits=132, merge_chunk=12, **MK))])
  def test_lowers(self, b, n, h, tuning):
    text = tva.TestLowersForGpu.lower_text(b, n, h, 46000, tuning)
    assert "red.release.gpu" in text and "fence.acquire.gpu" in text
    assert "fence.proxy.async.global" in text
    assert "triton" not in text.lower()

  def test_smem_fits(self):
    assert kernel.smem_bytes(Tuning(num_splits=132, **MK), C, R) <= SMEM_BYTES
    assert kernel_swap.smem_bytes(Tuning(num_splits=128, swap_ab=True, **MK), 8, C, R) <= SMEM_BYTES

  @pytest.mark.parametrize("tuning", [Tuning(num_splits=4, **MK),
                                      Tuning(num_splits=4, swap_ab=True, **MK)])
  def test_rejects_f32_q(self, tuning):
    """The ring holds bf16 partials and doubles as the final output's staging."""
    with pytest.raises(ValueError, match="bf16"):
      merge_in_kernel.check_supported(tuning, jnp.float32)

  @pytest.mark.parametrize("fields", [dict(merge_chunk=4), dict(cluster_rows=2, **MK),
                                      dict(merge_chunk=-1, **MK)])
  def test_tuning_rejects(self, fields):
    with pytest.raises(ValueError):
      Tuning(**fields)

  def test_default_off(self):
    for shape in [(1, 1, 8, 46000), (1, 16, 8, 46000), (4, 1, 8, 46000), (1, 64, 64, 46000)]:
      assert default_tuning(*shape).merge != "kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not tva.ON_GPU, reason="compiled kernel: GPU only")
class TestMergeInKernelGPU:
  """merge='kernel' compiled (the GMEM counters and the waiting CTA, which the interpreter does
  not run). ONE case, in its own file: a fault loses the process' CUDA context. The ar shape's
  swap-AB kernel (M = 8) at B=4 ragged with len 0 and empty splits, 33 splits (more than the 16
  ring slots). scripts/probe_verify_merge.py runs the full shapes one process each."""

  def test_ragged_many_splits(self):
    q, cache, ln, mask = tva.make_inputs(4, 1, 8, 4100, [4099, 0, 17, 2050], seed=33)
    tva.check_against_reference(q, cache, ln, mask, Tuning(num_splits=33, swap_ab=True, **MK))
