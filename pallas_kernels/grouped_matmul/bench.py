"""Routed experts on one GPU's share of K2.6 (top-8 over 384 experts, 48 held here), CUPTI-timed.

Parts, in order of value (a time box loses the least):
  1. `ffn`: the routed-expert FFN (3 grouped GEMMs + glue) at T in --tokens, bf16 and INT4,
     our kernel vs XLA `ragged_dot` vs JAX's `ragged_dot_mgpu`: experts touched, weight bytes
     needed, us, TB/s and % of the copy bandwidth measured in the same run.
  2. `tune`: one grouped GEMM (gate, INT4 and bf16) at T in --tune_tokens for each --gemm_tunings.
  2b. `mlp_tune`: the INT4 routed-expert FFN's two kernel calls (gated gate|up, then down, one
     work list) at --mlp_cases (T, local experts touched): the promoted default tuning and each
     --mlp_variants (changes to both calls' base tunings), per-call Mosaic us from CUPTI (not in
     the default --parts).
  3. `layer`: the whole MoE layer (router + routed + shared + glue) vs its weight-streaming floor,
     per --layer_variants (glue sorted vs dense, optionally + TargetConfig fields, e.g.
     sorted+router_impl=pallas) and --layer_layouts (the decode layout, as decode runs it, or
     the loaded one), launches and glue us each.
Every output is checked against the f32 XLA reference first; a row further than REL_TOL (bf16)
is marked FAIL in the table and never reported as the fastest. One JSON line per row in --out.

  python -m pallas_kernels.grouped_matmul.bench --out runs/bench_moe.jsonl
"""

import dataclasses
import functools
import itertools
import json
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import bench_models, roofline, timing
from kdtree_jax.config_overrides import with_overrides
from pallas_kernels import bench_flags
from kdtree_jax.checkpoint import int4
from kdtree_jax.target import config as C
from kdtree_jax.target import experts, moe
from kdtree_jax.target import pack
from kdtree_jax.target import params as P
from pallas_kernels.grouped_matmul import (Tuning, expert_mlp, grouped_matmul, kernel, kpack,
                                           kpairs, work)
from pallas_kernels.grouped_matmul.tuning import apply_variant, call_variant, default_tuning

_T = flags.DEFINE_list("tokens", ["1", "9", "17", "33", "65"], "Token counts (verify widths).")
_TUNE_T = flags.DEFINE_list("tune_tokens", ["1", "16", "65"], "Token counts of the tuning sweep.")
_E = flags.DEFINE_integer("experts", 384, "Experts the router scores.")
_EL = flags.DEFINE_integer("local", 48, "Experts held on this GPU (the first `local`).")
_K = flags.DEFINE_integer("topk", 8, "Experts per token.")
_D = flags.DEFINE_integer("hidden", 7168, "Hidden size.")
_F = flags.DEFINE_integer("ffn", 2048, "Expert width.")
_FORMATS = flags.DEFINE_list("formats", ["int4", "bf16"], "Expert weight formats.")
_IMPLS = flags.DEFINE_list("impls", ["pallas", "mgpu"], "Grouped matmuls to compare.")
_TUNINGS = flags.DEFINE_list(
    "gemm_tunings", ["default", "r16n64k512s4", "r16n64k256s6", "r8n64k256s4x4",
                "r16n128k256s4", "r8n64k256s4x7w1", "r8n64k256s4x7w2"],
    "Tuning sweep: 'default' or rR nBN kBK sSTAGES [xSPLITS] [wSLOTS] [smem] (bf16 rows use "
    "kBK/2).")
_MLP_CASES = flags.DEFINE_list(
    "mlp_cases", ["16:14", "1:1", "9:8", "65:36"],
    "mlp_tune: T:E, T tokens (T*K rows, T of them local pairs) on E local experts touched "
    "(ar: 1:1; T=9: ~8 of 48; a ddtree 15 verify: ~14, 13.7 on bench_k26_full's zero-mean "
    "model, 3.5 on its collapsed one before s26; T=65: ~36), "
    "spread evenly; or T:layer, the `layer` part's own routing of T tokens (uneven: T=65 puts "
    "81 local pairs on 36 experts, up to 6 on one). A ':a8' suffix lays the rows out with each "
    "expert's first row 8-aligned (gaps between experts: no expert's rows straddle an 8-row "
    "window boundary, so at R 8 an expert of <= 8 rows is one work item).")
# mlp_tune's rows per case T: 'promoted' (default_tuning's choice by M, tuning.DEFAULT_VARIANTS)
# and tuning.apply_variant names applied to the base tuning (variant 'default'). A small-T INT4
# call is bound by the dequantise -> wgmma chain of the SMs that run 2 CTAs, not by bytes
# (WORKSPACE.md "INT4 expert kernels at small T"), so the knobs shorten or spread that chain:
#   il: gate and up chunks dequantised together, one wgmma wait per pair, one drain per K step;
#   aN: each stack's chunks alternate over N accumulators (two chains per stack);
#   pN / xN: exactly N / N x the K splits (more CTAs, fewer K steps each), cC: ~C CTAs per SM;
#   wN: no split, slot columns for ~N CTAs per SM (one pipeline fill per live item);
#   kBK / sN: K per pipeline step, stages;
#   nrN: items with <= N rows in their window take a second path with wgmma N = N.
# The eighth session's four sweeps and what they promoted: WORKSPACE.md "INT4 expert kernels:
# the eighth session's sweeps". Open from its last round (cut by the time box): T=65 gate|up on
# 4 stages, down on 3. Each case's first row is the promoted variant + kp (the decode layout's),
# the control; T=9 runs its promoted row.
# T=1 (int4t, notes/int4_small_t.md): after the control, T=1 gated at block_k 64 x 16 splits
# (512 CTAs: ~4 warpgroups per SM for the same 56 chunks on the busiest SM, vs 2 now; s11:
# 25.1 vs 22.7 us). The small-T knobs ov and wo measured no gain and were removed (notes).
_D1 = "once+ismem+cat+kp+a2+p4"
_G1 = "once+ismem+cat+kp+il+a2+k128+p8"
_G1_K64 = "once+ismem+cat+kp+il+k64+p16"
# T=16 (a DDTree 15 verify: ~14 of 48 local experts on the zero-mean bench model, 16:14): the
# control (since s27 the T=9 class's form, R 8: H100 162.9 vs 166.5 us), kpi, the R 16 form
# promoted before s27 (T16_R16: the H200's A/B), pdl.
T16_R16 = "once+ismem+p2c4+s2+cat+kp+il+a2|once+ismem+cat+kp+n128+s2+w4+a2"
_D65 = "once+ismem+r8+s2+w16+cat+kp+a2"
_G65 = "once+ismem+r8+s3+w16+cat+kp"
# kpi (dq11, kpairs.py): each case's control with the pair-interleaved K-pack (one LOP3 per
# bf16 pair, no PRMT; the same values), right after it.
# T=9 (8 experts; issue 12's T=9 line, 88.3 us vs its 75.6 bound, s8 with x4c4): the control
# (promoted in s18 from H100 runs: the then T=16 class's gate|up form at R 8, down at block_n 128),
# kpi, the previous gate|up (x4c4) and the previous down (block_n 64) for the H200's A/B, and
# the T=65 class's form at R 8 (a persistent grid over 8 live experts; its w8 form, the slowest
# row on an H100 in s14 at 112.0 us, and x4c4 + il + a2 were dropped to keep 18 programs).
_G9 = "once+ismem+p2c4+s2+cat+kp+il+a2+r8"
_D9 = "once+ismem+cat+kp+n128+s2+r8+w4+a2"  # block_n 128 promoted in s18 (H100)
MLP_VARIANTS = {
    9: (f"{_G9}|{_D9}", f"{_G9}+kpi|{_D9}+kpi", f"once+ismem+x4c4+s2+r8+cat+kp|{_D9}",
        f"{_G9}|once+ismem+cat+s2+r8+w4+a2+kp", f"{_G65}|{_D65}", f"{_G65}+kpi|{_D65}+kpi"),
    1: (f"{_G1}|{_D1}", f"{_G1}+kpi|{_D1}+kpi", f"{_G1_K64}|{_D1}"),
    16: (f"{_G9}|{_D9}", f"{_G9}+kpi|{_D9}+kpi", T16_R16),
    65: (f"{_G65}|{_D65}", f"{_G65}+kpi|{_D65}+kpi", f"{_G65}+s4|{_D65}", f"{_G65}|{_D65}+s3"),
}
# pdl (pdl11, pallas_kernels/pdl.py): the T=1 / T=16 control rows with programmatic dependent
# launch (both calls), after every other row of the case: 18 programs in all (24 before the
# ov / wo rows were removed, which took moe_tune:300 in s11).
_PDL_ROWS = {1: f"{_G1}+pdl|{_D1}+pdl", 16: f"{_G9}+pdl|{_D9}+pdl"}
MLP_VARIANTS = {t: rows + ((_PDL_ROWS[t],) if t in _PDL_ROWS else ())
                for t, rows in MLP_VARIANTS.items()}


def case_rows(t: int) -> tuple[str, ...]:
  """mlp_tune's default rows for a case of T tokens: MLP_VARIANTS[T], else the promoted one."""
  return MLP_VARIANTS.get(t, ("promoted",))


_MLP_VARIANTS = flags.DEFINE_list(
    "mlp_variants", [],
    "mlp_tune: rows for every case: 'promoted' (default_tuning's choice) or tuning.apply_variant "
    "names ('+'-joined changes to both calls' base tunings: once, ismem, cat, kp, il, dqN, aN, "
    "rN, nrN, kBK, sN, nBN, xN[cC], pN[cC], wN, kpi; 'default': none; 'GATED|DOWN': "
    "one per call, same rN); empty: MLP_VARIANTS[T] per case, else promoted (18 programs): "
    f"{MLP_VARIANTS}.")
# A row whose output is further than this from the f32 XLA reference (relative L2 error) is
# wrong, not slow: bf16 inputs and one bf16 rounding of each product give ~2e-3 here.
REL_TOL = 1e-2
_PARTS = flags.DEFINE_list("parts", ["ffn", "tune", "layer"],
                           "Parts to run, in this order (also: mlp_tune).")
_OUT = flags.DEFINE_string("out", "runs/bench_moe.jsonl", "JSON lines output.")
_HLO_DIR = flags.DEFINE_string(
    "hlo_dir", "", "If set, the `layer` part writes each variant's optimized HLO per T there "
    "(layer_<variant>_T<T>.hlo.txt: which code each fusion / launch came from).")


def _route(key, t):
  """Independent top-k of E experts per token; pairs outside the local stack contribute 0."""
  scores = jax.random.uniform(key, (t, _E.value))
  idx = jnp.argsort(-scores, axis=1)[:, :_K.value].astype(jnp.int32)
  return idx, jax.random.uniform(jax.random.fold_in(key, 1), (t, _K.value), jnp.float32)


def _weights(fmt):
  e, d, f = _EL.value, _D.value, _F.value
  ks = jax.random.split(jax.random.key(7), 3)
  shapes = [(e, d, f), (e, d, f), (e, f, d)]
  q = [int4.random_int4(k, s, 0.02) for k, s in zip(ks, shapes)]
  return q if fmt == "int4" else [int4.dequantize(m, jnp.bfloat16) for m in q]


def _expert_bytes(fmt):
  """Bytes of one expert's three matrices (INT4: 0.5 B per weight + one bf16 scale per 32)."""
  n = 3 * _D.value * _F.value
  return n * (0.5 + 2 / 32) if fmt == "int4" else 2 * n


def _mgpu_ffn(x, idx, w, gate, up, down):
  """The expert FFN on JAX's ragged_dot_mgpu (bf16 only), with our FFN's sort and combine."""
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # pylint: disable=import-outside-toplevel
  blocks = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
  rd = lambda a, b, s: ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s, **blocks)
  order, rank, sizes, _, mine = experts.sorted_pair_layout(idx, gate.shape[0])
  xs = x[order // idx.shape[1]]
  h = jax.nn.silu(rd(xs, gate, sizes)) * rd(xs, up, sizes)
  return experts.combine_pairs(rd(h, down, sizes).astype(jnp.float32)[None], rank, mine, w)


def _local_touched(idx, local=None):
  """Distinct experts among the first `local` (--local) that the routing `idx` [T, K] touches."""
  local = _EL.value if local is None else local
  return int(np.unique(np.asarray(idx)[np.asarray(idx) < local]).size)


def _time_us(fn, *args):
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  if jax.default_backend() != "gpu":
    return 1e6 * roofline.wall_time_s(fn, *args, reps=3, warmup=1)
  _, ts = profiler.measure(fn, iterations=bench_flags.REPS.value)(*args)
  return 1e3 * sorted(ts)[len(ts) // 2]


def _rel(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _emit(rows, row, sink):
  if "rel_err" in row:
    row["ok"] = not failed(row)
  rows.append(row)
  sink.write(json.dumps(row) + "\n")
  sink.flush()
  print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                 if k != "kernels"),
        flush=True)


def part_ffn(ceil, sink, rows):
  for fmt in _FORMATS.value:
    ws = _weights(fmt)
    ref_ws = [int4.dequantize(m, jnp.float32) if fmt == "int4" else m.astype(jnp.float32)
              for m in ws]
    for t in map(int, _T.value):
      idx, w = _route(jax.random.key(t), t)
      x = jax.random.normal(jax.random.key(100 + t), (t, _D.value), jnp.bfloat16)
      ref = experts.expert_ffn(x.astype(jnp.float32), idx, w, *ref_ws, impl="xla")
      touched = _local_touched(idx)
      need = touched * _expert_bytes(fmt)
      for impl in _IMPLS.value:
        if impl == "mgpu" and fmt != "bf16":
          continue
        fn = (jax.jit(_mgpu_ffn) if impl == "mgpu" else
              jax.jit(lambda x, i, w, ws, impl=impl: experts.expert_ffn(x, i, w, *ws, impl=impl)))
        args = (x, idx, w, *ws) if impl == "mgpu" else (x, idx, w, ws)
        row = dict(part="ffn", fmt=fmt, impl=impl, T=t, experts_touched=touched,
                   bytes_needed=need)
        try:
          row["rel_err"] = _rel(fn(*args), ref)
          row["us"] = _time_us(fn, *args)
        except Exception as ex:  # one failing variant must not hide the rest
          row["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
        else:
          row["tbps"] = need / row["us"] / 1e6
          row["pct_copy"] = 100 * row["tbps"] / ceil["copy_tbps"]
          row["pct_floor_plus_10us"] = 100 * (need / ceil["copy_tbps"] / 1e6 + 10) / row["us"]
        _emit(rows, row, sink)


def _parse_tuning(s, fmt, default):
  """'default' -> `default`; 'r16n64k256s4x2w1smem' -> Tuning (bf16 takes half the K step)."""
  if s == "default":
    return default
  smem = s.endswith("smem")
  s = s.removesuffix("smem")
  r, rest = s[1:].split("n")
  n, rest = rest.split("k")
  k, rest = rest.split("s")
  rest, _, slots = rest.partition("w")
  st, _, splits = rest.partition("x")
  k = int(k) if fmt == "int4" else int(k) // 2
  return Tuning(rows=int(r), block_n=int(n), block_k=k, stages=int(st), splits=int(splits or 1),
                slots=int(slots or 0), a_operand="smem" if smem else "registers")


def part_tune(ceil, sink, rows):
  for fmt in _FORMATS.value:
    gate = _weights(fmt)[0]
    ops = (gate.packed, gate.scale) if fmt == "int4" else (gate,)
    for t in map(int, _TUNE_T.value):
      idx, _ = _route(jax.random.key(t), t)
      key = jnp.where(idx.reshape(-1) < _EL.value, idx.reshape(-1), _EL.value)
      sizes = jnp.bincount(key, length=_EL.value + 1)[:-1].astype(jnp.int32)
      x = jax.random.normal(jax.random.key(5), (t * _K.value, _D.value), jnp.bfloat16)
      ref = grouped_matmul(x, ops, sizes, backend="xla")
      live = int(sizes.sum())
      need = int((sizes > 0).sum()) * _expert_bytes(fmt) / 3
      default = default_tuning(x.shape[0], _EL.value, _D.value, _F.value, fmt == "int4")
      for name in _TUNINGS.value:
        tun = _parse_tuning(name, fmt, default)
        row = dict(part="tune", fmt=fmt, T=t, tuning=name, bytes_needed=need)
        fn = jax.jit(lambda x, ops, s, tun=tun: grouped_matmul(x, ops, s, backend="pallas",
                                                             tuning=tun))
        try:
          row["rel_err"] = _rel(fn(x, ops, sizes)[:live], ref[:live])
          row["us"] = _time_us(fn, x, ops, sizes)
        except Exception as ex:
          row["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
        else:
          row["tbps"] = need / row["us"] / 1e6
          row["pct_copy"] = 100 * row["tbps"] / ceil["copy_tbps"]
        _emit(rows, row, sink)


def _mlp_sizes(t, touched):
  """Rows per local expert: T local pairs (one GPU's share of T x K) over `touched` experts
  spread across the stack, as even as the count allows."""
  sizes = np.zeros(_EL.value, np.int32)
  where = np.linspace(0, _EL.value - 1, touched).round().astype(int)
  sizes[where] = t // touched
  sizes[where[:t % touched]] += 1
  return jnp.asarray(sizes)


def mlp_tunings(name, m, e_l, d, f, interpret=False):
  """(gated, down) tunings of an mlp_tune row: 'promoted' = default_tuning's own choice for M
  rows (tuning.DEFAULT_VARIANTS), else the apply_variant name ('GATED|DOWN': one per call) on
  the base tuning."""
  variant = None if name == "promoted" else "default"
  tg = default_tuning(m, e_l, d, f, True, interpret=interpret, gated=True, variant=variant)
  td = default_tuning(m, e_l, f, d, True, interpret=interpret, variant=variant)
  if name == "promoted":
    return tg, td
  return (apply_variant(call_variant(name, True), tg, d, f),
          apply_variant(call_variant(name, False), td, f, d))


def _packed_for(tg, td, gate, up, down):
  """The stacks each call reads: K-packed (kpack.pack_int4_k, once, where a model would load
  its weights) for a tuning with int4_k_packed, pair-packed (kpairs.pack_int4_k_pairs) with
  int4_k_interleaved, else as stored."""
  def pack(w, t):
    if not t.int4_k_packed:
      return w
    return (kpairs.pack_int4_k_pairs(w[0]) if t.int4_k_interleaved else kpack.pack_int4_k(w[0]),
            w[1])
  return pack(gate, tg), pack(up, tg), pack(down, td)


@functools.cache
def _k26_layer():
  """(config, layer 1's params) of the `layer` part: one init per process (mlp_tune's T:layer
  cases route on the same router)."""
  base = bench_models.k26_share(layers=2)
  return base, P.init_params(jax.random.key(0), base, jnp.bfloat16, int4_experts=True)["layers"][1]


def case_sizes(case: str, local: int | None = None):
  """(T, rows per local expert [local, default --local]) of an --mlp_cases entry: 'T:E' (T local
  pairs spread evenly over E experts) or 'T:layer' (the `layer` part's routing of its typical T
  tokens: the local pairs it draws, on the experts it picks)."""
  t_s, e_s = case.split(":")[:2]
  t = int(t_s)
  if e_s != "layer":
    return t, _mlp_sizes(t, int(e_s))
  local = _EL.value if local is None else local
  base, layer = _k26_layer()
  if base.num_local_experts != local:
    raise ValueError(f"--mlp_cases {case}: the layer holds {base.num_local_experts} experts, "
                     f"--local is {local}")
  _, idx = _typical_tokens(layer["moe"], base, t)
  ids = np.asarray(idx).reshape(-1)
  return t, jnp.asarray(np.bincount(ids[ids < local], minlength=local).astype(np.int32))


def aligned_layout(sizes):
  """An mlp_tune ':a8' case's rows as the aligned glue lays them out (`experts.aligned_rows` on
  rows sorted by expert): (the row of each sorted row [sum(sizes)], each expert's inclusive end
  there [E])."""
  sizes = jnp.asarray(sizes, jnp.int32)
  key = jnp.repeat(jnp.arange(sizes.shape[0], dtype=jnp.int32), sizes,
                   total_repeat_length=int(jnp.sum(sizes)))
  rows, ends = experts.aligned_rows(key, jnp.arange(key.shape[0], dtype=jnp.int32), sizes,
                                    jnp.cumsum(sizes, dtype=jnp.int32))
  return np.asarray(rows), ends


def _case_inputs(case, x, sizes):
  """(x rows as the case lays them out, the experts' ends or None, each sorted row's row):
  ':a8' scatters the sorted rows into `aligned_layout` over `experts.aligned_row_bound` rows
  (the aligned glue's x), zero rows in its gaps (rows the kernel computes and does not store);
  else x as it is."""
  if not case.endswith(":a8"):
    return x, None, np.arange(x.shape[0])
  at, ends = aligned_layout(sizes)
  m_pad = experts.aligned_row_bound(x.shape[0], sizes.shape[0])
  x_pad = jnp.zeros((m_pad, x.shape[1]), x.dtype).at[at].set(x[:at.shape[0]])
  return x_pad, ends, at


def _case_items(case, m, e_l):
  """(sizes, ends, R) -> the work list of an mlp_tune case's layout, or None (the API's own):
  ':a8' with `work.num_items_aligned`'s bound for its m pairs, as the aligned layer glue
  builds it."""
  if not case.endswith(":a8"):
    return None
  return lambda s, e, r: work.work_list(s, m, r, e, max_items=work.num_items_aligned(m, e_l, r))


def part_mlp_tune(ceil, sink, rows):
  """The INT4 expert FFN's gated and down calls per --mlp_cases x --mlp_variants vs XLA."""
  gate, up, down = [(w.packed, w.scale) for w in _weights("int4")]
  d, f = _D.value, _F.value
  for case in _MLP_CASES.value:
    t, sizes = case_sizes(case)
    touched = int(jnp.sum(sizes > 0))
    m = t * _K.value
    x = jax.random.normal(jax.random.key(9 + t), (m, d), jnp.bfloat16)
    ref = expert_mlp(x, gate, up, down, sizes, backend="xla")[0]
    x_in, ends, at = _case_inputs(case, x, sizes)
    need = touched * _expert_bytes("int4")
    backend = "pallas" if jax.default_backend() == "gpu" else "interpret"  # CPU: a smoke run
    interp = backend == "interpret"
    for name in _MLP_VARIANTS.value or case_rows(t):
      row = dict(part="mlp_tune", fmt="int4", tuning=name, T=t, experts_touched=touched,
                 case=case, local_pairs=int(jnp.sum(sizes)), bytes_needed=need)
      try:
        tg, td = mlp_tunings(name, m, _EL.value, d, f, interp)
        row.update(gate_tuning=str(tg), down_tuning=str(td))
        items = _case_items(case, m, _EL.value)
        n_items = (work.num_items(m, _EL.value, tg.rows) if items is None
                   else items(sizes, ends, tg.rows).shape[1])
        for call, tun, k_, n_ in (("gate", tg, d, f), ("down", td, f, d)):
          shape = kernel.launch_shape(k_, n_, n_items, True, call == "gate", tun)
          row.update({f"{call}_{key}": v for key, v in shape.items()})
        fn = jax.jit(lambda x, ws, s, e, tg=tg, td=td: expert_mlp(
            x, *ws, s, backend=backend, tunings=(tg, td), group_ends=e,
            items=None if items is None else lambda r: items(s, e, r)).sum(axis=0))
        args = (x_in, _packed_for(tg, td, gate, up, down), sizes, ends)
        print(f"first call (compile) of T={t} {name}", flush=True)  # ptxas logs follow it
        row["rel_err"] = _rel(fn(*args)[at[:t]], ref[:t])
        row["us"] = _time_us(fn, *args)
        kernels = timing.kernel_breakdown(fn, args)
        row.update({f"{n_.split('_mosaic')[0]}_us": round(us, 2) for n_, _, us in kernels
                    if n_.startswith("gmm_")})  # per call: gmm_int4_gated_us, gmm_int4_us
      except Exception as ex:  # one failing variant must not hide the rest
        row["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
      else:
        row["tbps"] = need / row["us"] / 1e6
        row["pct_copy"] = 100 * row["tbps"] / ceil["copy_tbps"]
        row["x_floor"] = row["us"] / (need / ceil["copy_tbps"] / 1e6)
        # issue 12's small-T bound: 1.3 x (bytes of the experts touched / copy + 10 us)
        row["bound_us"] = 1.3 * (need / ceil["copy_tbps"] / 1e6 + 10)
      _emit(rows, row, sink)


def _typical_tokens(p, cfg, t, tries=64):
  """Random x [T, D] whose routing touches the expected number of local experts (rounded; the
  first key that does, else the closest): at T=1 one expert of 48, not the 0 one draw gave."""
  held, e, k = cfg.num_local_experts, cfg.n_routed_experts, cfg.num_experts_per_tok
  want = round(held * (1 - (1 - k / e) ** t))
  best = None
  for i in range(tries):
    x = jax.random.normal(jax.random.key(1000 * i + t), (t, cfg.hidden_size), jnp.bfloat16)
    idx, _ = moe.route(p, cfg, x)
    gap = abs(_local_touched(idx, held) - want)
    if best is None or gap < best[0]:
      best = (gap, x, idx)
    if gap == 0:
      break
  return best[1], best[2]


# MoE layer variants: "glue[+field=value...]", glue a TargetConfig.moe_glue value, then any
# TargetConfig fields set on top (e.g. "sorted+router_impl=pallas"). The first is the baseline of
# rel_err.
LAYER_VARIANTS = ("sorted", "dense", "auto")
_LAYER_VARIANTS = flags.DEFINE_list(
    "layer_variants", ["sorted", "dense"],
    f"MoE layer variants of the `layer` part, the first the baseline: 'glue[+field=value...]', "
    f"glue one of {list(LAYER_VARIANTS)} (TargetConfig.moe_glue), each field=value a "
    f"TargetConfig field set on top (e.g. sorted+router_impl=pallas).")


LAYER_LAYOUTS = ("decode", "loaded")
_LAYER_LAYOUTS = flags.DEFINE_list(
    "layer_layouts", ["decode"],
    "Weight layouts of the `layer` part, each with every --layer_variants: 'decode' (what "
    "decode runs: target.pack.pack_layer's joint router | shared gate | up dot and the routed "
    "INT4 stacks K-packed in the config's expert_k_layout) or 'loaded' (as a checkpoint loads: "
    "router, shared and plain INT4 stacks apart; the rows of record before the twentieth "
    "session).")


def layer_params(base, layer, layout: str):
  """One MoE layer's params in a --layer_layouts layout (a ValueError names an unknown one)."""
  if layout not in LAYER_LAYOUTS:
    raise ValueError(f"--layer_layouts {layout!r} is not one of {LAYER_LAYOUTS}")
  return (pack.pack_layer(base, layer) if layout == "decode" else layer)["moe"]


def layer_config(base, spec: str):
  """The TargetConfig of one --layer_variants entry 'glue[+field=value...]': base with moe_glue
  = glue and each field set (`config_overrides.with_overrides`: parsed by the field's type; an
  unknown glue or field, a value that does not parse or one the config refuses is a ValueError
  naming the entry)."""
  glue, *sets = spec.split("+")
  if glue not in LAYER_VARIANTS:
    raise ValueError(f"--layer_variants {spec!r}: glue {glue!r} is not one of {LAYER_VARIANTS}")
  return with_overrides(dataclasses.replace(base, moe_glue=glue), sets,
                        f"--layer_variants {spec!r}")


def part_layer(ceil, sink, rows):
  """One MoE layer of bench_k26_full (`bench_models.k26_share`: 384 routed, 48 held as INT4,
  shared expert F/8) at each T vs its weight-streaming floor, with the per-kernel breakdown,
  for each --layer_variants (same params, tokens and routing; rel_err vs the first)."""
  base, loaded = _k26_layer()
  cfgs = {name: layer_config(base, name) for name in _LAYER_VARIANTS.value}  # all checked first
  ps = {lay: layer_params(base, loaded, lay) for lay in _LAYER_LAYOUTS.value}
  fns = {name: jax.jit(lambda p, x, cfg=cfg: moe.moe(p, cfg, x)) for name, cfg in cfgs.items()}
  p0 = loaded["moe"]
  for t in map(int, _T.value):
    x, idx = _typical_tokens(p0, base, t)
    touched = _local_touched(idx, base.num_local_experts)
    other = sum(v.nbytes for v in jax.tree.leaves([p0["router"], p0["bias"],
                                                   p0.get("shared", {})]))
    need = touched * _expert_bytes("int4") + other
    want = None
    for (lay, p), (name, fn) in itertools.product(ps.items(), fns.items()):
      label = name if lay == "decode" else f"{name} [{lay}]"
      row = dict(part="layer", fmt="int4", impl=f"moe {label}", T=t, experts_touched=touched,
                 bytes_needed=need, layout=lay)
      try:
        got = fn(p, x)
        want = got if want is None else want
        _write_hlo(fn, (p, x), f"layer_{_file_safe(name)}_{lay}_T{t}")
        row["rel_err"] = _rel(got, want)
        row["us"] = _time_us(fn, p, x)
        row["kernels"] = [dict(name=n[:90], calls=c, us=round(us, 2))
                          for n, c, us in timing.kernel_breakdown(fn, (p, x))]
        row.update(_launches(row["kernels"]))
      except Exception as ex:
        row["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
      else:
        row["floor_us"] = need / ceil["copy_tbps"] / 1e6
        row["x_floor"] = row["us"] / row["floor_us"]
      _emit(rows, row, sink)
      for k in row.get("kernels", [])[:40]:
        print(f"    {k['us']:8.2f} us  x{k['calls']:.0f}  {k['name']}", flush=True)


def _file_safe(name: str) -> str:
  """A variant name as plain file-name characters ('+' -> '__', '=' -> '-')."""
  return name.replace("+", "__").replace("=", "-")


def _write_hlo(fn, args, stem):
  """The compiled (optimized) HLO of fn(*args) into --hlo_dir, if set."""
  if not _HLO_DIR.value:
    return
  os.makedirs(_HLO_DIR.value, exist_ok=True)
  with open(os.path.join(_HLO_DIR.value, f"{stem}.hlo.txt"), "w") as f:
    f.write(fn.lower(*args).compile().as_text())


def _launches(kernels):
  """Kernel launches per layer call, and their us, split into our Mosaic kernels and the rest."""
  mosaic = [k for k in kernels if "mosaic" in k["name"]]
  other = [k for k in kernels if "mosaic" not in k["name"]]
  return dict(launches=round(sum(k["calls"] for k in kernels), 1),
              mosaic_launches=round(sum(k["calls"] for k in mosaic), 1),
              mosaic_us=round(sum(k["us"] for k in mosaic), 2),
              glue_us=round(sum(k["us"] for k in other), 2))


def failed(row) -> bool:
  """A row whose output is wrong (rel_err above REL_TOL, or not finite): never a candidate."""
  err = row.get("rel_err")
  return err is not None and not err <= REL_TOL


def _table(rows):
  print("\npart  fmt  impl/tuning        T  touched      us    TB/s  %copy  note")
  for r in rows:
    name = r.get("impl", r.get("tuning", "moe"))
    note = r.get("error", "") or _note(r)
    if failed(r):
      note = f"FAIL: WRONG OUTPUT rel_err {r['rel_err']:.1e} > {REL_TOL:g}  {note}"
    print(f"{r['part']:5} {r['fmt']:4} {name:18} {r['T']:3} {r.get('experts_touched', '-')!s:>7} "
          f"{r.get('us', float('nan')):8.1f} {r.get('tbps', float('nan')):6.2f} "
          f"{r.get('pct_copy', float('nan')):6.1f}  {note}")


def fastest(rows, key):
  """The correct row with the least `key`, or None (a FAIL row is never the fastest)."""
  have = [r for r in rows if key in r and not failed(r)]
  return min(have, key=lambda r: r[key]) if have else None


def _mlp_case(r) -> str:
  """An mlp_tune row's case ('T:E' or 'T:layer'; rows without one: 'T=<T>')."""
  return r.get("case", f"T={r['T']}")


def _mlp_summary(rows):
  """mlp_tune: per case, the fastest correct row (whole call and per launch) vs the baseline
  ('promoted', else 'default'); FAIL rows listed apart."""
  tune = [r for r in rows if r["part"] == "mlp_tune"]
  for case in sorted({_mlp_case(r) for r in tune}):
    ok = [r for r in tune if _mlp_case(r) == case and "us" in r]
    for r in filter(failed, ok):
      print(f"mlp_tune {case}: FAIL {r['tuning']} (rel_err {r['rel_err']:.1e}): not a candidate",
            flush=True)
    base = next((r for name in ("promoted", "default") for r in ok
                 if r["tuning"] == name and not failed(r)), None)
    if base is None:
      continue
    print(f"mlp_tune {case}: {base['tuning']} {base['us']:.1f} us", flush=True)
    for key in ("us", "gmm_int4_gated_us", "gmm_int4_us"):
      best = fastest(ok, key)
      if best is not None and key in base:
        print(f"  fastest by {key}: {best['tuning']} {best[key]:.1f} vs {base[key]:.1f} "
              f"({base[key] / best[key]:.2f}x)", flush=True)


def _note(r):
  """The layer rows' floor ratio, launches, glue and Mosaic us, and error vs the baseline."""
  if "gmm_int4_us" in r:  # mlp_tune: per-call Mosaic us, error vs XLA
    return (f"gated {r.get('gmm_int4_gated_us', float('nan')):.1f} us  down "
            f"{r['gmm_int4_us']:.1f} us  x floor {r['x_floor']:.2f}  bound {r['bound_us']:.1f} us"
            f"  rel_err {r['rel_err']:.1e}")
  if "launches" not in r:
    return ""
  return (f"x floor {r['x_floor']:.2f}  launches {r['launches']:g} glue {r['glue_us']:.1f} us "
          f"mosaic {r['mosaic_us']:.1f} us  rel_err {r['rel_err']:.1e}")


def main(_):
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  t0 = time.time()
  ceil = roofline.measure_ceilings(small=jax.default_backend() != "gpu")
  print(f"copy {ceil['copy_tbps']:.2f} TB/s, bf16 {ceil['mm_tflops']:.0f} TFLOP/s", flush=True)
  rows = []
  with open(_OUT.value, "w") as sink:
    sink.write(json.dumps(dict(part="ceilings", **ceil)) + "\n")
    for part in _PARTS.value:
      {"ffn": part_ffn, "tune": part_tune, "mlp_tune": part_mlp_tune,
       "layer": part_layer}[part](ceil, sink, rows)
      print(f"[{time.time() - t0:.0f} s] part {part} done", flush=True)
  _table(rows)
  _mlp_summary(rows)


if __name__ == "__main__":
  app.run(main)
