"""K2.6 at full depth on one GPU's share, in one time-boxed run: compile time, phase tables,
throughput vs context, host gap. Everything goes to <out_dir>/bench_k26_full.jsonl as it is
measured; a short table, most valuable rows first, is printed last.

  python scripts/bench_k26_full.py --config configs/bench_k26_full.py --out_dir runs/k26_full

Parts, in order (each compile counted and time-boxed; the run stops cleanly at --time_budget_s):
  1. compile, per mode (ddtree at bench.budget): the prefill program and the device loop
     (`loop.prefill_device`, `loop.steps_device`: the programs `Stream` runs), lowered one by
     one, then compiled all at once (one thread each); seconds and XLA compile counts each;
  2. throughput vs context (bench.ctxs) per mode with the compiled loops (every context's wall
     time first), then a jax.profiler trace per context: device-busy time per step (union of
     kernel intervals) and the host gap = loop ms per step - device-busy (cheap once compiled,
     so before the tables); for a loop run as a CUDA graph the gap is n/a (graph): the profiler
     runs it op by op, so its trace is not the graph's;
  3. phase tables at bench.profile_ctx: `ar`, then ddtree at bench.profile_budgets[0] (those of
     bench.phase_modes, "ar,ddtree" unless set: "ddtree" skips ar's, "none" every table), with
     verify's attention / moe (on the step's own MoE inputs, so its routing) / rest, the host
     gap (loop ms per step at profile_ctx - the fused step's CUPTI kernel time; when the run
     uses command buffers, of the step compiled again without them, `step_nograph`: every
     kernel host-launched and seen by CUPTI), the slowest kernel families of verify and the
     step, verify's kernels by jax op (HLO op_name and source line of each kernel: the top
     LISTING_TOP, from the same compiled program and CUPTI trace), and the verify program's
     matmuls that share an input (launches that could merge);
  4. phase tables for the other budgets (no attention / moe split; when phase_modes has ddtree).
Command buffers follow the runtime config (on by default; `--nocommand_buffers` turns them off);
bench.ab_loop_modes (or --ab_loop_modes=ddtree,...) compiles those modes' loops again with the
other setting (`_cmdbuf` rows: with command buffers; `_nograph`: without) for the throughput
A/B, or with the run's setting plus --ab_loop_options (`_opts` rows; e.g.
xla_gpu_enable_pdl=false: does PDL make the graph loop faster than its no-graph kernels?), or
lowered again with --ab_loop_bench's overrides of the spec or of the target's run-time fields
(`_spec` rows; e.g. tree_impl=xla, target.mosaic_pdl=true: an A/B inside one process, since
two processes' loops of one program can differ by more than the A/B: DDTree 15 6.003 vs 6.280
ms/step on an H100, s17); each A/B ends with a paired row: the default and the A/B loop timed
interleaved at profile_ctx (`throughput.paired_slopes`, PAIRED_ROUNDS rounds, the order
reversed every other round), the median per-round ratio, its range and a sign count: the row that
decides an A/B (the sequential rows drift: a DDTree 64 loop's fastest-of-3 walls spread 2.5%); a
`_cmdbuf` compile also dumps XLA's thunks and prints which parts became CUDA graphs (the
optimised HLO cannot show it: notes/runtime.md), keeping the thunk files in out_dir.
The printed summary puts compile times and the ar / first-budget tables first; a host gap
negative beyond noise (a loop faster than its kernels) is printed with an IMPOSSIBLE warning
for a host-launched loop; for a graph loop (command buffers) it is what the graph saves
(PDL overlap, launch work) and the note says no host gap is visible (`throughput.gap_verdict`).
The config's `bench` section chooses the sizes (configs/bench_tiny.py runs it on a CPU).
"""

import copy
import dataclasses
import json
import os
import shutil
import sys
import tempfile


from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags

from kdtree_jax import profiling, profiling_hlo, roofline, runtime, throughput, timing
from kdtree_jax.bench_setup import bench_spec, load_bench_pair
from kdtree_jax.bench_state import at_context, bench_state
from kdtree_jax.config_overrides import with_overrides
from kdtree_jax.decoding import loop
from kdtree_jax.loader import DTYPES
from kdtree_jax.pair import Pair

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "bench_k26_full.py")
_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Bench config.")
_OUT = flags.DEFINE_string("out_dir", None, "Output folder (bench_k26_full.jsonl).", required=True)
_BUDGET_S = flags.DEFINE_float("time_budget_s", 530.0, "Wall-clock budget of the whole run.")
_COMPILE_ONLY = flags.DEFINE_bool("compile_only", False, "Part 1 only, on abstract weights "
                                  "(nothing allocated: any machine can time the compile).")
_AB_LOOP_MODES = flags.DEFINE_string(
    "ab_loop_modes", None, "Comma-separated modes (e.g. 'ddtree') whose device loop is compiled "
    "again with the other command-buffer setting and timed beside the default (`_cmdbuf` / "
    "`_nograph` rows); the `_cmdbuf` compile also dumps XLA's thunks and prints which of them "
    "kept the loop out of a graph. Default: the config's bench.ab_loop_modes.")
_AB_LOOP_OPTIONS = flags.DEFINE_string(
    "ab_loop_options", "", "Comma-separated XLA compiler options, e.g. 'xla_gpu_enable_pdl=false':"
    " the A/B loops of --ab_loop_modes then keep this run's command-buffer setting and add these "
    "options (`_opts` rows) instead of flipping the setting.")
_AB_LOOP_BENCH = flags.DEFINE_string(
    "ab_loop_bench", "", "Comma-separated overrides of the decode spec's bench keys and of the "
    "target config's run-time fields, e.g. 'tree_impl=xla' or 'target.mosaic_pdl=true': the A/B "
    "loops of --ab_loop_modes are lowered again with them and this run's compiler options "
    "(`_spec` rows), on the same params and state. Keys: SPEC_AB_KEYS, 'target.' + "
    "TARGET_AB_FIELDS.")
SPEC_AB_KEYS = ("tree_impl",)  # bench keys bench_spec reads that leave the loop's state alone
# TargetConfig fields that choose kernels and glue only: the same params serve both loops (a
# pack-time field such as fold_norm_weights or int4_k_interleaved would read unpacked weights
# as packed ones: same shapes, wrong values)
TARGET_AB_FIELDS = ("mosaic_pdl", "moe_glue", "lean_glue", "router_impl", "expert_backend",
                    "align_expert_rows_from", "one_token_rows_first", "expert_variants")
runtime.define_flags()


class Recorder:
  """JSON lines, written (and flushed) as each result arrives."""

  def __init__(self, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    self.path = os.path.join(out_dir, "bench_k26_full.jsonl")
    self.file = open(self.path, "w")  # pylint: disable=consider-using-with
    self.rows = []

  def add(self, kind, **row):
    row = dict(kind=kind, **row)
    self.rows.append(row)
    self.file.write(json.dumps(row, default=str) + "\n")
    self.file.flush()
    return row


def _loop_capacity(c, spec):
  return max(c.bench.ctxs) + spec.commit_width * throughput.loop_state_steps(c.bench.gen)


def lower_programs(m, c, spec, parts=("prefill", "loop")):
  """{part: Lowered} of `spec`'s prefill program and device loop (those in `parts`; lowered here,
  in order: the Mosaic kernels compile at lowering, once per shape), and the loop's capacity."""
  tcfg, tp, dcfg, dp, dtype = m
  max_len = _loop_capacity(c, spec)
  pair, kw = Pair(tcfg, tp, dcfg, dp), dict(spec=spec)
  prompts = jax.ShapeDtypeStruct((1, c.bench.prompt_len), jnp.int32)
  lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
  state = jax.eval_shape(lambda: bench_state(tcfg, dcfg, spec, 1, max(c.bench.ctxs), dtype,
                                             steps=throughput.loop_state_steps(c.bench.gen)))
  lower = {"prefill": lambda: loop.prefill_device.lower(
               pair, prompts, lengths, jax.random.key(0), max_len=max_len, cache_dtype=dtype,
               **kw),
           "loop": lambda: loop.steps_device.lower(pair, state, jnp.int32(0), **kw)}
  return {part: lower[part]() for part in parts}, max_len


def _compile(lowered, options=None):
  with timing.CompileCounter() as cc:
    exe = lowered.compile(compiler_options=options)
  return exe, cc.as_dict()


def ab_variant():
  """(suffix, compiler_options, command buffers on) of the A/B loop: with --ab_loop_bench, the
  default loop's options (None) on another spec (`_spec`); with --ab_loop_options, this
  process's command-buffer setting (`runtime`) plus those options (`_opts`); else the other
  setting than this process's (`_nograph` under the default, `_cmdbuf` with them off)."""
  on = runtime.command_buffers_on()
  if _AB_LOOP_OPTIONS.value and _AB_LOOP_BENCH.value:
    raise ValueError("--ab_loop_options and --ab_loop_bench: one A/B per run")
  if _AB_LOOP_BENCH.value:
    return "_spec", None, on
  if _AB_LOOP_OPTIONS.value:
    base = runtime.COMMAND_BUFFER_OPTIONS if on else timing.NO_COMMAND_BUFFERS
    return "_opts", dict(base, **parse_options(_AB_LOOP_OPTIONS.value)), on
  if on:
    return "_nograph", timing.NO_COMMAND_BUFFERS, False
  return "_cmdbuf", runtime.COMMAND_BUFFER_OPTIONS, True


def ab_spec(c, mode):
  """The A/B loop's decode spec: `mode`'s, with --ab_loop_bench's overrides of c.bench."""
  bench_over, _ = ab_overrides(_AB_LOOP_BENCH.value)
  if not bench_over:
    return bench_spec(c, mode)
  c_ab = copy.deepcopy(c)
  with c_ab.unlocked():
    c_ab.bench.update(bench_over)
  return bench_spec(c_ab, mode)


def ab_model(m):
  """The A/B loop's (tcfg, tparams, dcfg, dparams, dtype): m with --ab_loop_bench's target.*
  fields set in its target config (the same params)."""
  _, target_items = ab_overrides(_AB_LOOP_BENCH.value)
  if not target_items:
    return m
  tcfg, *rest = m
  return (with_overrides(tcfg, target_items, "--ab_loop_bench"), *rest)


def ab_overrides(text):
  """--ab_loop_bench's 'k=v,...' as ({bench key: value}, ['field=value' of the target]); every
  key one of SPEC_AB_KEYS or 'target.' + one of TARGET_AB_FIELDS."""
  bench_over, target_items = {}, []
  for item in (x.strip() for x in text.split(",") if x.strip()):
    key = item.split("=", 1)[0].strip()
    field = key.removeprefix("target.")
    if key.startswith("target.") and field in TARGET_AB_FIELDS:
      target_items.append(item.removeprefix("target."))
    elif key in SPEC_AB_KEYS:
      bench_over.update(parse_options(item))
    else:
      raise ValueError(f"--ab_loop_bench: {key!r} is not one of {SPEC_AB_KEYS} or target.* of "
                       f"{TARGET_AB_FIELDS} (a key that changes the loop's state or params "
                       "cannot share them)")
  return bench_over, target_items


def parse_options(text):
  """'k=v,k2=v2' -> {k: v}: 'true' / 'false' as bools, integers as ints, else strings (the types
  `compiler_options` wants)."""
  out = {}
  for item in (x.strip() for x in text.split(",") if x.strip()):
    key, value = item.split("=", 1)
    low = value.strip().lower()
    out[key.strip()] = ({"true": True, "false": False}[low] if low in ("true", "false")
                        else int(low) if low.lstrip("-").isdigit() else value.strip())
  return out


def _ab_modes(c):
  if _AB_LOOP_MODES.value is not None:
    return {m for m in _AB_LOOP_MODES.value.split(",") if m}
  return set(c.bench.get("ab_loop_modes", ()))


def compile_modes(m, c, specs, deadline, rec):
  """Lowers every spec's prefill + loop (timed, one by one), then compiles them all at once,
  one thread each (XLA compiles release the GIL), in one box; records each program's seconds.
  Returns {mode: compiled loop or None}."""
  jobs, loops = [], {}
  for spec in specs:
    t0 = deadline.left()
    try:
      lowered, max_len = lower_programs(m, c, spec)
    except Exception as e:  # pylint: disable=broad-except  (recorded; the other modes go on)
      rec.add("compile", mode=spec.mode, budget=_budget(spec), part="lower",
              seconds=t0 - deadline.left(), status=f"error: {type(e).__name__}: {e}"[:500])
      print(f"compile {spec.mode:>6}: lowering failed: {e}", flush=True)
      loops[spec.mode] = None
      continue
    if spec.mode in _ab_modes(c):
      ab_loop = (lower_programs(ab_model(m), c, ab_spec(c, spec.mode), ("loop",))[0]["loop"]
                 if _AB_LOOP_BENCH.value else lowered["loop"])
      lowered["loop" + ab_variant()[0]] = ab_loop
    jobs += [(spec, part, low, max_len, (t0 - deadline.left()) / 2) for part, low in lowered.items()]
  suffix, options, _ = ab_variant()
  dumps = {}  # the `_cmdbuf` loops' XLA dump folders (their thunks: `thunk_graph_report`)
  for spec, part, *_ in jobs:
    if part.endswith(suffix) and suffix == "_cmdbuf":
      dumps[spec.mode] = tempfile.mkdtemp(prefix=f"xla_dump_{spec.mode}_cmdbuf_")
  opts = [None if not j[1].endswith(suffix) else
          runtime.command_buffer_options(dumps[j[0].mode]) if j[0].mode in dumps else options
          for j in jobs]
  outs = deadline.box_all([lambda j=j, o=o: _compile(j[2], o) for j, o in zip(jobs, opts)],
                          c.bench.compile_box_s)
  for (spec, part, _, max_len, lower_s), (out, secs, status) in zip(jobs, outs):
    exe, counts = out if out else (None, {})
    rec.add("compile", mode=spec.mode, budget=_budget(spec), part=part, seconds=lower_s + secs,
            lower_s=lower_s, compile_s=secs, status=status, max_len=max_len,
            concurrent=len(jobs), **counts)
    print(f"compile {spec.mode:>6} {part:>7}: lower {lower_s:6.1f} s + compile {secs:7.1f} s "
          f"({status}, {len(jobs)} at once) {counts}", flush=True)
    if part.startswith("loop"):
      loops[spec.mode + part.removeprefix("loop")] = exe
  for mode, folder in dumps.items():
    if loops.get(mode + suffix) is not None:
      thunk_graph_report(mode + suffix, folder, rec)
  return loops


NO_THUNK_DUMP = "no thunk dump (no command buffer formed, a compile-cache hit, or not a GPU)"


def thunk_graph_report(label, folder, rec):
  """Which parts of the `_cmdbuf` loop became CUDA graphs, from XLA's thunk dump of its compile
  (the optimised HLO cannot show it): is the while loop inside a graph, else per iteration its
  graph launches and the thunks launched outside graphs, by kind. The dump's thunk files are
  kept in out_dir (thunks_<label>.*); the rest of the dump (HLO, PTX) is deleted."""
  rep = profiling_hlo.collect_thunk_dump(folder, _OUT.value, label)
  shutil.rmtree(folder, ignore_errors=True)
  rec.add("thunks", label=label, found=rep is not None, **(rep or {}))
  print(profiling_hlo.format_thunk_report(rep, f"{label} loop") if rep
        else f"thunk report {label}: {NO_THUNK_DUMP}", flush=True)


def graph_report(mode, exe, rec):
  """How much of the compiled loop runs in command buffers (from its optimised HLO): whether
  the while loop is captured, graph launches per step, what runs outside the graphs."""
  if exe is None:
    return
  try:
    rep = profiling_hlo.command_buffer_report(exe.as_text())
  except Exception as e:  # pylint: disable=broad-except  (a report, not a measurement)
    print(f"command-buffer report {mode}: {type(e).__name__}: {e}", flush=True)
    return
  rec.add("command_buffers", mode=mode, **rep)
  print(profiling_hlo.format_command_buffers(rep, f"{mode} loop"), flush=True)


def _budget(spec):
  return spec.budget if spec.mode == "ddtree" else None


def phase_table(m, c, spec, ceil, deadline, rec, parts=True):
  """One phase table at bench.profile_ctx (compiles counted; boxed). Returns False on timeout
  (an error is recorded and the run goes on)."""
  tcfg, tp, dcfg, dp, dtype = m

  def run():
    with timing.CompileCounter() as cc:
      state = profiling.bench_state(tcfg, dcfg, spec, 1, c.bench.profile_ctx, dtype)
      rows = profiling.profile_step(Pair(tcfg, tp, dcfg, dp), spec, state, ceil,
                                    reps=c.bench.reps, parts=parts)
    return rows, cc.as_dict()

  out, secs, status = deadline.box(run)
  rows, counts = out if out else ([], {})
  rec.add("phases", mode=spec.mode, budget=_budget(spec), ctx=c.bench.profile_ctx, ceil=ceil,
          seconds=secs, status=status, rows=profiling.as_dicts(rows), **counts)
  title = f"phase table: {spec.mode} budget={_budget(spec)} ctx={c.bench.profile_ctx}"
  print(f"\n== {title} ({status}, {secs:.1f} s, {counts})", flush=True)
  if rows:
    print(profiling.format_table(rows), flush=True)
    step = "step_nograph" if any(r.phase == "step_nograph" for r in rows) else "step"
    for phase in ("rest", "verify", step) if parts else ():
      if profiling.format_kernels(rows, phase):
        print(profiling.format_kernels(rows, phase), flush=True)
    if profiling.format_listing(rows, "verify"):
      print(profiling.format_listing(rows, "verify"), flush=True)
  return status != "timeout"


def host_gaps(c, rec):
  """A host_gap row per phase table with a CUPTI step row and a throughput row at its ctx."""
  for t in [r for r in rec.rows if r["kind"] == "phases" and r["rows"]]:
    gap = host_gap_row(rec.rows, t["mode"], t["budget"], t["rows"], c.bench.profile_ctx)
    if gap:
      rec.add("host_gap", **gap)
      loop = "graph loop" if gap["graphs"] else "loop"
      print(f"host gap {t['mode']} budget={t['budget']} ctx={gap['ctx']}: {loop} "
            f"{gap['loop_ms']:.3f} ms/step - step kernels {gap['kernel_ms']:.3f} ms = "
            f"{gap['host_gap_us']:.1f} us/step ({gap['method']}) {gap['warning']}", flush=True)


GAP_METHOD = ("loop wall slope per step (the run's command-buffer setting) - CUPTI kernel sum of "
              "the same step without command buffers (`step`, or `step_nograph` when the run "
              "uses them)")


def host_gap_row(rows, mode, budget, phase_rows, ctx):
  """{mode, budget, ctx, loop_ms, kernel_ms, host_gap_us, graphs, method, warning} from the
  throughput row of (mode, budget) at `ctx` (the run's own loop, not the A/B variant) and the
  phase table's step_nograph row, else its step row (dicts; CUPTI only), or None when either is
  missing. graphs: the loop ran as a CUDA graph; then a loop under the kernels is no error
  (`throughput.gap_verdict`)."""
  loop_row = next((r for r in rows if r["kind"] == "throughput" and r.get("ctx") == ctx
                   and r["mode"] == mode and r["budget"] == budget
                   and not r.get("ab_variant")), None)
  cupti = {r["phase"]: r for r in phase_rows if r["timer"] == "cupti"}
  step = cupti.get("step_nograph", cupti.get("step"))
  if loop_row is None or step is None:
    return None
  gap = 1e3 * (loop_row["ms_per_step"] - step["ms"])
  graphs = bool(loop_row.get("graphs"))
  return dict(mode=mode, budget=budget, ctx=ctx, loop_ms=loop_row["ms_per_step"],
              kernel_ms=step["ms"], host_gap_us=gap, graphs=graphs, method=GAP_METHOD,
              warning=throughput.gap_verdict(gap, 1e3 * step["ms"], graphs=graphs))


SUSPECT_NOTE = " (SUSPECT: trace saw under half the step)"


def throughput_rows(m, c, spec, compiled_loop, deadline, rec, variant=""):
  """Throughput vs context with the compiled loop. Returns False on timeout (not on an error).
  variant: the A/B loop's suffix (`ab_variant`; rows say so, and carry no host-gap rows)."""
  tcfg, tp, dcfg, dp, dtype = m
  run = lambda pair, st, until: compiled_loop(pair, st, jnp.int32(until))
  cmdbuf = ab_variant()[2] if variant else runtime.command_buffers_on()
  out, secs, status = deadline.box(lambda: throughput.time_contexts(
      Pair(tcfg, tp, dcfg, dp), spec, list(c.bench.ctxs), dtype, gen=c.bench.gen, run=run,
      graphs=cmdbuf))
  label = spec.mode + variant
  for r in out or []:
    rec.add("throughput", **r, command_buffers=cmdbuf, ab_variant=bool(variant), variant=variant)
    trace = "op-by-op trace (not the graph): " if r["graphs"] else ""
    print(f"ctx={r['ctx']:>7} {label:>6}: {r['ms_per_step']:8.3f} ms/step "
          f"{r['accepted_per_step']:5.2f} tok/step {r['tokens_per_s']:9.1f} tok/s "
          f"{trace}device-busy {_num(r['kernel_us'])} us, kernels summed "
          f"{_num(r['kernel_sum_us'])} us, {_num(r['kernels_per_step'])} kernels, "
          f"gap {_gap(r)} us/step{SUSPECT_NOTE if r['gap_suspect'] else ''} "
          f"{r['gap_warning']}\n  walls (ms): warm-up {_ms(r['wall_warm_ms'])}, "
          f"2 steps {_ms(r['wall_short_ms'])}, {r['steps_timed']} steps {_ms(r['wall_long_ms'])}; "
          f"{r['timing']}; tokens emitted per step {r['emitted_per_step']:.2f}", flush=True)
  if out and out[0]["gap_method"]:
    print(f"  gap = {out[0]['gap_method']}", flush=True)
  if status != "ok":
    rec.add("throughput", mode=spec.mode, budget=_budget(spec), status=status, seconds=secs)
    print(f"throughput {spec.mode}: {status}", flush=True)
  return status != "timeout"


def paired_ab(m, c, mode, compiled, variant, deadline, rec):
  """`mode`'s default loop and its A/B loop (`compiled`, in that order) timed interleaved at the
  profile context (`throughput.paired_slopes`: PAIRED_ROUNDS rounds, the order reversed every
  other round): the A/B's decision row. Returns False on timeout."""
  ctx = min(c.bench.profile_ctx, max(c.bench.ctxs))
  steps = throughput.loop_state_steps(c.bench.gen)

  def entry(pm, spec, exe):
    tcfg, tp, dcfg, dp, dtype = pm
    st = at_context(bench_state(tcfg, dcfg, spec, 1, max(c.bench.ctxs), dtype, steps=steps),
                    spec, ctx)
    return (lambda pair, s, until: exe(pair, s, jnp.int32(until)), Pair(tcfg, tp, dcfg, dp), st)

  timed = {mode: entry(m, bench_spec(c, mode), compiled[0]),
           mode + variant: entry(ab_model(m), ab_spec(c, mode), compiled[1])}
  slopes, secs, status = deadline.box(lambda: throughput.paired_slopes(timed, c.bench.gen))
  if status != "ok":
    rec.add("paired_ab", mode=mode, budget=_budget(bench_spec(c, mode)), variant=variant,
            status=status, seconds=secs)
    print(f"paired A/B {mode}: {status}", flush=True)
    return status != "timeout"
  s = throughput.paired_summary(slopes[mode], slopes[mode + variant])
  row = rec.add("paired_ab", mode=mode, budget=_budget(bench_spec(c, mode)), variant=variant,
                ctx=ctx, gen=c.bench.gen, seconds=secs, base_slopes_ms=slopes[mode],
                variant_slopes_ms=slopes[mode + variant], **s)
  print(f"{PAIRED_HEAD}\n{format_paired(row)}", flush=True)
  return True


def format_paired(r):
  """One paired A/B row as a line: medians, the median ratio and its range over the rounds."""
  return (f"  {r['mode']:>6} {str(r['budget']):>4} {r['ctx']:>7} {r['base_ms']:9.3f} "
          f"{r['variant_ms']:9.3f} {r['ratio']:7.4f} [{r['ratio_min']:.4f}, "
          f"{r['ratio_max']:.4f}] {r['variant'] or '-'} faster in {r['variant_faster']} of "
          f"{r['rounds']} rounds"
          + (f"; {r['stalled']} stalled (a slope off its median by > "
             f"{throughput.STALL_FACTOR}x: read the median)" if r.get("stalled") else ""))


PAIRED_HEAD = ("paired A/B (interleaved rounds, order reversed every other round; ms/step "
               "medians): mode budget ctx base_ms ab_ms ab/base [min, max] sign count")


def summary(rows) -> str:
  """The short table: compile times, the first two phase tables, throughput, other budgets."""
  out = ["", "==== summary (bench_k26_full) ====", "compile (s): mode budget part seconds status"]
  for r in (r for r in rows if r["kind"] == "compile"):
    out.append(f"  {r['mode']:>6} {str(r['budget']):>4} {r['part']:>7} {r['seconds']:8.1f} "
               f"{r['status']} (XLA compiles {r.get('xla_compiles', '-')}, "
               f"cache hits {r.get('cache_hits', '-')})")
  tables = [r for r in rows if r["kind"] == "phases" and r["rows"]]
  for t in tables[:2]:
    out.append(f"phases {t['mode']} budget={t['budget']} ctx={t['ctx']}: phase ms floor %floor")
    for p in t["rows"]:
      out.append(f"  {p['phase']:<12}{p['ms']:9.3f}{p['floor_ms']:9.3f}{p['pct_roofline']:7.1f}")
  out.append("throughput: ctx mode budget ms/step tok/step tok/s busy_us gap_us "
             "(gap = loop ms/step - device-busy per step, jax.profiler trace; n/a for a graph "
             "loop: the profiler runs it op by op; _cmdbuf = with command buffers, _nograph = "
             "without, _opts = with --ab_loop_options)")
  for r in (r for r in rows if r["kind"] == "throughput" and "ctx" in r):
    mode = r["mode"] + (_suffix(r) if r.get("ab_variant") else "")
    busy = f"{throughput.GRAPH_GAP_NA:>9}" if r.get("graphs") else _num(r["kernel_us"])
    out.append(f"  {r['ctx']:>7} {mode:>6} {str(r['budget']):>4} {r['ms_per_step']:9.3f} "
               f"{r['accepted_per_step']:5.2f} {r['tokens_per_s']:9.1f} {busy} "
               f"{_gap(r)}{' SUSPECT' if r.get('gap_suspect') else ''} "
               f"{r.get('gap_warning', '')}")
  out.append("host gap = loop ms/step - the step's no-graph CUPTI kernel sum: mode budget ctx "
             "loop_ms kernel_ms gap_us (a graph loop: '<= 0: no host gap visible')")
  for r in (r for r in rows if r["kind"] == "host_gap"):
    out.append(f"  {r['mode']:>6} {str(r['budget']):>4} {r['ctx']:>7} {r['loop_ms']:9.3f} "
               f"{r['kernel_ms']:9.3f} {r['host_gap_us']:9.1f} {r.get('warning', '')}")
  paired = [r for r in rows if r["kind"] == "paired_ab" and "ratio" in r]
  if paired:
    out.append(PAIRED_HEAD)
    out += [format_paired(r) for r in paired]
  out.append("fused step per table: mode budget step_ms floor_ms %floor")
  for t in tables:
    step = next(p for p in t["rows"] if p["phase"] == "step")
    out.append(f"  {t['mode']:>6} {str(t['budget']):>4} {step['ms']:9.3f} {step['floor_ms']:9.3f} "
               f"{step['pct_roofline']:7.1f}")
  for r in (r for r in rows if r.get("status", "ok") != "ok"):
    out.append(f"NOT DONE: {r['kind']} {r.get('mode')} {r.get('budget')} {r.get('part', '')}: "
               f"{r['status']}")
  for r in (r for r in rows if r["kind"] == "command_buffers"):
    out.append(profiling_hlo.format_command_buffers(r, f"{r['mode']} loop"))
  for r in (r for r in rows if r["kind"] == "thunks"):
    out.append(profiling_hlo.format_thunk_report(r, f"{r['label']} loop") if r["found"]
               else f"thunk report {r['label']}: {NO_THUNK_DUMP}")
  return "\n".join(out)


def _num(x):
  return "-" if x is None else f"{x:9.1f}"



def _gap(row):
  """The trace-based gap of a throughput row: n/a for a graph loop (no number to misread)."""
  return f"{throughput.GRAPH_GAP_NA:>9}" if row.get("graphs") else _num(row["host_gap_us"])


def _ms(xs):
  return "/".join(f"{x:.1f}" for x in xs)


def _suffix(row):
  return row.get("variant") or ("_cmdbuf" if row.get("command_buffers") else "_nograph")


def run_parts(m, c, deadline, rec):
  """The parts in order (see the module docstring); a measurement that runs out of time ends
  the run (its abandoned thread may still be using the GPU)."""
  modes = [x for x in ("ar", "ddtree") if x in c.bench.modes]
  modes += [x for x in c.bench.modes if x not in modes]
  loops = compile_modes(m, c, [bench_spec(c, mode) for mode in modes], deadline, rec)
  if _COMPILE_ONLY.value:
    return
  for mode in modes:
    graph_report(mode, loops[mode], rec)
  # The phase tables (Mosaic's CUPTI hook) before the throughput traces (jax.profiler's): after
  # a jax.profiler trace, the next Mosaic CUPTI trace aborted the process ("activity records
  # were dropped", H200, 2026-12-01); the other order ran in the third session.
  ceil = roofline.measure_ceilings(small=jax.default_backend() == "cpu")
  rec.add("ceilings", **ceil)
  budgets = list(c.bench.profile_budgets)
  tables = c.bench.get("phase_modes", "ar,ddtree").split(",")  # a string: --config overrides it
  for spec in (bench_spec(c, "ar"), bench_spec(c, "ddtree", budgets[0])):
    if spec.mode in tables and not phase_table(m, c, spec, ceil, deadline, rec):
      return
  for mode in modes:  # cheap once compiled: seconds per mode
    if loops[mode] is not None and not throughput_rows(m, c, bench_spec(c, mode), loops[mode],
                                                       deadline, rec):
      return
  host_gaps(c, rec)  # before the A/B loops: a graph run that crashes leaves these rows written
  suffix = ab_variant()[0]
  for mode in (x for x in modes if loops.get(x + suffix) is not None):
    if not throughput_rows(ab_model(m), c, ab_spec(c, mode), loops[mode + suffix], deadline, rec,
                           variant=suffix):
      return
  for mode in (x for x in modes if loops.get(x + suffix) is not None):
    if not paired_ab(m, c, mode, (loops[mode], loops[mode + suffix]), suffix, deadline, rec):
      return
  for b in budgets[1:] if "ddtree" in tables else ():  # without the attention / moe split
    if not phase_table(m, c, bench_spec(c, "ddtree", b), ceil, deadline, rec, parts=False):
      return


def main(_):
  c = _CONFIG.value
  try:  # a misspelt or removed --ab_loop_options field fails here, before any weights load
    timing.check_compiler_options(ab_variant()[1])
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  deadline = timing.Deadline(_BUDGET_S.value)
  rec = Recorder(_OUT.value)
  dtype = DTYPES[c.dtype]
  with timing.CompileCounter() as cc:
    tcfg, tp, dcfg, dp = load_bench_pair(c, dtype, abstract=_COMPILE_ONLY.value)
  rec.add("setup", device=jax.devices()[0].device_kind, layers=tcfg.num_hidden_layers,
          runtime=str(runtime.applied()), load_s=_BUDGET_S.value - deadline.left(),
          target=dataclasses.asdict(tcfg), draft=dataclasses.asdict(dcfg),
          bench=c.bench.to_dict(), **cc.as_dict())  # what ran, whatever the defaults become
  print(f"device={jax.devices()[0].device_kind} layers={tcfg.num_hidden_layers} "
        f"loaded in {_BUDGET_S.value - deadline.left():.1f} s; {runtime.applied()}", flush=True)
  run_parts((tcfg, tp, dcfg, dp, dtype), c, deadline, rec)
  print(summary(rec.rows), flush=True)
  print(f"results: {rec.path}", flush=True)
  rec.file.close()
  sys.stdout.flush()
  os._exit(0)  # abandoned (timed-out) compiles may still run in worker threads


if __name__ == "__main__":
  app.run(main)
