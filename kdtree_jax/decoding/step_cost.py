"""Modelled time of one decode step vs verify width N (root + tree nodes) and context length L.

Two sources, one interface (`ms(n, ctx)`, `mode_ms(mode, ctx)`):
- `AnalyticCost`: a roofline floor from the bytes and FLOPs of `phase_costs.phase_costs` (its MoE
  bytes count the distinct routed experts a verify of N tokens touches,
  E * (1 - (1 - 1/E)^(K N)) under independent routing), split over the GPUs of a mesh share,
  plus the collectives (2 per layer + 1, and the draft's) when experts and heads are split.
- `CalibratedCost`: a table of measured step times (`scripts/calibrate_step_cost.py`), read from
  a JSON beside the run config; linear in L between calibrated contexts (attention reads grow
  linearly with L) and in N between calibrated widths; no extrapolation in N.

Letters: N verify width, L context (committed rows), E routed experts, K experts per token.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from kdtree_jax import phase_costs
from kdtree_jax.decoding import budget


@dataclasses.dataclass(frozen=True)
class Hardware:
  """Ceilings of one GPU; defaults measured on the H200 here (WORKSPACE.md) + a 20 us all-reduce."""

  copy_tbps: float = 4.18
  mm_tflops: float = 693.0
  collective_us: float = 20.0
  fixed_us: float = 0.0  # per-step overhead outside the floor (launch gaps, host round trip)


@dataclasses.dataclass(frozen=True)
class MeshShare:
  """What one GPU of `gpus` reads: 1/gpus of the weights, heads and (touched) experts; the
  latent cache whole (every head reads every row).

  expert_bits: bits per routed-expert weight incl. scales (INT4 + bf16 group-32 scales = 4.5).
  collectives: charge 2 all-reduces per layer + 1 (and the draft's) at `collective_us` each.
  A config that already is one GPU's share (bench_k26_full: heads, local experts, vocab sliced)
  takes gpus=1.
  """

  gpus: int = 1
  expert_bits: float = 16.0
  weight_bits: float = 16.0
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
  """Roofline floor of one step of `tcfg` (+ `dcfg` draft) on one GPU's share of a mesh: per
  phase of `phase_costs.phase_costs` (bytes incl. the routed experts a verify of N tokens touches,
  FLOPs) max(bytes / bandwidth, FLOPs / matmul rate) / gpus (the cache read stays whole), plus
  collectives and a fixed per-step overhead."""

  tcfg: object
  dcfg: object
  share: MeshShare = MeshShare()
  hw: Hardware = Hardware()
  source: str = "analytic"

  def terms_ms(self, n: int, ctx: int, with_draft: bool = True) -> dict[str, float]:
    """Per-term floors (ms) of a step verifying n tokens at context ctx."""
    c, s, hw = self.tcfg, self.share, self.hw
    spec = _spec_for_width("ddtree" if with_draft else "ar", n,
                           self.dcfg.block_size if self.dcfg else 2)
    pc = phase_costs.phase_costs(c, self.dcfg, spec, 1, ctx, wbytes=s.weight_bits / 8,
                               expert_bytes=s.expert_bits / 8)
    att_b, att_f = pc["attention"]
    terms = {"attention": _floor_ms(att_b, att_f / s.gpus, hw), "fixed": hw.fixed_us / 1e3}
    phases = ("moe", "rest", "accept", "commit") + (
        ("draft_ctx", "draft_block", "tree") if with_draft else ())
    for p in phases:
      terms[p] = _floor_ms(pc[p][0] / s.gpus, pc[p][1] / s.gpus, hw)
    collectives = 2 * c.num_hidden_layers + 1
    if with_draft:
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


def interp_ctx(ctxs, values, ctx):
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
  device: str = ""

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
    per_ctx = [interp_ctx(self.contexts, col, ctx) for col in np.asarray(self.step_ms).T]
    return float(np.interp(n, self.widths, per_ctx))

  def mode_ms(self, mode: str, ctx: int) -> float:
    table = dict(self.mode_ms_table)
    if mode not in table:
      raise ValueError(f"mode {mode!r} was not calibrated (have {sorted(table)})")
    return interp_ctx(self.contexts, table[mode], ctx)


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
  fixed = sorted({(r["mode"], r["width"]) for r in rows
                  if r["mode"] not in ("ddtree", "ddtree_fixed")})  # fixed: auto_program.py
  modes = tuple((m, tuple(val[(m, w, c)] for c in ctxs)) for m, w in fixed)
  return CalibratedCost(tuple(widths), tuple(ctxs), table, modes, source=f"calibrated:{path}",
                        device=raw.get("device", ""))


def cost_features(widths, ctxs, n_experts: int, per_token: int) -> np.ndarray:
  """[P, 5] regressors of a step's time: 1, routed experts touched (independent routing), N,
  L / 1e4, N L / 1e6 (attention reads grow with L, its math with N L)."""
  n, ctx = np.asarray(widths, float), np.asarray(ctxs, float)
  return np.stack([np.ones_like(n), experts_touched(n_experts, per_token, n), n, ctx / 1e4,
                   n * ctx / 1e6], axis=-1)


@dataclasses.dataclass(frozen=True)
class FittedCost:
  """ms(N, L) = cost_features(N, L) . coef: a smooth model of a measured table, fitted by
  `fit_cost`; used to check the table predicts widths and contexts it was not measured at."""

  coef: tuple[float, ...]
  n_experts: int
  per_token: int
  source: str = "fitted"

  def ms(self, n: int, ctx: int) -> float:
    return float(cost_features([n], [ctx], self.n_experts, self.per_token)[0] @
                 np.asarray(self.coef))


def fit_cost(widths, ctxs, ms, n_experts: int, per_token: int) -> FittedCost:
  """Least squares in relative error (each row divided by its measured ms) over the points."""
  x = cost_features(widths, ctxs, n_experts, per_token)
  y = np.asarray(ms, float)
  coef = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)[0]
  return FittedCost(tuple(float(c) for c in coef), n_experts, per_token)


def prediction_errors(points, n_experts: int, per_token: int) -> list[dict]:
  """Per measured point (width, ctx, ms): the fitted model's in-sample prediction, and held-out
  ones from a fit without that width (all contexts) and without that context (all widths);
  relative errors (predicted / measured - 1); None where too few points remain to fit."""
  w, c, m = (np.asarray(v, float) for v in zip(*points))
  fit = lambda keep: fit_cost(w[keep], c[keep], m[keep], n_experts, per_token) \
      if keep.sum() >= 5 and len(set(c[keep])) >= 2 else None
  full = fit(np.ones_like(w, bool))
  out = []
  for i in range(len(m)):
    models = dict(in_sample=full, without_width=fit(w != w[i]), without_ctx=fit(c != c[i]))
    r = dict(width=int(w[i]), ctx=int(c[i]), measured_ms=float(m[i]))
    for name, f in models.items():
      pred = None if f is None else f.ms(w[i], c[i])
      r[f"{name}_ms"] = pred
      r[f"{name}_error"] = None if pred is None else pred / m[i] - 1
    out.append(r)
  return out


def calibration_path(config_path: str) -> str:
  """Where a run config's calibration lives: configs/x.py -> configs/x.step_cost.json."""
  return os.path.splitext(config_path)[0] + ".step_cost.json"


def table_paths(config_path: str, config=None) -> tuple[str, str]:
  """(step cost JSON, acceptance JSON) of budget='auto' for a run config: the stem the config's
  `auto_tables` field names (e.g. 'configs/k2tiny'), else the config file's own path without
  '.py', + '.step_cost.json' / '.accept.json'."""
  stem = (config.get("auto_tables", "") if config is not None else "") or \
      os.path.splitext(config_path)[0]
  return stem + ".step_cost.json", stem + ".accept.json"


def load_accept_calibration(path: str) -> budget.AcceptCalibration:
  """The acceptance calibration eval_budget.py writes ({'calibration': {...}, ...})."""
  with open(path) as f:
    return budget.AcceptCalibration.from_dict(json.load(f)["calibration"])


def auto_budget(cost_json: str | None, accept_json: str | None, tcfg, dcfg):
  """(AutoBudget, one line saying what it uses): the measured table of `cost_json` (node counts
  = its ddtree widths - 1, its contexts) if the file exists, else the analytic floor of the
  run's own target; acceptance calibrated by `accept_json` if it exists, else the draft's raw
  marginals (DDTree's surrogate)."""
  has = lambda p: bool(p) and os.path.exists(p)
  cal = load_accept_calibration(accept_json) if has(accept_json) else budget.AcceptCalibration()
  accept = f"acceptance {accept_json}" if has(accept_json) else \
      f"acceptance = raw draft marginals (no {accept_json or 'acceptance JSON'})"
  if not has(cost_json):
    auto = budget.resolve(budget.AutoBudget(calibration=cal), tcfg, dcfg)
    return auto, (f"budget auto: step cost = analytic floor of this target (no "
                  f"{cost_json or 'calibration JSON'}); {accept}")
  cost = load_calibration(cost_json)
  nodes = tuple(w - 1 for w in cost.widths if w >= 2)
  auto = budget.from_cost_model(cost, nodes, cost.contexts, cal)
  return auto, (f"budget auto: step cost calibrated {cost_json} (nodes {list(nodes)}, contexts "
                f"{list(cost.contexts)}, measured on {cost.device or '?'}{_other_device(cost)}); "
                f"{accept}")


def _other_device(cost) -> str:
  """A warning when the table was measured on another kind of device than this run's."""
  here = jax.devices()[0].device_kind
  if not cost.device or cost.device == here:
    return ""
  return f"; this run is on {here}: the choice is the one that is best on {cost.device}"


def auto_for_run(config, config_path, tcfg, dcfg, log=print):
  """decode.py's budget='auto': `auto_budget` of the tables beside the run config (`table_paths`);
  config_path: the config file. Logs which tables it used."""
  auto, what = auto_budget(*table_paths(config_path, config), tcfg, dcfg)
  log(what)
  return auto


@dataclasses.dataclass(frozen=True)
class PlusCollectives:
  """A one-GPU cost (calibrated or analytic) plus the collectives an N-GPU mesh adds per step
  (`analytic`'s 'collectives' term: 2 all-reduces per layer + 1, and the draft's)."""

  base: object
  analytic: AnalyticCost

  @property
  def source(self) -> str:
    return f"{self.base.source} + collectives x{self.analytic.share.gpus} GPUs (analytic)"

  def ms(self, n: int, ctx: int) -> float:
    return self.base.ms(n, ctx) + self.analytic.terms_ms(n, ctx)["collectives"]

  def mode_ms(self, mode: str, ctx: int) -> float:
    extra = self.analytic.terms_ms(1 if mode == "ar" else 2, ctx, with_draft=mode != "ar")
    return self.base.mode_ms(mode, ctx) + extra["collectives"]


def k26_models(calibration_json: str | None = None) -> dict:
  """{'1gpu': one GPU's share of full K2.6 (8-way split, INT4 experts, no collectives),
  '8gpu': the 8 x H200 projection (+ collectives)}: calibrated when a JSON is given (its config
  must be that share), else the analytic floor on the H200's measured ceilings."""
  from kdtree_jax import bench_models  # pylint: disable=import-outside-toplevel
  from kdtree_jax.target import config as model_config  # pylint: disable=import-outside-toplevel
  tcfg = model_config.kimi_k2_6()
  dcfg = bench_models.k26_dflash_share(tcfg, shards=1)  # the published K2.6 DFlash shape
  share = MeshShare(gpus=8, expert_bits=4.5)
  one = AnalyticCost(tcfg, dcfg, share, source="analytic K2.6 1/8 share, INT4 experts, H200")
  if calibration_json:
    one = load_calibration(calibration_json)
  eight = AnalyticCost(tcfg, dcfg, dataclasses.replace(share, collectives=True))
  return {"1gpu": one, "8gpu": PlusCollectives(one, eight)}


# A fixed-budget DDTree step that costs more than this many times the next smaller budget's
# (budgets here at most double) is flagged SUSPECT: the verify and the builder grow with the node
# count far slower than that on this pair (H100, 2026-12-05: budget 1 -> 31 took 0.38 -> 0.60
# ms/step), and a jump meant a path fell off its fast form (the removed rank-selection builder at
# 63: 5.92 ms after 0.60 at 31; notes/tree_builder.md, ddtree_build.AUTO_MAX_PADDED_CANDIDATES).
CLIFF_FACTOR = 2.0


def step_cliffs(rows, factor: float = CLIFF_FACTOR) -> list[str]:
  """SUSPECT lines for fixed-budget DDTree rows whose ms/step exceeds `factor` x the next smaller
  budget's of the same prompt set."""
  out = []
  for ps in sorted({r["prompts"] for r in rows}):
    fixed = sorted((r for r in rows if r["prompts"] == ps and r["mode"] == "ddtree"),
                   key=lambda r: r["budget"])
    for lo, hi in zip(fixed, fixed[1:]):
      if hi["ms_per_step"] > factor * lo["ms_per_step"]:
        out.append(f"SUSPECT {ps}: ddtree {hi['budget']} takes {hi['ms_per_step']:.3f} ms/step = "
                   f"{hi['ms_per_step'] / lo['ms_per_step']:.1f}x ddtree {lo['budget']}'s "
                   f"{lo['ms_per_step']:.3f}: a kernel or builder path may have left its fast form")
  return out
