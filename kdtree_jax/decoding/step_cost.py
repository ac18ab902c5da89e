"""Modelled time of one decode step vs verify width N (root + tree nodes) and context length L.

Two sources, one interface (`ms(n, ctx)`, `mode_ms(mode, ctx)`):
- `AnalyticCost`: a roofline floor from bytes and FLOPs (`profiling.phase_costs` for attention,
  non-expert weights and the draft) plus what it does not count: the distinct routed experts a
  verify of N tokens touches, E * (1 - (1 - 1/E)^(K N)) (independent routing), at the expert
  bytes of the mesh share, and the collectives (2 per layer + 1, and the draft's) when the
  experts and heads are split over GPUs.
- `CalibratedCost`: a table of measured step times (`scripts/calibrate_step_cost.py`), read from
  a JSON beside the run config; linear in L between calibrated contexts (attention reads grow
  linearly with L) and in N between calibrated widths; no extrapolation in N.

Letters: N verify width, L context (committed rows), E routed experts, K experts per token.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from kdtree_jax import profiling


@dataclasses.dataclass(frozen=True)
class Hardware:
  """Ceilings of one GPU; defaults measured on the H200 here (WORKSPACE.md) + a 20 us all-reduce."""

  copy_tbps: float = 4.18
  mm_tflops: float = 693.0
  collective_us: float = 20.0
  fixed_us: float = 0.0  # per-step overhead outside the floor (launch gaps, host round trip)


@dataclasses.dataclass(frozen=True)
class MeshShare:
  """What one GPU holds: 1/gpus of heads, experts and weights; the latent cache whole.

  expert_bits: bits per routed-expert weight incl. scales (INT4 + bf16 group-32 scales = 4.5).
  collectives: charge 2 all-reduces per layer + 1 (and the draft's) at `collective_us` each.
  """

  gpus: int = 1
  expert_bits: float = 16.0
  weight_bits: float = 16.0
  cache_bits: float = 16.0
  collectives: bool = False


def experts_touched(n_experts: int, per_token: int, tokens) -> np.ndarray:
  """Expected distinct experts hit by `tokens` tokens routing to `per_token` of `n_experts`."""
  return n_experts * (1.0 - (1.0 - 1.0 / n_experts) ** (per_token * np.asarray(tokens, float)))


def _floor_ms(n_bytes, flops, hw: Hardware) -> float:
  return 1e3 * max(n_bytes / (hw.copy_tbps * 1e12), flops / (hw.mm_tflops * 1e12))


def _spec_for_width(mode: str, n: int, block_size: int):
  from kdtree_jax.decoding.spec_config import SpecConfig  # pylint: disable=import-outside-toplevel
  return SpecConfig(mode=mode, budget=max(n - 1, 1), block_size=block_size)


@dataclasses.dataclass(frozen=True)
class AnalyticCost:
  """Roofline floor of one step of `tcfg` (+ `dcfg` draft) on one GPU's share of a mesh."""

  tcfg: object
  dcfg: object
  share: MeshShare = MeshShare()
  hw: Hardware = Hardware()
  source: str = "analytic"

  def terms_ms(self, n: int, ctx: int, with_draft: bool = True) -> dict[str, float]:
    """Per-term floors (ms) of a step verifying n tokens at context ctx."""
    c, s, hw = self.tcfg, self.share, self.hw
    mode = "ddtree" if with_draft else "ar"
    spec = _spec_for_width(mode, n, self.dcfg.block_size if self.dcfg else 2)
    pc = profiling.phase_costs(c, self.dcfg, spec, 1, ctx, wbytes=1)  # bytes in elements
    wb, cb, eb = s.weight_bits / 8, s.cache_bits / 8, s.expert_bits / 8
    att_b, att_f = pc["attention"]
    f, fs = c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
    d, e = c.hidden_size, c.n_routed_experts
    touched = experts_touched(e, c.num_experts_per_tok, n)
    experts_b = c.num_moe_layers * touched * 3 * d * f * eb / s.gpus
    moe_dense_b = c.num_moe_layers * (3 * d * fs + d * e) * wb / s.gpus
    terms = {
        "attention": _floor_ms(att_b * cb, att_f / s.gpus, hw),
        "weights": _floor_ms(pc["rest"][0] * wb / s.gpus + moe_dense_b, 0, hw),
        "experts": _floor_ms(experts_b, 0, hw),
        "fixed": hw.fixed_us / 1e3,
    }
    layers = c.num_hidden_layers
    collectives = 2 * layers + 1
    if with_draft:
      for p in ("draft_ctx", "draft_block"):
        terms[p] = _floor_ms(pc[p][0] * wb / s.gpus, pc[p][1] / s.gpus, hw)
      collectives += 2 * self.dcfg.num_hidden_layers + 1
    terms["collectives"] = collectives * hw.collective_us / 1e3 if s.collectives else 0.0
    return terms

  def ms(self, n: int, ctx: int) -> float:
    """Step (draft + tree of n - 1 nodes + verify of n) floor in ms."""
    return float(sum(self.terms_ms(n, ctx).values()))

  def mode_ms(self, mode: str, ctx: int) -> float:
    """'ar' (one token, no draft) or 'chain' (block_size tokens)."""
    if mode == "ar":
      return float(sum(self.terms_ms(1, ctx, with_draft=False).values()))
    if mode == "chain":
      return self.ms(self.dcfg.block_size, ctx)
    raise ValueError(f"mode {mode!r} must be 'ar' or 'chain' (ddtree: use ms(width, ctx))")


def _interp_ctx(ctxs, values, ctx):
  """Linear in context; beyond the grid, the line through the two nearest points."""
  ctxs, values = np.asarray(ctxs, float), np.asarray(values, float)
  if len(ctxs) == 1:
    return float(values[0])
  i = int(np.clip(np.searchsorted(ctxs, ctx) - 1, 0, len(ctxs) - 2))
  t = (ctx - ctxs[i]) / (ctxs[i + 1] - ctxs[i])
  return float(values[i] + t * (values[i + 1] - values[i]))


@dataclasses.dataclass(frozen=True)
class CalibratedCost:
  """Measured step ms: step_ms[i][j] at contexts[i], widths[j]; mode_ms_table[mode][i]."""

  widths: tuple[int, ...]
  contexts: tuple[int, ...]
  step_ms: tuple[tuple[float, ...], ...]
  mode_ms_table: tuple[tuple[str, tuple[float, ...]], ...] = ()
  source: str = "calibrated"

  def __post_init__(self):
    if list(self.widths) != sorted(set(self.widths)) or list(self.contexts) != sorted(
        set(self.contexts)):
      raise ValueError(f"widths {self.widths} and contexts {self.contexts} must be increasing")
    if np.shape(self.step_ms) != (len(self.contexts), len(self.widths)):
      raise ValueError(f"step_ms shape {np.shape(self.step_ms)} != (contexts, widths) "
                       f"{(len(self.contexts), len(self.widths))}")

  def ms(self, n: int, ctx: int) -> float:
    if not self.widths[0] <= n <= self.widths[-1]:
      raise ValueError(f"width {n} is outside the calibrated widths {self.widths}; "
                       "re-run scripts/calibrate_step_cost.py with --widths covering it")
    per_ctx = [_interp_ctx(self.contexts, col, ctx) for col in np.asarray(self.step_ms).T]
    return float(np.interp(n, self.widths, per_ctx))

  def mode_ms(self, mode: str, ctx: int) -> float:
    table = dict(self.mode_ms_table)
    if mode not in table:
      raise ValueError(f"mode {mode!r} was not calibrated (have {sorted(table)})")
    return _interp_ctx(self.contexts, table[mode], ctx)


def load_calibration(path: str, key: str = "loop_ms") -> CalibratedCost:
  """A CalibratedCost from the JSON scripts/calibrate_step_cost.py writes.

  key: 'loop_ms' (per step inside the device loop: what tokens/s sees) or 'kernel_ms' (CUPTI sum
  of the step's kernels; GPU only).
  """
  with open(path) as f:
    raw = json.load(f)
  rows = raw["rows"]
  widths = sorted({r["width"] for r in rows if r["mode"] == "ddtree"})
  ctxs = sorted({r["ctx"] for r in rows})
  val = {(r["mode"], r["width"], r["ctx"]): r[key] for r in rows}
  missing = [k for k in val if val[k] is None]
  if missing:
    raise ValueError(f"{path}: no {key!r} for {missing[:3]} (kernel_ms exists only on GPU runs)")
  table = tuple(tuple(val[("ddtree", w, c)] for w in widths) for c in ctxs)
  modes = tuple((m, tuple(val[(m, w, c)] for c in ctxs))
                for m, w in sorted({(r["mode"], r["width"]) for r in rows if r["mode"] != "ddtree"}))
  return CalibratedCost(tuple(widths), tuple(ctxs), table, modes, source=f"calibrated:{path}")


def calibration_path(config_path: str) -> str:
  """Where a run config's calibration lives: configs/x.py -> configs/x.step_cost.json."""
  return os.path.splitext(config_path)[0] + ".step_cost.json"
