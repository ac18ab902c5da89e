"""Tuning knobs of the grouped expert matmul and the shape heuristic that picks them."""

import contextlib
import contextvars
import dataclasses
import re

NUM_SMS = 132  # H200 SXM

# The `apply_variant` name default_tuning applies to INT4 calls, by M (rows = T tokens x top-8
# pairs): the first entry whose bound M <= max_rows holds, with the measurement it comes from
# (H200, `bash scripts/gpu_measure.sh $OUT moe_tune:170`: `bench.py --parts mlp_tune`, both
# calls of the INT4 expert FFN on one GPU's share of K2.6, 48 local experts, D 7168, F 2048;
# whole-call CUPTI us; s5 = results/h200/2026-12-01/s5_moe_tune.log, s6 = s6_moe_tune.log).
# bf16 calls take none (measured on INT4 only). A new row of the mlp_tune bench is promoted by
# naming it here; 'GATED|PLAIN' names the gated (gate|up) call's and the plain (down) call's
# variants apart (the bench times each call: both must keep one R, the work list is shared).
# `kp` (int4_k_packed) is not named here: it follows the weights (api.py's k_packed, from
# Int4Weight.k_packed: target.pack.pack_for_decode packs the routed stacks); s6 measured each
# row + cat + kp 1.02-1.08x faster than the row (cat alone: noise), so every row has + cat.
# R 8 (`r8`) wins only while each expert has <= 8 local rows (H100 s19: 9 rows on one expert
# cost +17% at T=9, 16-17 rows +23% at T=65): notes/int4_small_t.md "R against the routing".
# `+nr8` on the R 16 form keeps R 16's speed there but is 3% slower than R 8 on the cases below
# (H100 s20; at T=65 the CTA's SMEM stays R 16's): promote it where routing is measured to
# concentrate.
DEFAULT_VARIANTS = (
    # max_rows, variant, measured
    (8, "once+ismem+cat+il+a2+k128+p8|once+ismem+cat+a2+p4", "s8 T=1 (1 expert): + kp 22.8 us "
     "vs 24.4 once+ismem+cat+kp (gated 9.3 vs 10.8, down 6.1 vs 6.6; down a2 without p4 6.4; "
     "s6: 24.3 vs 26.2, s5: once+ismem 26.6 vs 27.3 base)"),
    (33 * 8 - 1, "once+ismem+s2+cat+il+a2+r8+w2|once+ismem+cat+n128+s2+r8+w4+a2", "T=2..32 "
     "(T=9: 8 experts; a DDTree 15 verify: 16 local pairs on ~14): gate|up unsplit (SiLU in the "
     "kernel, no K-split partials) with il+a2 at R 8 in 8 slot columns (w2), down at block_n "
     "128, measured on H100s only. s28 (H100, every row + kpi, the decode pack's stacks; "
     "results/h100/2026-12-07/s28_*): whole FFN us, unsplit vs the 2-K-split p2c4 form it "
     "replaced: 4:4 56.3 / 56.0 vs 55.3 / 56.0, 9:8 92.3 vs 96.9, 12:11 129.0 vs 127.8, 16:14 "
     "154.5 vs 161.5 (w4 152.7 = 76.9% of copy, but 137.4 vs 129.0 at 12:11), the layer's 16 "
     "tokens 156.8 vs 162.2, 20:16 170.4 vs 175.6, 24:18 200.0 vs 198.3, 32:24 245.6 vs 254.0. "
     "Before s28 (the p2c4 form): T=9 (s18: + kp 98.8 us vs 102.5 "
     "with x4c4+s2+r8, gated 58.1 vs 60.5; s14: 99.2 vs 103.6; down at 128 31.2 / 30.9 vs 32.1 / "
     "31.8 at 64; the H200 number of record is still x4c4's, s8: + kp 88.3 us vs 98.2). T=13..32 "
     "took R 16 until s27 (s8 H200 T=16 on 4 experts: + kp 53.7 us vs 58.0 x4c4, 72.8 unsplit; "
     "s19 H100 16:4 R 8 61.0 = R 16 61.2); s27 on the routing a K2.6-like verify has (1-2 rows an "
     "expert; the zero-mean bench model's DDTree 15 touches 13.7 local experts): 16:14 + kp "
     "162.9 / 163.2 us vs 166.5 / 165.2 at R 16 (71.8% of copy), the layer's routing of 16 "
     "tokens (18 pairs on 14) 165.0 / 165.2 vs 165.8 / 165.9, 32:24 254.0 vs 258.9 / 258.7 (the "
     "T=65 class's form 250.2, one run; at 16:14 it is 181: not taken). R 16 stays faster only "
     "where an expert gets more than 8 of the rows (s19 16:1: 37.8 vs 46.2)"),
    (65 * 8, "once+ismem+r8+s3+w16+cat|once+ismem+r8+s2+w16+cat+a2", "s8 T=65 (36 experts): + kp "
     "299.4 us (72.0% of copy) vs 315.0 (gate|up 3 stages 192.4 vs 204.5; w8 / w24 / k128 no "
     "gain); down a2 94.7 vs 99.4 (s8 run 2: 303.2 vs 308.3); s6: 318.5 vs 324.9; s5 run 2: "
     "325.2 vs 336.5 r8+s2 vs 555.9 base; R = 8 fits ~2 local rows per expert, not prefill's "
     "hundreds; w16: a persistent grid over the live items"),
    (None, "default", "unmeasured (prefill chunks): the base tuning, R from the rows per expert"),
)


# The innermost `variant_overrides` scope's {class bound: variant} (TargetConfig.expert_variants).
_OVERRIDES = contextvars.ContextVar("grouped_matmul_variant_overrides", default=None)


def promoted_variant(m: int, gated: bool = False) -> str:
  """DEFAULT_VARIANTS' variant for an INT4 call of M rows (gated: the gate|up call), or the
  innermost `variant_overrides` scope's for that class."""
  overrides = _OVERRIDES.get() or {}
  for max_rows, name, _ in DEFAULT_VARIANTS:
    if max_rows is None or m <= max_rows:
      return call_variant(overrides.get(max_rows, name), gated)
  raise ValueError(f"DEFAULT_VARIANTS has no entry for M={m}: its last bound must be None")


def parse_overrides(spec: str) -> dict:
  """'BOUND=VARIANT;...' -> {bound: variant}: BOUND one of DEFAULT_VARIANTS' max_rows (8, 263,
  520, or 'none' for the last class), VARIANT a 'GATED|DOWN' or one `apply_variant` name.
  Each name is applied to a K2.6-share call of its class here, so a typo fails now."""
  bounds = {str(b).lower(): b for b, _, _ in DEFAULT_VARIANTS}
  out = {}
  for entry in (e.strip() for e in spec.split(";") if e.strip()):
    bound, eq, name = (part.strip() for part in entry.partition("="))
    if not eq or bound.lower() not in bounds or not name:
      raise ValueError(f"expert variant override {entry!r}: want BOUND=VARIANT with BOUND one "
                       f"of {sorted(bounds)}")
    rows = bounds[bound.lower()] or 4096
    default_tuning(rows, 48, 7168, 2048, True, gated=True, variant=name)
    default_tuning(rows, 48, 2048, 7168, True, variant=name)
    out[bounds[bound.lower()]] = name
  return out


@contextlib.contextmanager
def variant_overrides(spec: str):
  """Within: INT4 calls with an API-picked tuning take `parse_overrides(spec)`'s variant for
  their class instead of DEFAULT_VARIANTS' ('': none). Read at trace time, as pdl.model_default:
  the chosen Tuning is a static argument of the kernel's jit."""
  token = _OVERRIDES.set(parse_overrides(spec))
  try:
    yield
  finally:
    _OVERRIDES.reset(token)


def call_variant(name: str, gated: bool) -> str:
  """'GATED|PLAIN' -> the gated or the plain call's variant name; a name without '|': both."""
  parts = name.split("|")
  if len(parts) > 2:
    raise ValueError(f"{name!r}: at most one '|' (gated call's variant | plain call's)")
  return parts[0] if gated or len(parts) == 1 else parts[1]


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Static kernel configuration (one compiled kernel per value).

  rows: R, token rows per work item = the wgmma N dimension (multiple of 8, <= 256).
  block_n: output columns per CTA = wgmma M (64 or 128: one or two 64-row wgmma groups).
  block_k: K per pipeline step (multiple of 64; the INT4 path dequantises it 64 columns at a time).
  stages: pipeline steps in flight (SMEM ring depth).
  a_operand: INT4 only: the dequantised W^T goes to wgmma from "registers" or through "smem".
  splits: K split over this many CTAs (f32 partials summed after): for few live items.
  slots: 0 = one CTA column per work item; else this many columns, each looping over items
    slot, slot + slots, ... (live items come first): with split-K at small T, where the static
    item bound (8 at T=1) far exceeds the live items (~1), most CTAs would launch only to exit.
  store_once: the epilogue stores every value part (gate / up, hi / lo: up to 4) to SMEM, fences
    once, issues every TMA store and waits once, instead of a store-fence-TMA-wait round per part.
  dequant_batch: INT4 only: 64-column chunks dequantised before their wgmmas are issued (1:
    chunk j+1's dequantise overlaps chunk j's MMA; 2 or 4: more loads and conversions in flight
    between waits, 16 more registers per chunk per thread).
  int4_scale_concat: INT4 with group 32 only: a chunk's [BN, 64] scales as two [BN, 32] row
    broadcasts joined along K instead of a select per register pair on a column iota (the
    selects are 16 of the ~125 instructions per thread and chunk); same values.
  int4_k_packed: INT4 only: the weight stacks are stored K-packed (`kpack.pack_int4_k`, a
    permutation inside each 32-column scale group, done once where weights are loaded): a
    thread's 8 values of a row and group are one 32-bit word, loaded and used as wgmma A
    registers without shuffles (4 loads per thread and chunk instead of 16 byte loads). The
    CALLER must pass packed stacks: the values are wrong on unpacked ones.
  int4_interleave_stacks: INT4 gated calls only: each 64-column chunk of the gate and the up
    stack dequantised together before one wgmma wait (two independent accumulator chains per
    wait, and one drain per K step instead of one per stack); plain calls: no change.
  int4_acc_chains: INT4 only: 1 or 2 accumulators per stack, chunk j into accumulator j % 2,
    summed in the epilogue: independent wgmma chains (a one-warpgroup CTA's m64n8k16s on one
    accumulator run one after another) at the cost of f32 adds in the epilogue.
  items_smem: each CTA copies the work list to SMEM with one TMA before its first item, so the
    slots loop reads each item's 4 fields from SMEM instead of a dependent GMEM round trip per
    item (T=1: 8 items per CTA, 1 live).
  int4_k_interleaved: INT4 with int4_k_packed and bf16 x only: the stacks are stored by
    `kpairs.pack_int4_k_pairs` instead (each 32-bit word's nibble slots j and j + 4 are one
    bf16 pair's two values, 16 bits apart), so the i4 -> bf16 conversion is one LOP3 per pair
    and 3 shifts per word, no PRMT (16 LOP3 + 12 SHF per chunk and thread vs 16 PRMT + 16 LOP3
    + 4 SHF); exactly the same values. The CALLER must pass pair-packed stacks (the bench
    does; the model's decode pack does with TargetConfig.int4_k_interleaved, and its calls
    set this from the weights' layout: api.py's k_interleaved).
  narrow_rows: 0, or a multiple of 8 below rows: items whose stored rows lie in their window's
    first narrow_rows rows (lo + size <= narrow_rows) run a second compiled path whose x tile
    and wgmma N are narrow_rows, the rest the R-row path. The work list stays R's, so an expert
    of up to R rows is one item (its weights dequantised once) while one of a few rows costs
    the MMA work of narrow_rows: R 16 + narrow 8 aims at R 8's speed where experts get 1-2
    rows and R 16's where one gets 9-16 (notes/int4_small_t.md "R against the routing").
  pdl: programmatic dependent launch (`pallas_kernels.pdl`): the body waits (griddepcontrol.wait)
    before its first read of anything (the work list decides which weights to load, so every
    input: work list, x, weights), so the CTAs can start during the previous kernel's tail, and
    lets the next kernel launch once its K pipeline is done (before the epilogue). No-op in
    interpret mode. Same values.
  """
  rows: int = 32
  block_n: int = 128
  block_k: int = 256
  stages: int = 4
  a_operand: str = "registers"
  splits: int = 1
  slots: int = 0
  store_once: bool = False
  dequant_batch: int = 1
  items_smem: bool = False
  pdl: bool = False
  int4_scale_concat: bool = False
  int4_k_packed: bool = False
  int4_interleave_stacks: bool = False
  int4_acc_chains: int = 1
  int4_k_interleaved: bool = False
  narrow_rows: int = 0

  def __post_init__(self):
    if self.rows % 8 or not 8 <= self.rows <= 256:
      raise ValueError(f"{self.rows=} must be a multiple of 8 in [8, 256]")
    if self.block_n not in (64, 128):
      raise ValueError(f"{self.block_n=} must be 64 or 128")
    if self.block_k % 64 or self.block_k <= 0:
      raise ValueError(f"{self.block_k=} must be a positive multiple of 64")
    if self.stages < 2:
      raise ValueError(f"{self.stages=} must be >= 2")
    if self.splits < 1:
      raise ValueError(f"{self.splits=} must be >= 1")
    if self.slots < 0:
      raise ValueError(f"{self.slots=} must be >= 0")
    if self.dequant_batch not in (1, 2, 4) or self.block_k % (64 * self.dequant_batch):
      raise ValueError(f"{self.dequant_batch=} must be 1, 2 or 4 and divide block_k / 64")
    if self.int4_acc_chains not in (1, 2) or self.block_k < 64 * self.int4_acc_chains:
      raise ValueError(f"{self.int4_acc_chains=} must be 1 or 2 (2: block_k >= 128)")
    if self.a_operand not in ("registers", "smem"):
      raise ValueError(f"{self.a_operand=} must be 'registers' or 'smem'")
    if self.narrow_rows and (self.narrow_rows % 8 or not 8 <= self.narrow_rows < self.rows):
      raise ValueError(f"{self.narrow_rows=} must be 0 or a multiple of 8 below {self.rows=}")
    if self.int4_k_interleaved and not self.int4_k_packed:
      raise ValueError("int4_k_interleaved is a layout of K-packed stacks: set int4_k_packed")


def _splits(m: int, g: int, k: int, n_tiles: int, block_k: int) -> int:
  """K splits so that ~2 CTAs per SM run when few experts are live.

  Live items are estimated as min(G, max(1, M // 8)): a top-8 token touches ~1 of a 48-expert
  share of 384 experts (K2.6 under expert=8), and at most G experts are live.
  """
  items = min(g, max(1, m // 8))
  want = max(1, (2 * NUM_SMS) // max(items * n_tiles, 1))
  steps = k // block_k
  if steps < 1 or k % block_k:
    return 1  # shapes the kernel does not take (the XLA path runs)
  return max(d for d in range(1, min(want, 16) + 1) if steps % d == 0)


def default_tuning(m: int, g: int, k: int, n: int, int4: bool, interpret: bool = False,
                   gated: bool = False, variant: str | None = None) -> Tuning:
  """R from the expected rows per touched expert (+7 for the 8-aligned window), capped at 64.

  INT4 weight tiles are 4x smaller than bf16 ones, so INT4 takes 4x longer K steps for the same
  bytes per step (bf16 [128, 128] = INT4 [128, 256] x 2 in SMEM terms; both fit 4 stages).
  block_n 64 measured faster than 128 for INT4 (H200, T=65: 144 vs 153 us; WORKSPACE.md).
  variant: an `apply_variant` name on top, or 'GATED|PLAIN' (None: `promoted_variant(M)` for
  INT4, none for bf16; "default": none, the base tuning).
  """
  per_expert = -(-m // max(min(g, m), 1)) + 7
  rows = 8
  while rows < min(per_expert, 64):
    rows *= 2
  block_k = 256 if int4 else 64 if gated else 128  # gated bf16: two [BK, BN] tiles per stage
  while k % block_k:
    block_k //= 2
  block_k = max(block_k, 64)
  block_n = 64 if (int4 or n % 128) else 128
  splits = _splits(m, g, k, n // block_n, block_k)  # gated: gate and up partials apart
  # Split-K means few live items: ~2 CTAs per SM that loop over the items, not one per bound.
  slots = max(1, (2 * NUM_SMS) // ((n // block_n) * splits)) if splits > 1 else 0
  t = Tuning(rows=rows, block_k=block_k, block_n=block_n, splits=splits, slots=slots,
             a_operand="smem" if interpret else "registers")
  if variant is None:  # the promoted variants were measured on INT4 calls only
    variant = promoted_variant(m, gated) if int4 else "default"
  return apply_variant(call_variant(variant, gated), t, k, n)


def scale_splits(t: Tuning, k: int, n: int, factor: int, ctas_per_sm: int = 2) -> Tuning:
  """t with about `factor` x its K splits (the smallest divisor of the K steps >= splits x
  factor, at most 32) and the slots loop sized so ~ctas_per_sm CTAs per SM run (all when few
  items are live): more CTAs, each with fewer K steps, for calls whose live items cannot fill
  the SMs (T=1: one expert; a ddtree verify: ~4 experts, no split by default)."""
  steps = k // t.block_k
  if steps < 1 or k % t.block_k:
    return t  # shapes the kernel does not take (the XLA path runs), as _splits
  want = min(t.splits * factor, steps, 32)
  splits = min(d for d in range(want, steps + 1) if steps % d == 0)
  slots = max(1, (ctas_per_sm * NUM_SMS) // ((n // t.block_n) * splits)) if splits > 1 else 0
  return dataclasses.replace(t, splits=splits, slots=slots if splits > 1 else t.slots)


def set_splits(t: Tuning, k: int, n: int, splits: int, ctas_per_sm: int = 2) -> Tuning:
  """t with `splits` K splits and the slots loop sized so ~ctas_per_sm CTAs per SM run, as
  scale_splits: for a CTA count that fills the SMs evenly (T=1 gated, 32 N tiles: 8 splits at
  block_k 128 = 256 CTAs, <= 2 per SM on every SM, where 7 splits at 256 give 224 CTAs: 92 SMs
  run 2, 40 run 1). Where `splits` does not divide the K steps (a promoted variant on a small
  model's K: 128 at block_k 128 is one step), the largest divisor of the steps below it."""
  steps = k // t.block_k
  if steps < 1 or k % t.block_k:
    return t  # shapes the kernel does not take (the XLA path runs), as _splits
  if splits < 1:
    raise ValueError(f"{splits=} must be >= 1")
  splits = max(d for d in range(1, min(splits, steps) + 1) if steps % d == 0)
  slots = max(1, (ctas_per_sm * NUM_SMS) // ((n // t.block_n) * splits)) if splits > 1 else 0
  return dataclasses.replace(t, splits=splits, slots=slots if splits > 1 else t.slots)


def apply_variant(name: str, t: Tuning, k: int, n: int) -> Tuning:
  """A named change of a [K -> N] call's tuning t (the bench's --mlp_variants; promote one by
  naming it in DEFAULT_VARIANTS): '+'-joined parts, applied in order:
  once: store_once; ismem: items_smem; cat: int4_scale_concat; kp: int4_k_packed (the
  caller packs the weights: bench.mlp_tune does; the model's calls take it from the weights,
  api.py's k_packed); il: int4_interleave_stacks; kpi: int4_k_packed and int4_k_interleaved
  (the caller packs by kpairs.pack_int4_k_pairs);
  dqN: dequant_batch N; aN: int4_acc_chains N (applied after every other part, at most
  block_k / 64: a one-chunk K step, e.g. the small models' K < 128, keeps one chain);
  rN: rows N (both calls of one work list must share it); nrN: narrow_rows N (after rN; each
  call its own); kBK: block_k BK; sN: stages N;
  nBN: block_n BN (before any x / p / w part: their slots count the N tiles);
  xN[cC]: scale_splits by N for ~C CTAs per SM (2); pN[cC]: exactly N splits (set_splits;
  after kBK: N must divide the K steps); wN: slots for ~N CTAs per SM (a
  persistent grid: no launched-and-exiting CTAs for dead items ahead of live ones);
  pdl: pdl (programmatic dependent launch); default: no change. (Tried and removed, measured
  no gain or slower on the H200: wide, ov, wo; notes/int4_small_t.md "Tried and removed".)"""
  flags = {"once": "store_once", "ismem": "items_smem", "cat": "int4_scale_concat",
           "kp": "int4_k_packed", "il": "int4_interleave_stacks", "pdl": "pdl"}
  chains = None
  for part in name.split("+"):
    if part == "default":
      continue
    if part in flags:
      t = dataclasses.replace(t, **{flags[part]: True})
    elif part == "kpi":
      t = dataclasses.replace(t, int4_k_packed=True, int4_k_interleaved=True)
    elif m := re.fullmatch(r"x(\d+)(?:c(\d+))?", part):
      t = scale_splits(t, k, n, int(m[1]), int(m[2] or 2))
    elif m := re.fullmatch(r"p(\d+)(?:c(\d+))?", part):
      t = set_splits(t, k, n, int(m[1]), int(m[2] or 2))
    elif m := re.fullmatch(r"w(\d+)", part):  # the slots loop for ~N CTAs per SM, same splits
      n_tiles = max(1, n // t.block_n)  # a small model's N below one tile: the XLA path runs
      t = dataclasses.replace(t, slots=max(1, int(m[1]) * NUM_SMS // (n_tiles * t.splits)))
    elif m := re.fullmatch(r"nr(\d+)", part):
      t = dataclasses.replace(t, narrow_rows=int(m[1]))
    elif m := re.fullmatch(r"a(\d+)", part):
      chains = int(m[1])
    elif m := re.fullmatch(r"(dq|k|s|r|n)(\d+)", part):
      field = {"dq": "dequant_batch", "k": "block_k", "s": "stages", "r": "rows",
               "n": "block_n"}[m[1]]
      t = dataclasses.replace(t, **{field: int(m[2])})
    else:
      raise ValueError(f"unknown tuning change {part!r} in {name!r}")
  if chains is not None:
    t = dataclasses.replace(t, int4_acc_chains=max(1, min(chains, t.block_k // 64)))
  return t
