"""Issue 12's small-T knobs of the grouped expert matmul (notes/int4_small_t.md):
`Tuning.int4_step_overlap` (variant ov: the pipeline releases slots one step late and a K step
ends without draining its wgmmas) and `Tuning.slots_outer` (variant wo: the slot axis is the
grid's slowest); on the GPU also `Tuning.int4_k_interleaved` (kpi, test_grouped_matmul_kpairs.py).
Interpret mode vs the dequantise-first XLA reference (bf16 tolerance), the lowered wait counts
for an abstract H200, every new bench row lowered at K2.6's share, and (with `-m gpu`) the
register-operand path, which interpret mode cannot run.
"""

# pylint: disable=protected-access  (the sibling test module's helpers)
import dataclasses

import jax.numpy as jnp
import pytest

from pallas_kernels.grouped_matmul import Tuning, gated_grouped_matmul, grouped_matmul
from pallas_kernels.grouped_matmul import expert_mlp as pallas_expert_mlp
from pallas_kernels.grouped_matmul import bench
from pallas_kernels.grouped_matmul.tuning import apply_variant, default_tuning
import test_grouped_matmul_kernel as base  # the sibling module's operands, checks, lowering

SIZES = [30, 0, 50, 3, 10]  # ragged, one empty expert: M = 100 rows over 5 experts
WAIT = "asm:wgmma.wait_group.sync.aligned"


def _operand_sets(k, n, seed):
  x, _, q_a = base._operands(100, k, n, len(SIZES), 32, seed=seed)
  _, _, q_b = base._operands(100, k, n, len(SIZES), 32, seed=seed + 1)
  return x, q_a, q_b, jnp.asarray(SIZES, jnp.int32)


def _check_plain(t, k=512, n=128, seed=30):
  x, q_a, _, gs = _operand_sets(k, n, seed)
  base._check(grouped_matmul(x, q_a, gs, backend="interpret", tuning=t),
              grouped_matmul(x, q_a, gs, backend="xla"), sum(SIZES))


def _check_gated(t, k=512, n=128, seed=30):
  """Gated fused, and gated split-K through 2 slot columns == the XLA reference."""
  x, q_a, q_b, gs = _operand_sets(k, n, seed)
  want = gated_grouped_matmul(x, q_a, q_b, gs, backend="xla")
  for tun in (t, dataclasses.replace(t, splits=2, slots=2)):
    base._check(gated_grouped_matmul(x, q_a, q_b, gs, backend="interpret", tuning=tun), want,
                sum(SIZES))


def _ov(**opts):
  """An interpret-mode (SMEM-operand) tuning with int4_step_overlap."""
  return Tuning(**dict(dict(rows=32, block_n=64, stages=2, a_operand="smem",
                            int4_step_overlap=True, **base.LEAN), **opts))


# Each with exactly 2 wgmma rounds per K step (kernel._check_step_overlap).
@pytest.mark.parametrize("opts", [
    dict(block_k=128),  # 2 chunks, one per round; 4 K steps
    dict(block_k=256, int4_acc_chains=2, stages=3),  # 4 chunks, 2 per round; 2 K steps
])
def test_step_overlap_plain_interpret_matches_reference(opts):
  _check_plain(_ov(**opts))


@pytest.mark.parametrize("opts", [
    dict(block_k=128, int4_interleave_stacks=True),  # (g0, u0), (g1, u1); 4 K steps
    dict(block_k=256, int4_interleave_stacks=True, int4_acc_chains=2, stages=3),
    dict(block_k=64, stages=4),  # gate's round, then up's; 8 one-chunk K steps
])
def test_step_overlap_gated_interpret_matches_reference(opts):
  _check_gated(_ov(**opts))


def test_step_overlap_with_one_k_step_interpret_matches_reference():
  """One K step per CTA (the gated split-K call: K 512 over 2 splits of block_k 256; the
  pipeline shrinks to one slot, no release to delay)."""
  _check_gated(_ov(rows=16, block_k=256, stages=3, int4_interleave_stacks=True,
                   int4_acc_chains=2), n=64, seed=34)


@pytest.mark.parametrize("gated,opts", [
    (False, dict(block_k=64)),  # one round per step
    (True, dict(block_k=128, int4_interleave_stacks=True, int4_acc_chains=2)),  # one round
    (True, dict(block_k=128)),  # 2 + 2 rounds: the last may share registers with the first
])
def test_step_overlap_refuses_other_than_two_rounds_per_step(gated, opts):
  """With one round the next K step's dequantise rewrites the registers of in-flight wgmmas
  (ptxas does not guard the K loop's back edge); with 3+ nothing keeps them apart."""
  x, q_a, q_b, gs = _operand_sets(512, 128, 38)
  with pytest.raises(ValueError, match="2 wgmma rounds"):
    if gated:
      gated_grouped_matmul(x, q_a, q_b, gs, backend="interpret", tuning=_ov(**opts))
    else:
      grouped_matmul(x, q_a, gs, backend="interpret", tuning=_ov(**opts))


@pytest.mark.parametrize("opts", [dict(), dict(int4_step_overlap=True, int4_acc_chains=2,
                                                int4_interleave_stacks=True)])
def test_slots_outer_interpret_matches_reference(opts):
  """The slot axis slowest: 2 and 4 slot columns (4: one column with no live item at 4 items)."""
  t = Tuning(rows=32, block_n=64, block_k=256, stages=2, a_operand="smem", slots_outer=True,
             **base.LEAN, **opts)
  x, q_a, q_b, gs = _operand_sets(512, 128, 36)
  want = gated_grouped_matmul(x, q_a, q_b, gs, backend="xla")
  for slots in (2, 4):
    tun = dataclasses.replace(t, splits=2, slots=slots)
    base._check(gated_grouped_matmul(x, q_a, q_b, gs, backend="interpret", tuning=tun), want,
                sum(SIZES))
  tun = dataclasses.replace(t, slots=3)
  base._check(grouped_matmul(x, q_a, gs, backend="interpret", tuning=tun),
              grouped_matmul(x, q_a, gs, backend="xla"), sum(SIZES))


def test_variants_parse():
  t = default_tuning(8, 48, 7168, 2048, True, gated=True, variant="default")
  v = apply_variant("once+ismem+cat+kp+il+k64+p16+ov+wo", t, 7168, 2048)
  assert (v.block_k, v.splits, v.slots, v.int4_step_overlap, v.slots_outer) == (64, 16, 1,
                                                                                True, True)
  assert not t.int4_step_overlap and not t.slots_outer  # defaults off


def test_step_overlap_drops_the_per_step_drain():
  """Lowered for an H200 (gated il + a2 and down a2, K 512 / 256 at block_k 256: 2 rounds of
  2 chunks per step): ov removes the wait(0) per K step; the round waits and the accumulator
  reads' waits stay; no wgmma is added or dropped."""
  tg = Tuning(rows=8, block_n=64, block_k=256, stages=3, int4_scale_concat=True,
              int4_interleave_stacks=True, int4_acc_chains=2)
  td = dataclasses.replace(tg, int4_interleave_stacks=False)
  drained, overlapped = (
      base._module_op_counts(8, tuple(dataclasses.replace(t, int4_step_overlap=v)
                                      for t in (tg, td)))
      for v in (False, True))
  commit = "asm:wgmma.commit_group.sync.aligned;"
  assert drained[commit] == overlapped[commit]
  assert drained["asm:{"] == overlapped["asm:{"]
  # the K loop body is emitted once: one drain in the gated module (il), one in the down
  assert drained[WAIT] - overlapped[WAIT] == 2


NEW_ROWS = {t: bench.case_rows(t)[1:] for t in (1, 16)}  # after each case's control row


@pytest.mark.slow
@pytest.mark.parametrize("t", [1, 16])
def test_new_bench_rows_lower_for_h200(t):
  """Every new T=1 / T=16 mlp_tune row lowers for an abstract H200 at K2.6's share (48 local
  experts, D 7168, F 2048, INT4): the GPU run spends no time on one that cannot compile."""
  assert NEW_ROWS[t] and all(any(knob in r for knob in ("+ov", "+wo", "k64", "+kpi", "+pdl"))
                            for r in NEW_ROWS[t])
  for name in NEW_ROWS[t]:
    text = base._lower_expert_mlp_h200(8 * t, base._bench_tunings(name, 8 * t))
    assert "gmm_int4_gated_mosaic_gpu" in text and "gmm_int4_mosaic_gpu" in text, name


@pytest.mark.slow
@pytest.mark.parametrize("t,touched", [(1, 1), (16, 4)])
def test_new_bench_rows_interpret_match_reference(t, touched):
  """Each new row's (gated, down) tunings as the bench makes them (interpret: SMEM operand) on a
  small D / F, both calls on one work list == the XLA reference."""
  e_l, d, f, m = 48, 512, 256, 8 * t
  gs = base._class_sizes(t, touched)
  x, _, gate = base._operands(m, d, f, e_l, 32, seed=40)
  _, _, up = base._operands(m, d, f, e_l, 32, seed=41)
  _, _, down = base._operands(m, f, d, e_l, 32, seed=42)
  want = pallas_expert_mlp(x, gate, up, down, gs, backend="xla")[0]
  for name in NEW_ROWS[t]:
    # unpacked stacks here: kp and kpi (its values are kp's: test_grouped_matmul_kpairs.py) off
    plain = name.replace("+kpi", "").replace("+kp", "")
    tg, td = bench.mlp_tunings(plain, m, e_l, d, f, interpret=True)
    got = pallas_expert_mlp(x, gate, up, down, gs, backend="interpret", tunings=(tg, td))
    base._check(got.sum(axis=0), want, int(gs.sum()))


@pytest.mark.gpu
@pytest.mark.parametrize("gated,opts", [  # the T=1 / T=16 rows' step shapes (2 rounds each)
    (True, dict(block_k=128, int4_interleave_stacks=True, stages=4)),
    (True, dict(block_k=64, stages=4)),
    (True, dict(block_k=256, int4_interleave_stacks=True, int4_acc_chains=2, stages=3,
                slots_outer=True)),
    (False, dict(block_k=256, int4_acc_chains=2, stages=4)),
])
def test_step_overlap_gpu_register_operand_matches_reference(gated, opts):
  """ov on the H200's register A operand (its registers and the accumulators in flight across
  the K loop's back edge: what interpret mode cannot check), K-packed + select-free scales,
  on K2.6-like K: gated fused and split-K through the slots loop, or plain."""
  from pallas_kernels.grouped_matmul import kpack  # pylint: disable=import-outside-toplevel
  t = Tuning(rows=16, block_n=64, int4_step_overlap=True, int4_scale_concat=True,
             int4_k_packed=True, **base.LEAN, **opts)
  x, q_a, q_b, gs = _operand_sets(2048, 256, 44)
  pack = lambda w: (kpack.pack_int4_k(w[0]), w[1])
  if not gated:
    base._check(grouped_matmul(x, pack(q_a), gs, backend="pallas", tuning=t),
                grouped_matmul(x, q_a, gs, backend="xla"), sum(SIZES))
    return
  want = gated_grouped_matmul(x, q_a, q_b, gs, backend="xla")
  for tun in (t, dataclasses.replace(t, splits=2, slots=4)):
    base._check(gated_grouped_matmul(x, pack(q_a), pack(q_b), gs, backend="pallas",
                                     tuning=tun), want, sum(SIZES))


@pytest.mark.gpu
@pytest.mark.parametrize("gated,opts", [  # the T=65 / T=1 / T=16 control rows' step shapes
    (True, dict(rows=8, block_k=256, stages=3)),
    (False, dict(rows=8, block_k=256, stages=2, int4_acc_chains=2)),
    (True, dict(rows=8, block_k=128, stages=4, int4_interleave_stacks=True, int4_acc_chains=2,
                splits=2, slots=4)),
    (True, dict(rows=16, block_k=256, stages=2, int4_interleave_stacks=True, int4_acc_chains=2,
                splits=2, slots=4)),
])
def test_k_interleaved_gpu_register_operand_equals_k_packed(gated, opts):
  """kpi (kpairs.py: one LOP3 per bf16 pair, its PTX and register relabel, which interpret mode
  cannot run) on the H200's register A operand: bit-equal to the kp kernel on the same weights
  (the same dequantised values into the same wgmmas) and within one bf16 rounding of XLA."""
  # pylint: disable-next=import-outside-toplevel
  from pallas_kernels.grouped_matmul import kpack, kpairs
  t = Tuning(block_n=64, int4_scale_concat=True, int4_k_packed=True, **base.LEAN, **opts)
  ti = dataclasses.replace(t, int4_k_interleaved=True)
  x, q_a, q_b, gs = _operand_sets(2048, 256, 46)
  kp = lambda w: (kpack.pack_int4_k(w[0]), w[1])
  kpi = lambda w: (kpairs.pack_int4_k_pairs(w[0]), w[1])
  if gated:
    run = lambda tun, pack: gated_grouped_matmul(x, pack(q_a), pack(q_b), gs, backend="pallas",
                                                 tuning=tun)
    want = gated_grouped_matmul(x, q_a, q_b, gs, backend="xla")
  else:
    run = lambda tun, pack: grouped_matmul(x, pack(q_a), gs, backend="pallas", tuning=tun)
    want = grouped_matmul(x, q_a, gs, backend="xla")
  rows = sum(SIZES)
  got = run(ti, kpi)
  assert (jnp.asarray(got)[:rows] == jnp.asarray(run(t, kp))[:rows]).all()
  base._check(got, want, rows)


@pytest.mark.slow
def test_t9_bench_rows_lower_for_h200():
  """Every T=9 mlp_tune row (issue 12's T=9 line: the control, kpi, and the T=16 / T=65 classes'
  forms at R 8) lowers for an abstract H200 at K2.6's share, both calls with the same R."""
  rows = bench.case_rows(9)
  assert len(rows) == len(set(rows)) > 1
  for name in rows:
    tunings = base._bench_tunings(name, 8 * 9)
    assert tunings[0].rows == tunings[1].rows == 8, name
    text = base._lower_expert_mlp_h200(8 * 9, tunings)
    assert "gmm_int4_gated_mosaic_gpu" in text and "gmm_int4_mosaic_gpu" in text, name
