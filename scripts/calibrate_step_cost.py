"""Step time vs verify width and context, measured: the table budget='auto' charges each width.

Compiles the budget='auto' device loop at every compiled width (its draft, largest tree and
scoring, then that width's verify: `speculative_step(width_index=i)`; --auto_programs=switch: the
one loop decode runs, the width as data behind lax.switch), the fixed modes' loops and a router
probe, all at once (parallel XLA compiles), then at every context (data too) and compiled width:
the time per step inside the device while loop (slope over two step counts: what tokens/s sees)
and its GPU kernel time per step (CUPTI, GPU only, after every loop timing of that program); `ar`,
`chain` and (--fixed_programs) DDTree compiled at each fixed node count the same way (rows
'ddtree_fixed': budget='auto''s whole-program candidates, `auto_program.py`); the distinct
routed experts the router picks per MoE layer in one verify of the largest tree (the first n + 1
rows of it are a width-(n + 1) verify); the analytic floor (`step_cost.AnalyticCost`, ceilings
measured in the same run) beside each, with measured / floor; each interior context predicted
from its neighbours vs measured; and a smooth model (`step_cost.fit_cost`) fitted to the ddtree
rows: its in-sample error and its error at each width / context left out of the fit (printed as
a table). One JSON (`--out_dir`/step_cost.json); copy it beside the config
(`configs/X.step_cost.json`) to make it the run's cost table.

  python scripts/calibrate_step_cost.py --config configs/bench_k26_full.py \
      --ctx 4096,46000,131072 --out_dir runs/calib
  python scripts/calibrate_step_cost.py --config configs/k2tiny.py --ctx 16,128,256 \
      --steps 4,32 --auto_programs switch   # the trained pair (real weights, random cache)
  python scripts/calibrate_step_cost.py --config configs/bench_tiny.py --ctx 256,1024 --small
"""

import dataclasses
import json
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import config_flags

from kdtree_jax import forced_accept, profiling, roofline, runtime, timing
from kdtree_jax.decoding import budget, step, step_cost
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.loader import DTYPES, load_draft, load_target_for_decode
from kdtree_jax.pair import Pair

runtime.define_flags()
_CONFIG = config_flags.DEFINE_config_file("config", None, "Bench config (configs/bench_*.py).")
_NODES = flags.DEFINE_list("nodes", ["1", "3", "7", "15", "31", "63"],
                          "Tree node counts (verify width - 1); eval_budget.py's auto needs these.")
_CTX = flags.DEFINE_list("ctx", ["4096", "46000", "131072"], "Context lengths.")
_MODES = flags.DEFINE_list("modes", ["ar", "chain"], "Fixed modes timed too.")
_STEPS = flags.DEFINE_list("steps", ["2", "10"], "Loop step counts of the slope.")
_EXPERTS_ALL_CTX = flags.DEFINE_bool("experts_all_ctx", False, "Count routed experts at every "
                                     "context (default: the first only).")
_PROGRAMS = flags.DEFINE_enum(
    "auto_programs", "per_width", ["per_width", "switch"], "per_width: one program per width "
    "(compiled in parallel; a 61-layer switch over 6 verifies compiles for minutes); switch: the "
    "auto loop decode runs, the width as data behind lax.switch (one compile, incl. the branch).")
_FIXED = flags.DEFINE_bool("fixed_programs", True, "Also time DDTree compiled at each fixed node "
                            "count of --nodes (budget='auto''s whole-program candidates, "
                            "rows 'ddtree_fixed').")
_KERNEL = flags.DEFINE_bool("kernel_ms", True, "CUPTI kernel ms per step (GPU), after the loop "
                            "timings of each program.")
_SMALL = flags.DEFINE_bool("small", False, "Tiny ceiling measurements (CPU smoke runs).")
_OUT = flags.DEFINE_string("out_dir", "runs/calib", "Output folder (step_cost.json).")


def loop_fn(tcfg, dcfg, spec, width=None):
  """jit(tp, dp, state, n, idx): n steps of the budget='auto' device loop at compiled width idx
  (data: the loop decode runs, every width's verify behind one switch); with `width` (a Python
  int), jit(tp, dp, state, n): that width's verify compiled alone (same draft, tree, scoring)."""
  def run(tp, dp, st, n, idx):
    return jax.lax.while_loop(lambda s: s.steps < n, lambda s: step.speculative_step(
        Pair(tcfg, tp, dcfg, dp), spec, s, width_index=idx), st)
  if width is None:
    return jax.jit(run)
  return jax.jit(lambda tp, dp, st, n: run(tp, dp, st, n, width))


def per_step_ms(fn, args, steps):
  """Loop wall time per step: slope over two step counts (whole-loop mean if noise wins)."""
  a, b = steps
  t = {n: roofline.wall_time_s(fn, *args(n), reps=5) for n in (a, b)}
  slope = 1e3 * (t[b] - t[a]) / (b - a)
  return (slope, "slope") if slope > 0 else (1e3 * t[b] / b, "total")


def lower_probe(tcfg, dcfg, spec, tp, dp, abstract_state):
  """Lowered (tp, dp, state) -> expert ids [T, K] of every MoE layer in a verify of the largest
  tree (draft -> tree -> verify), recorded from the router while tracing. A node sees only its
  ancestors, so the first n + 1 rows are exactly the routes of a width-(n + 1) verify."""
  def probe(tp_, dp_, st):
    routes = []
    _, logits = step.draft_phase(dcfg, dp_, tp_, spec, st)
    tree = step.tree_phase(spec, logits, st.bonus.shape[0])
    step.verify_phase(tcfg, tp_, spec, st, tree, tuple(dcfg.target_layer_ids), routes=routes)
    return routes

  return jax.jit(probe).lower(tp, dp, abstract_state)


def lower_programs(tcfg, tp, dcfg, dp, specs, state_of) -> dict:
  """{name: lowered}: the auto loop ('auto', width as data; or 'auto<i>' per width with
  --auto_programs=per_width), each fixed mode's loop, the router probe; traced one after
  another."""
  shapes = {n: jax.eval_shape(lambda sp=sp: state_of(sp)) for n, sp in specs.items()}
  i32 = jax.ShapeDtypeStruct((), jnp.int32)
  auto = specs["auto"]
  if _PROGRAMS.value == "switch":
    lowered = {"auto": loop_fn(tcfg, dcfg, auto).lower(tp, dp, shapes["auto"], i32, i32)}
  else:
    lowered = {f"auto{i}": loop_fn(tcfg, dcfg, auto, i).lower(tp, dp, shapes["auto"], i32)
               for i in range(len(auto.auto.node_counts))}
  for m, sp in specs.items():
    if m != "auto":
      lowered[m] = profiling.while_steps_fn(sp).lower(Pair(tcfg, tp, dcfg, dp), shapes[m], i32)
  if tcfg.num_moe_layers:
    lowered["probe"] = lower_probe(tcfg, dcfg, auto, tp, dp, shapes["auto"])
  return lowered


def compile_all(lowered: dict) -> dict:
  """{name: executable}: every lowered program compiled at once (one thread each; XLA compiles
  in parallel), compile seconds printed; a program that fails to compile maps to None."""
  names = list(lowered)
  out = timing.Deadline(float("inf")).box_all([lowered[n].compile for n in names])
  for n, (_, secs, status) in zip(names, out):
    print(f"compile {n:>6}: {secs:6.1f} s ({status})", flush=True)
  return {n: exe for n, (exe, _, _) in zip(names, out)}


def distinct_experts(ids_per_layer, width, local):
  """Distinct experts held here (ids < local) per MoE layer among the first `width` verify
  tokens (ids [T, K], batch 1)."""
  return [len(np.unique(i[:width][i[:width] < local])) for i in ids_per_layer]


def time_group(jobs, steps):
  """Loop ms per step of every job (row, fn, args_for) first, then (--kernel_ms, GPU) their
  CUPTI kernel ms, then the first job's loop ms again (`loop_ms_after_cupti`): on the H200 an
  executable's loop ran 2.4x slower after CUPTI had traced it (k2tiny ar 0.194 -> 0.476 ms), so
  no wall time is taken after that executable's kernel pass."""
  for r, fn, args_for in jobs:
    r["loop_ms"], r["timing"] = per_step_ms(fn, args_for, steps)
    r["loop_over_analytic"] = r["loop_ms"] / r["analytic_ms"]
  if not _KERNEL.value:
    return
  for r, fn, args_for in jobs:
    kern, _ = timing.kernel_ms(fn, args_for(steps[1]), iters=1)
    r["kernel_ms"] = None if kern is None else kern / steps[1]
  r, fn, args_for = jobs[0]
  if r["kernel_ms"] is not None:
    r["loop_ms_after_cupti"] = per_step_ms(fn, args_for, steps)[0]


def _width_program(exe, i, tp, dp, st):
  """(loop, args_for(n)) timing compiled width i: its own program, else the switch loop."""
  if f"auto{i}" in exe:
    return exe[f"auto{i}"], lambda n: (tp, dp, st, jnp.int32(n))
  return exe["auto"], lambda n: (tp, dp, st, jnp.int32(n), jnp.int32(i))


def ddtree_rows(exe, tcfg, tp, dp, spec, big, analytic, ctxs, steps, save):
  """One row per (context, compiled width) of the budget='auto' loop(s) (`_width_program`),
  timed by `time_group`; routed experts (`exe['probe']`) counted at the first context (all with
  --experts_all_ctx)."""
  rows, jobs = [], []
  for ctx in ctxs:
    st = profiling.at_context(big, spec, ctx)
    for i, nodes in enumerate(spec.auto.node_counts):
      fn, args_for = _width_program(exe, i, tp, dp, st)
      rows.append(row("ddtree", nodes + 1, ctx, analytic.ms(nodes + 1, ctx), [], tcfg))
      jobs.append((rows[-1], fn, args_for))
  time_group(jobs, steps)
  for ctx in ctxs:
    here = [r for r in rows if r["ctx"] == ctx]
    if exe.get("probe") is not None and (ctx == ctxs[0] or _EXPERTS_ALL_CTX.value):
      st = profiling.at_context(big, spec, ctx)
      ids = [np.asarray(i) for i in jax.device_get(exe["probe"](tp, dp, st))]
      local = tcfg.num_local_experts or tcfg.n_routed_experts
      for r in here:
        r.update(experts(distinct_experts(ids, r["width"], local), r["width"], tcfg))
    print("\n".join(_fmt(r) for r in here), flush=True)
  save(rows)
  return rows


def mode_spec(c, dcfg, mode):
  return SpecConfig(mode=mode, block_size=dcfg.block_size, max_new_tokens=4096,
                    attn_backend=c.attn_backend,
                    target_choice=forced_accept.target_choice(c.get("forced_accept", -1)))


def mode_rows(exe, tcfg, pair, spec, big, analytic, ctxs, steps, label):
  """Rows of one fixed program ('ar', 'chain', or 'ddtree_fixed': DDTree compiled at
  spec.budget nodes; loop `exe`) at every context, timed by `time_group`."""
  rows, jobs = [], []
  for ctx in ctxs:
    st = profiling.at_context(big, spec, ctx)
    floor = analytic.mode_ms(spec.mode, ctx) if spec.mode != "ddtree" else \
        analytic.ms(spec.verify_width, ctx)
    rows.append(row(label, spec.verify_width, ctx, floor, [], tcfg))
    jobs.append((rows[-1], exe, lambda n, st=st: (pair, st, jnp.int32(n))))
  time_group(jobs, steps)
  print("\n".join(_fmt(r) for r in rows), flush=True)
  return rows


def row(mode, width, ctx, analytic_ms, touched, tcfg):
  """A row before timing (`time_group` fills loop_ms, timing, kernel_ms)."""
  return dict(mode=mode, width=width, ctx=ctx, loop_ms=None, timing=None, kernel_ms=None,
              analytic_ms=analytic_ms, loop_over_analytic=None, **experts(touched, width, tcfg))


def experts(touched, width, tcfg):
  """Router-counted distinct local experts per MoE layer, their mean, and the model's value
  (independent routing over all E, the local share of them)."""
  local = tcfg.num_local_experts or tcfg.n_routed_experts
  model = step_cost.experts_touched(tcfg.n_routed_experts, tcfg.num_experts_per_tok, width)
  return dict(experts_touched_per_layer=touched,
              experts_touched_mean=float(np.mean(touched)) if touched else None,
              experts_touched_model=float(model * local / tcfg.n_routed_experts))


def _fmt(r):
  kern = "-" if r["kernel_ms"] is None else f"{r['kernel_ms']:.3f}"
  ex = "-" if r["experts_touched_mean"] is None else (
      f"{r['experts_touched_mean']:.1f}/{r['experts_touched_model']:.1f}")
  after = f"  (after CUPTI {r['loop_ms_after_cupti']:.3f})" if "loop_ms_after_cupti" in r else ""
  return (f"{r['mode']:>12} {r['width']:>4} {r['ctx']:>7} {r['loop_ms']:9.3f} {kern:>9} "
          f"{r['analytic_ms']:9.3f} {r['loop_over_analytic']:7.2f} {ex:>11}{after}")


def held_out_contexts(rows):
  """Each interior context predicted by the line through its neighbours, vs measured (a check of
  the table's linear-in-context interpolation)."""
  out = []
  for mode, width in sorted({(r["mode"], r["width"]) for r in rows}):
    pts = sorted((r["ctx"], r["loop_ms"]) for r in rows if (r["mode"], r["width"]) == (mode, width))
    for (c0, m0), (c1, m1), (c2, m2) in zip(pts, pts[1:], pts[2:]):
      pred = m0 + (m2 - m0) * (c1 - c0) / (c2 - c0)
      out.append(dict(mode=mode, width=width, ctx=c1, predicted_ms=pred, measured_ms=m1,
                      error=pred / m1 - 1))
  return out


def fit_errors(rows, tcfg):
  """step_cost.prediction_errors of the ddtree rows: a smooth model (experts touched, N, L, N L)
  fitted to them in-sample, and held out by width and by context."""
  pts = [(r["width"], r["ctx"], r["loop_ms"]) for r in rows if r["mode"] == "ddtree"]
  return step_cost.prediction_errors(pts, tcfg.n_routed_experts, tcfg.num_experts_per_tok)


def _pct(x):
  return "-" if x is None else f"{100 * x:+.1f}%"


def fit_table(errors) -> str:
  """The prediction-error table, and the largest |error| of each column."""
  lines = ["fitted step-cost model (ms = a + b experts(N) + c N + d L + e N L, relative least "
           "squares) vs measured loop ms per step:",
           f"{'N':>4} {'ctx':>7} {'measured':>9} {'in-sample':>10} {'w/o width':>10} "
           f"{'w/o ctx':>9}"]
  for e in errors:
    lines.append(f"{e['width']:>4} {e['ctx']:>7} {e['measured_ms']:9.3f} "
                 f"{_pct(e['in_sample_error']):>10} {_pct(e['without_width_error']):>10} "
                 f"{_pct(e['without_ctx_error']):>9}")
  worst = {k: max((abs(e[f"{k}_error"]) for e in errors if e[f"{k}_error"] is not None),
                  default=None) for k in ("in_sample", "without_width", "without_ctx")}
  lines.append("max |error|: " + ", ".join(f"{k} {_pct(v)}" for k, v in worst.items()))
  return "\n".join(lines)


HEADER = (f"{'mode':>12} {'N':>4} {'ctx':>7} {'loop ms':>9} {'kern ms':>9} {'floor ms':>9} "
          f"{'x floor':>7} {'experts':>11}  (experts: router-counted / independent-routing model)")


def main(_):
  c = _CONFIG.value
  t0 = time.perf_counter()
  dtype = DTYPES[c.dtype]
  tcfg, tp = load_target_for_decode(c.target, dtype)
  dcfg, dp = load_draft(c.draft, tcfg, dtype)
  ctxs = sorted(int(x) for x in _CTX.value)
  steps = tuple(int(s) for s in _STEPS.value)
  ceil = roofline.measure_ceilings(small=_SMALL.value)
  hw = step_cost.Hardware(copy_tbps=ceil["copy_tbps"], mm_tflops=ceil["mm_tflops"])
  wbytes = jnp.dtype(dtype).itemsize  # the config is one GPU's share: gpus=1, no collectives
  share = step_cost.MeshShare(expert_bits=8 * profiling.expert_bytes_per_weight(tp, wbytes),
                              weight_bits=8 * wbytes)
  analytic = step_cost.AnalyticCost(tcfg, dcfg, share, hw)
  auto = budget.AutoBudget(node_counts=tuple(int(n) for n in _NODES.value))
  spec = SpecConfig(mode="ddtree", budget="auto", block_size=dcfg.block_size, max_new_tokens=4096,
                    attn_backend=c.attn_backend,
                    target_choice=forced_accept.target_choice(c.get("forced_accept", -1)),
                    auto=budget.resolve(auto, tcfg, dcfg))
  state_of = lambda sp: profiling.bench_state(tcfg, dcfg, sp, 1, max(ctxs), dtype,
                                              steps=max(steps) + 4)
  specs = {"auto": spec, **{m: mode_spec(c, dcfg, m) for m in _MODES.value}}
  if _FIXED.value:
    specs.update({f"ddtree{n}": dataclasses.replace(spec, budget=n, auto=None)
                  for n in spec.auto.node_counts})
  lowered = lower_programs(tcfg, tp, dcfg, dp, specs, state_of)
  print(f"device={jax.devices()[0].device_kind} layers={tcfg.num_hidden_layers} "
        f"ceilings copy {hw.copy_tbps:.2f} TB/s mm {hw.mm_tflops:.0f} TFLOP/s", flush=True)
  exe = compile_all(lowered)
  os.makedirs(_OUT.value, exist_ok=True)
  path = os.path.join(_OUT.value, "step_cost.json")
  meta = dict(config=c.to_dict(), device=jax.devices()[0].device_kind, ceilings=ceil,
              layers=tcfg.num_hidden_layers, dtype=c.dtype,
              forced_accept=forced_accept.forced_count(spec), auto_programs=_PROGRAMS.value)

  def save(rows):  # after every stage: a time-boxed run still leaves what it measured
    with open(path, "w") as f:
      json.dump(dict(meta, seconds=time.perf_counter() - t0, rows=rows,
                     held_out_contexts=held_out_contexts(rows),
                     prediction_errors=fit_errors(rows, tcfg)), f, indent=1)

  print(HEADER, flush=True)
  rows = ddtree_rows(exe, tcfg, tp, dp, spec, state_of(spec), analytic, ctxs, steps, save)
  for m in (m for m in specs if m != "auto"):  # one cache-sized state in memory at a time
    label = "ddtree_fixed" if m.startswith("ddtree") else m
    rows += mode_rows(exe[m], tcfg, Pair(tcfg, tp, dcfg, dp), specs[m], state_of(specs[m]),
                      analytic, ctxs, steps, label)
    save(rows)
  checks = held_out_contexts(rows)
  print(f"\nwrote {path} ({time.perf_counter() - t0:.0f} s)\n{HEADER}")
  print("\n".join(_fmt(r) for r in rows))
  for k in checks:
    print(f"held-out context {k['ctx']}: {k['mode']} N={k['width']} interpolated "
          f"{k['predicted_ms']:.3f} ms vs measured {k['measured_ms']:.3f} "
          f"({100 * k['error']:+.1f}%)")
  print(fit_table(fit_errors(rows, tcfg)))


if __name__ == "__main__":
  app.run(main)
