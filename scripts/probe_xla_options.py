"""XLA compile options A/B on the fused decode step: the same step program (bench_k26_full's, at
bench.profile_ctx) compiled once per option set, all compiled at once, then each timed by ONE CUPTI
trace (its first, so command-buffer graphs are seen) on a fresh copy of the state: kernel ms per
step, launches per step, the slowest kernel families. A measurement of XLA's own choices (e.g. the
M=1 dots XLA emits as reduce fusions; Triton vs cuBLAS GEMMs at 16 rows), not a setting: a
winner becomes a `runtime.RuntimeConfig` default only after it is measured here.

  python scripts/probe_xla_options.py --config configs/bench_k26_full.py --out_dir runs/xla_opts
  (GPU: bash scripts/gpu_measure.sh $OUT xla_options:300; target layouts and TargetConfig
  A/Bs on the packed layout, default options: bash scripts/gpu_measure.sh $OUT target_layout:240,
  its TARGET_LAYOUTS)
"""
import functools
import json
import os

from absl import app, flags
import jax
from ml_collections import config_flags

from kdtree_jax import profiling, runtime, timing
from kdtree_jax.bench_setup import check_pair_fits
from kdtree_jax.bench_state import clone
from kdtree_jax import forced_accept
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.loader import DTYPES, load_draft, load_target
from kdtree_jax.pair import Pair
from kdtree_jax.config_overrides import with_overrides
from kdtree_jax.target.pack import apply_pack_fields, layout_params

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "bench_k26_full.py")
_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Bench config.")
_OUT = flags.DEFINE_string("out_dir", None, "Output folder (xla_options.jsonl).", required=True)
_MODES = flags.DEFINE_list("modes", ["ar", "ddtree"], "Step programs (ddtree at bench.budget).")
_VARIANTS = flags.DEFINE_list("variants", ["default", "no_triton_gemm", "triton_gemm_any",
                                           "all_triton"],
                              "Option sets: '+'-joined names of VARIANTS.")
_LAYOUTS = flags.DEFINE_list("layouts", ["per_layer"], "Target param layouts, each timed with "
                             "every variant (all of a mode's programs compiled at once): "
                             "per_layer (load_target's), packed (target.pack: load_pair's "
                             "and bench_k26_full's), packed_s5 (the fifth session's packed "
                             "layout: q_b, o, shared down and w_qc contracted on a major dim); "
                             "any of these + 'field=value...': the same params with those "
                             "TargetConfig fields set (e.g. packed+lean_glue=false).")
runtime.define_flags()

VARIANTS = {  # name -> XLA DebugOptions fields for compiler_options
    "default": {},
    "no_triton_gemm": {"xla_gpu_enable_triton_gemm": False},    # cuBLAS for every GEMM
    "triton_gemm_any": {"xla_gpu_triton_gemm_any": True},       # Triton even where slower
    "all_triton": {"xla_gpu_experimental_all_fusions_with_triton": True},
    # Triton block-level fusions for reduce + broadcast patterns (the norms: a one-row RMSNorm
    # is a reduce fusion and an elementwise fusion, two launches, under the default)
    "block_level": {"xla_gpu_experimental_enable_fusion_block_level_rewriter": True},
    "heroless": {"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True},
}
TOP = 8


def options(variant: str) -> dict:
  out = {}
  for name in variant.split("+"):
    if name not in VARIANTS:
      raise app.UsageError(f"unknown variant {name!r}; known: {sorted(VARIANTS)}")
    out.update(VARIANTS[name])
  return out


def _spec(c, mode):
  """bench_k26_full's step spec (forced acceptance) of `mode` at bench.budget."""
  return SpecConfig(mode=mode, budget=c.bench.budget, block_size=c.block_size,
                    max_new_tokens=4096, attn_backend=c.attn_backend,
                    target_choice=forced_accept.target_choice(c.forced_accept))


def probe_mode(pairs, c, mode, dtype, variants):
  """[{mode, layout, variant, options, ms, launches, top}] for one mode's step program per
  target layout (pairs: {layout: Pair}) and option set, all compiled at once."""
  spec = _spec(c, mode)
  first = next(iter(pairs.values()))
  state = profiling.bench_state(first.tcfg, first.dcfg, spec, 1, c.bench.profile_ctx, dtype)
  step = profiling._PHASES["step"]  # pylint: disable=protected-access
  jobs = []
  for layout, pair in pairs.items():
    lowered = step.lower(*profiling.phase_structs(pair, spec, state)["step"], tcfg=pair.tcfg,
                         dcfg=pair.dcfg, spec=spec)
    jobs += [(layout, pair, v, lowered) for v in variants]
  outs = timing.Deadline(float("inf")).box_all(
      [functools.partial(lo.compile, compiler_options=options(v)) for _, _, v, lo in jobs])
  rows = []
  feed = lambda args, out: (args[0], args[1], out)
  for (layout, pair, v, _), (exe, secs, status) in zip(jobs, outs):
    row = dict(mode=mode, budget=spec.budget if mode == "ddtree" else None, layout=layout,
               variant=v, options=options(v), compile_s=secs, status=status)
    if status == "ok":
      args = (pair.tparams, pair.dparams, clone(state))
      wall, args = timing.wall_ms(exe, args, feed, reps=5)
      kern, top, _ = timing.kernel_trace(exe, args, feed, iters=2)
      row.update(wall_ms=wall, ms=kern, launches=sum(n for _, n, _ in top) if top else None,
                 top=top[:TOP] if top else [])
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
  return rows


def make_layouts(tcfg, tp, names):
  """{name: (target config, params)} for --layouts: `pack.layout_params` of the names' bases
  (one copy of the routed experts among them), a name 'BASE+field=value...' being BASE's params
  with those TargetConfig fields set (`config_overrides`, e.g. packed+lean_glue=false); a
  pack-time field applied to the base's params (`pack.apply_pack_fields`: fold_norm_weights'
  new folded attention weights; int4_k_interleaved's pair-packed experts, donating the base's
  stacks where no other name reads that base (two copies of K2.6's experts do not fit an
  H200: packed beside packed+int4_k_interleaved=true needs two runs); every other array
  shared)."""
  bases = [n.split("+")[0] for n in names]
  params = layout_params(tcfg, tp, set(bases))
  out = {}
  for n, base in zip(names, bases):
    cfg = with_overrides(tcfg, n.split("+")[1:], f"--layouts {n!r}")
    alone = n != base and bases.count(base) == 1
    out[n] = (cfg, apply_pack_fields(cfg, params[base], donate_experts=alone))
  return out


def main(_):
  c = _CONFIG.value
  for v in _VARIANTS.value:  # every option set XLA accepts, before any weights load
    try:
      timing.check_compiler_options(options(v))
    except ValueError as e:
      raise app.UsageError(f"variant {v!r}: {e}") from None
  dtype = DTYPES[c.dtype]
  box = {}

  def load():
    box["tcfg"], tp = load_target(c.target, dtype)
    box["dcfg"], dp = load_draft(c.draft, box["tcfg"], dtype)
    return tp, dp

  check_pair_fits(jax.eval_shape(load), box["tcfg"].num_hidden_layers)  # before allocating
  tp, dp = load()
  tcfg, dcfg = box["tcfg"], box["dcfg"]
  pairs = {name: Pair(cfg, lp, dcfg, dp)
           for name, (cfg, lp) in make_layouts(tcfg, tp, _LAYOUTS.value).items()}
  del tp  # the layouts hold what they need (packed: the loaded non-expert arrays are freed)
  os.makedirs(_OUT.value, exist_ok=True)
  rows = []
  with open(os.path.join(_OUT.value, "xla_options.jsonl"), "w") as f:
    for mode in _MODES.value:
      for r in probe_mode(pairs, c, mode, dtype, _VARIANTS.value):
        rows.append(r)
        f.write(json.dumps(r) + "\n")
        f.flush()
  print(f"\nstep kernel time per XLA option set (ctx {c.bench.profile_ctx}; CUPTI, first trace)")
  lw = max([9] + [len(r["layout"]) for r in rows])
  print(f"{'mode':>6} {'layout':<{lw}} {'variant':<34} {'ms':>8} {'wall ms':>8} {'launches':>8}  "
        "top kernels (us)")
  for r in rows:
    tops = ", ".join(f"{n} {us:.0f}" for n, _, us in r.get("top", [])[:4])
    ms = f"{r['ms']:8.3f}" if r.get("ms") else f"{r['status']:>8}"
    print(f"{r['mode']:>6} {r['layout']:<{lw}} {r['variant']:<34} {ms} {r.get('wall_ms', 0):8.3f} "
          f"{r.get('launches') or 0:8.0f}  {tops}")


if __name__ == "__main__":
  app.run(main)
