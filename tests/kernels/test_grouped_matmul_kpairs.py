"""`Tuning.int4_k_interleaved` (variant kpi, kpairs.py): INT4 stacks K-packed so that each bf16
pair's two nibbles sit 16 bits apart in the thread's 32-bit word, dequantised by one LOP3 per pair
and a bf16 subtract. Checks: the storage table against the WGMMA register columns, the bit
formula exhaustively against the nibbles' integer values (so n * scale is the very product the
K-packed path rounds), interpret mode bit-equal to the kp path and within one bf16 rounding of
the XLA reference, the knob's plumbing. The compiled PTX is the GPU test's
(test_grouped_matmul_small_t.py) and the SASS counts' (notes/int4_dequant_pairs.md).
"""

# pylint: disable=protected-access  (the sibling test module's helpers)
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import (Tuning, gated_grouped_matmul, grouped_matmul, kpack,
                                           kpairs)
from pallas_kernels.grouped_matmul.tuning import apply_variant, default_tuning
import test_grouped_matmul_kernel as base

SIZES = [30, 0, 50, 3, 10]


def test_storage_table_matches_the_wgmma_pairs():
  """WGMMA register i of lane l holds columns 8i + 2l + e (e = 0, 1) as one bf16 pair; the kernel
  takes it from nibble slots i % 4 (e = 0) and i % 4 + 4 (e = 1) of UPCAST_4X word i // 4 of the
  same lane, i.e. storage column 32 (i // 4) + 8l + 4e + i % 4; a 32-column group stays put."""
  assert sorted(kpairs.STORED_COLUMN) == list(range(64))
  for lane, i, e in np.ndindex(4, 8, 2):
    storage = 32 * (i // 4) + 8 * lane + 4 * e + i % 4
    assert kpairs.STORED_COLUMN[storage] == 8 * i + 2 * lane + e
  assert (kpairs.STORED_COLUMN // 32 == np.arange(64) // 32).all()


def test_pack_and_unpack_are_inverse_permutations():
  q = jnp.asarray(np.random.default_rng(0).integers(-8, 8, size=(3, 5, 192)), jnp.int4)
  packed = kpairs.pack_int4_k_pairs(q)
  want = np.asarray(q, np.int32).reshape(3, 5, 3, 64)[..., kpairs.STORED_COLUMN]
  np.testing.assert_array_equal(np.asarray(packed, np.int32).reshape(3, 5, 3, 64), want)
  np.testing.assert_array_equal(np.asarray(kpairs.unpack_int4_k_pairs(packed), np.int32),
                                np.asarray(q, np.int32))
  np.testing.assert_array_equal(  # the in-kernel emulation's reshape-transpose, per block
      np.asarray(kpairs.logical_order(packed[0, :, 64:128]), np.int32),
      np.asarray(q, np.int32)[0, :, 64:128])
  with pytest.raises(ValueError, match="multiple of 64"):
    kpairs.pack_int4_k_pairs(q[..., :32])


def _words(slots):
  """uint32 words from nibbles [..., 8] (slot s at bits 4s .. 4s + 3, two's complement)."""
  slots = np.asarray(slots, np.int64) & 0xF
  return (slots << (4 * np.arange(8))).sum(axis=-1).astype(np.uint32)


def test_pair_formula_gives_every_nibble_value_exactly():
  """The kernel's shift / mask / xor / bf16 subtract (in numpy, kpairs.reference_words) on every
  value in every slot and on 2^16 random words: pair j = (slot j, slot j + 4) as exact integers.
  Then n * scale rounded once is bit-equal to the current dequantise's product for every finite
  bf16 scale (the values are the same floats; checked, not assumed, on all 2^16 patterns)."""
  rng = np.random.default_rng(1)
  every = np.repeat(np.arange(-8, 8)[:, None], 8, axis=1)  # all slots t, t = -8..7
  shifted = np.stack([np.roll(np.arange(-8, 0), s) for s in range(8)])  # distinct per slot
  rand = rng.integers(-8, 8, size=(1 << 16, 8))
  slots = np.concatenate([every, shifted, shifted + 8, rand])
  got = kpairs.reference_words(_words(slots))  # [..., 4, 2]
  want = np.stack([slots[:, :4], slots[:, 4:]], axis=-1).astype(np.float32)
  np.testing.assert_array_equal(got, want)
  n = jnp.asarray(np.arange(-8, 8), jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(kpairs.pair_bits(jnp.arange(-8, 8)), np.float32),
                                np.asarray(n, np.float32))
  scales = np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16)
  scales = jnp.asarray(scales[np.isfinite(scales.astype(np.float32))])
  ours = kpairs.pair_bits(jnp.arange(-8, 8))[:, None] * scales[None, :]
  today = jnp.arange(-8, 8).astype(jnp.int4).astype(jnp.bfloat16)[:, None] * scales[None, :]
  np.testing.assert_array_equal(np.asarray(ours).view(np.uint16),
                                np.asarray(today).view(np.uint16))


def _operands(k=512, n=128, seed=50):
  x, _, q_a = base._operands(100, k, n, len(SIZES), 32, seed=seed)
  _, _, q_b = base._operands(100, k, n, len(SIZES), 32, seed=seed + 1)
  return x, q_a, q_b, jnp.asarray(SIZES, jnp.int32)


def _tuning(**opts):
  """An interpret-mode (SMEM-operand) K-packed tuning; kpi adds int4_k_interleaved."""
  return Tuning(**dict(dict(rows=32, block_n=64, block_k=128, stages=2, a_operand="smem",
                            int4_k_packed=True, int4_scale_concat=True, **base.LEAN), **opts))


def _packs(stack):
  """(kp-packed, pair-packed) copies of an INT4 stack (q, s)."""
  return (kpack.pack_int4_k(stack[0]), stack[1]), (kpairs.pack_int4_k_pairs(stack[0]), stack[1])


@pytest.mark.parametrize("opts", [dict(), dict(block_k=256, int4_acc_chains=2, stages=3)])
def test_plain_interpret_equals_k_packed_bit_for_bit(opts):
  """Same dequantised values, same MMAs: the kpi output is the kp output exactly, and within one
  bf16 rounding of the XLA reference on the stack as stored."""
  x, q_a, _, gs = _operands()
  kp, kpi = _packs(q_a)
  t = _tuning(**opts)
  want = grouped_matmul(x, kp, gs, backend="interpret", tuning=t)
  got = grouped_matmul(x, kpi, gs, backend="interpret",
                       tuning=dataclasses.replace(t, int4_k_interleaved=True))
  rows = sum(SIZES)
  np.testing.assert_array_equal(np.asarray(got, np.float32)[:rows],
                                np.asarray(want, np.float32)[:rows])
  base._check(got, grouped_matmul(x, q_a, gs, backend="xla"), rows)


@pytest.mark.parametrize("opts", [dict(int4_interleave_stacks=True),
                                  dict(splits=2, slots=2, int4_interleave_stacks=True),
                                  dict(splits=2, slots=2)])
def test_gated_interpret_equals_k_packed_bit_for_bit(opts):
  x, q_a, q_b, gs = _operands(seed=52)
  (kp_a, kpi_a), (kp_b, kpi_b) = _packs(q_a), _packs(q_b)
  t = _tuning(**opts)
  want = gated_grouped_matmul(x, kp_a, kp_b, gs, backend="interpret", tuning=t)
  got = gated_grouped_matmul(x, kpi_a, kpi_b, gs, backend="interpret",
                             tuning=dataclasses.replace(t, int4_k_interleaved=True))
  rows = sum(SIZES)
  np.testing.assert_array_equal(np.asarray(got, np.float32)[:rows],
                                np.asarray(want, np.float32)[:rows])
  base._check(got, gated_grouped_matmul(x, q_a, q_b, gs, backend="xla"), rows)


def test_xla_reference_undoes_the_pair_packing():
  """backend xla with a kpi tuning reads pair-packed stacks as the unpacked reference does."""
  x, q_a, _, gs = _operands(k=256, n=64, seed=54)
  _, kpi = _packs(q_a)
  t = _tuning(int4_k_interleaved=True)
  np.testing.assert_array_equal(
      np.asarray(grouped_matmul(x, kpi, gs, backend="xla", tuning=t), np.float32),
      np.asarray(grouped_matmul(x, q_a, gs, backend="xla"), np.float32))


def test_variant_and_field_checks():
  t = default_tuning(520, 48, 7168, 2048, True, gated=True, variant="default")
  assert not t.int4_k_interleaved and not t.int4_k_packed  # default off
  v = apply_variant("once+ismem+r8+s3+w16+cat+kpi", t, 7168, 2048)
  assert v.int4_k_packed and v.int4_k_interleaved
  with pytest.raises(ValueError, match="set int4_k_packed"):
    Tuning(int4_k_interleaved=True)
  x, q_a, _, gs = _operands(k=256, n=64, seed=56)
  with pytest.raises(ValueError, match="dequantises to bf16"):
    grouped_matmul(x.astype(jnp.float16), _packs(q_a)[1], gs, backend="interpret",
                   tuning=_tuning(int4_k_interleaved=True))


def test_every_case_has_a_kpi_row_beside_its_control():
  # pylint: disable-next=import-outside-toplevel
  from pallas_kernels.grouped_matmul import bench
  for t in (1, 16, 65):
    control, kpi = bench.case_rows(t)[:2]
    assert kpi == "|".join(p + "+kpi" for p in control.split("|"))
    tg, td = bench.mlp_tunings(kpi, 8 * t, 48, 7168, 2048)
    assert tg.int4_k_interleaved and td.int4_k_interleaved


def _asm_blocks(tunings, m=8):
  """The inline-asm strings of expert_mlp's two Mosaic modules lowered for an H200 (D 512,
  F 256), as base._module_op_counts walks them."""
  # pylint: disable=import-outside-toplevel
  import jax
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import core
  from jax.experimental.mosaic.gpu import dialect as mgpu_dialect
  core.KNOWN_KERNELS.clear()
  jax.clear_caches()
  base._lower_expert_mlp_h200(m, tunings, d=512, f=256)
  assert len(core.KNOWN_KERNELS) == 2
  asm = []
  with jax_mlir._create_ir_context() as ctx, ir.Location.unknown():
    mgpu_dialect.register_dialect(ctx)
    ctx.append_dialect_registry(jax_mlir.upstream_dialects)
    ctx.load_all_available_dialects()
    ctx.allow_unregistered_dialects = True
    for module_bytes in core.KNOWN_KERNELS.values():
      module = core._run_serde_pass(ir.Module.parse(module_bytes), serialize=False)
      stack = [module.operation]
      while stack:
        for region in stack.pop().regions:
          for block in region:
            for op in block:
              if op.operation.name == "llvm.inline_asm":
                asm.append(ir.StringAttr(op.operation.attributes["asm_string"]).value)
              stack.append(op.operation)
  return asm


def test_lowered_dequantise_has_no_prmt():
  """Per thread and chunk (gated 2 stacks + down, block_k 256: 12 chunks per K step, the loop
  body emitted once): kp's 16 conversions each hold a prmt; kpi's 16 hold none, one lop3 each,
  the same bf16 subtract; the scale multiplies are outside the asm in both."""
  t = Tuning(rows=8, block_n=64, block_k=256, stages=2, int4_k_packed=True,
             int4_scale_concat=True, **base.LEAN)
  kp, kpi = (_asm_blocks((tun, tun))
             for tun in (t, dataclasses.replace(t, int4_k_interleaved=True)))
  chunks = 2 * 256 // 64 + 256 // 64
  count = lambda blocks, s: sum(s in a for a in blocks)
  assert count(kp, "prmt.b32") == 16 * chunks and count(kpi, "prmt.b32") == 0
  assert count(kp, "lop3.b32") == count(kpi, "lop3.b32") == 16 * chunks
  assert count(kp, "sub.bf16x2") == count(kpi, "sub.bf16x2") == 16 * chunks
  assert count(kpi, "shr.u32") == 12 * chunks
