"""Decode throughput vs context: the program `generate` and `Stream` run (`loop.steps_device`,
state donated), compiled once per (config, spec); contexts are data.

Per context: WARM_CALLS untimed chunks (XLA records a command buffer's CUDA graph on its
second execution, not its first), then ms per step = slope of loop wall time over two chunk
lengths (2 and 2 + gen steps: the per-dispatch cost cancels), the fastest of WALL_ROUNDS calls
of each length; tokens per step measured from the loop (and tokens emitted per step counted
from the output buffer's fill, independently). Then, once every context's wall time is taken
(a trace may slow an executable's later runs, see `timing`), a jax.profiler trace of one chunk
of min(gen, TRACE_STEPS) steps per context: `kernel_us` = device-busy time per step (the union
of the kernels' [start, end) intervals, so overlapping kernels count once), `kernel_sum_us`
(durations summed), `kernels_per_step`, and the host gap `host_gap_us` = ms per step -
device-busy per step: the time per step the GPU idles inside the device loop (`gap_method` says
so in every row). A trace that misses kernels (device-busy under half the step) is flagged
`gap_suspect`; a gap negative beyond noise (a loop faster than its own kernels) is a
measurement error and says so in `gap_warning` (`gap_verdict`).

A loop run as a CUDA graph (`graphs`: command buffers on) has no trace-based gap: XLA runs a
command buffer op by op while a profiler session is active, so the trace times another program
(`host_gap_us` None, `gap_method` says n/a). Against kernel time measured without graphs, a graph
loop may be legitimately faster: XLA launches its fusions with programmatic dependent launch
(PDL, Hopper+; a graph gets programmatic edges), so a kernel's start overlaps its predecessor's
tail and the no-graph kernels' summed durations count the overlap twice; graph nodes also skip
the per-launch work of stream launches. `gap_verdict(..., graphs=True)` says so instead of
IMPOSSIBLE (notes/runtime.md, "Loop vs kernels under one graph").
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import forced_accept, runtime, timing
from kdtree_jax.bench_state import at_context, bench_state
from kdtree_jax.decoding import loop, step


def while_steps_fn(spec):
  """jit(pair, state, n): n steps in a lax.while_loop, nothing donated (the HLO audit's
  program: the loop body `generate` runs)."""
  def run(pair, st, n):
    return jax.lax.while_loop(lambda s: s.steps < n,
                              lambda s: step.speculative_step(pair, spec, s), st)
  return jax.jit(run)


def loop_program(spec):
  """(pair, state, until) -> state: `loop.steps_device`, the donated device loop."""
  return lambda pair, st, until: loop.steps_device(pair, st, jnp.int32(until), spec=spec)


def _run(run, pair, st, n):
  """(state after n more steps, wall seconds), waiting for the device."""
  t0 = time.perf_counter()
  st = run(pair, st, int(st.steps) + n)
  jax.block_until_ready(st)
  return st, time.perf_counter() - t0


TRACE_STEPS = 8  # steps per traced chunk: per-step busy time is stable; fewer events to parse
GAP_METHOD = ("loop wall slope per step (command buffers as compiled) - device-busy per step "
              f"(union of kernel intervals, jax.profiler trace of a {TRACE_STEPS}-step chunk; "
              "XLA runs command buffers op by op while a profiler session is active, so this "
              "is the op-by-op kernels' time)")
# Untimed calls before the timed ones. XLA's CommandBufferThunk runs its FIRST execution op by op
# (a warm-up) and records + instantiates the CUDA graph on the SECOND (openxla
# command_buffer_thunk.cc): with one warm-up call the graph recording fell into the short
# chunk's time and the slope read low (ar at 46k, H200: 2.77 ms per step against 6.5 ms of
# kernels per step).
WARM_CALLS = 2
WALL_ROUNDS = 3  # (short, long) chunk pairs timed; the fastest of each length is kept


def _timed_chunks(run, pair, st, gen):
  """(state, [(t_short, n_short, t_long, n_long, tokens_long)] per full round, the first
  round that stopped early or None, the warm-up calls' seconds) after WARM_CALLS warm-up chunks
  of 2 steps. n = steps the loop ran (its counter); tokens = tokens the long chunk emitted
  (out's fill, an independent count). Stops at the first round whose long chunk ran fewer
  steps than asked."""
  st, warm = _warm_up(run, pair, st)
  full, partial = [], None
  for _ in range(WALL_ROUNDS):
    st, chunk = _chunk_pair(run, pair, st, gen)
    if chunk[1] < 2 or chunk[3] < 2 + gen:
      partial = chunk
      break
    full.append(chunk)
  return st, full, partial, warm


def _warm_up(run, pair, st):
  """(state, seconds of each call) after WARM_CALLS untimed chunks of 2 steps."""
  warm = []
  for _ in range(WARM_CALLS):
    st, t = _run(run, pair, st, 2)
    warm.append(t)
  return st, warm


def _chunk_pair(run, pair, st, gen):
  """(state, (t_short, n_short, t_long, n_long, tokens_long)): one timed chunk of 2 steps, then
  one of 2 + gen; n = steps the loop ran (its counter), tokens = tokens the long chunk emitted
  (out's fill, an independent count)."""
  s0 = int(st.steps)
  st, t_short = _run(run, pair, st, 2)
  s1, out1 = int(st.steps), np.asarray(jax.device_get(st.n_out))
  st, t_long = _run(run, pair, st, 2 + gen)
  tokens = int((np.asarray(jax.device_get(st.n_out)) - out1).sum())
  return st, (t_short, s1 - s0, t_long, int(st.steps) - s1, tokens)


def measure_wall(run, pair, st, gen):
  """(state after the timed chunks, {ms_per_step, timing, accepted_per_step, steps_timed,
  emitted_per_step, wall_warm_ms, wall_short_ms, wall_long_ms}) from `st` (consumed). No trace: wall time
  only. WARM_CALLS untimed chunks, then WALL_ROUNDS pairs of chunks of 2 and 2 + gen steps:
  ms per step = (fastest long - fastest short) / gen, so a one-off cost in any one call (graph
  recording or update, a GC pause) does not move the slope. The slope divides by the steps
  the loop actually ran: the loop stops early when every row is done (an EOS of random weights,
  max_new_tokens); then only the rounds before it count (or that round alone)."""
  start = int(st.steps)
  st, full, partial, warm = _timed_chunks(run, pair, st, gen)
  rounds = full or ([partial] if partial and partial[3] > partial[1] else [])
  if not rounds:
    raise RuntimeError(f"the loop stopped early (every row done) in its first timed round "
                       f"(ran {partial[1] if partial else 0} then {partial[3] if partial else 0} "
                       f"steps, asked 2 then {2 + gen}); nothing to time")
  t_short, n_short = min(r[0] for r in rounds), rounds[0][1]
  t_long, n_long = min(r[2] for r in rounds), rounds[0][3]
  ms, how = 1e3 * (t_long - t_short) / (n_long - n_short), f"slope, fastest of {len(rounds)}"
  if ms <= 0:  # timing noise swamped the slope (tiny CPU runs): whole chunk per step
    ms, how = 1e3 * t_long / n_long, "total"
  if not full:
    how += f" (loop stopped after {n_long} of {2 + gen} steps)"
  first = start + 2 * WARM_CALLS
  acc = np.asarray(jax.device_get(st.accepted))[first:int(st.steps)]
  return st, dict(ms_per_step=ms, timing=how, accepted_per_step=float(acc.mean()),
                  steps_timed=n_long, emitted_per_step=rounds[0][4] / n_long,
                  wall_warm_ms=[1e3 * t for t in warm],
                  wall_short_ms=[1e3 * r[0] for r in rounds],
                  wall_long_ms=[1e3 * r[2] for r in rounds])


GAP_NOISE_US, GAP_NOISE_FRAC = 50.0, 0.03  # |gap| below max(50 us, 3% of the step): noise


def gap_verdict(host_gap_us, step_us, graphs=False):
  """'' for a plausible host gap of a host-launched loop, else a warning: such a loop cannot run
  a step faster than the kernels of that step (a gap negative beyond noise is a measurement
  error). graphs: the loop ran as one CUDA graph and `host_gap_us` = loop - the step's kernel
  time measured WITHOUT graphs: `graph_gap_note` (never IMPOSSIBLE)."""
  if host_gap_us is None:
    return ""
  if graphs:
    return graph_gap_note(host_gap_us, step_us)
  if host_gap_us >= -_noise_us(step_us):
    return ""
  return (f"IMPOSSIBLE: loop {-host_gap_us:.0f} us/step faster than its kernels "
          "(a measurement error, not a speed)")


def graph_gap_note(gap_us, step_us):
  """What `gap_us` = graph loop ms/step - no-graph kernel time per step can say: under (or
  within noise of) the kernels, no host gap is visible (the graph loop's own overlap and launch
  savings make up the difference; a host gap cannot be separated from them); over them, the
  excess bounds the host gap from above (gaps between graph nodes are in it too)."""
  if gap_us > _noise_us(step_us):
    return (f"graph loop {gap_us:.0f} us/step over the no-graph kernel sum: at most that much "
            "host gap (not separable from gaps between graph nodes)")
  where = "under" if gap_us < -_noise_us(step_us) else "within noise of"
  return (f"graph loop {abs(gap_us):.0f} us/step {where} the no-graph kernel sum: no host gap "
          "visible (PDL overlap / launch savings inside the graph; host gap not separable)")


def _noise_us(step_us):
  return max(GAP_NOISE_US, GAP_NOISE_FRAC * (step_us or 0.0))


GRAPH_GAP_NA = "n/a (graph)"
GRAPH_GAP_METHOD = (f"{GRAPH_GAP_NA}: the loop runs as a CUDA graph; XLA runs command buffers "
                    "op by op while a profiler session is active, so the trace is not the "
                    "graph's run (kernel_us etc. are that trace's; H200 traces of graph loops "
                    "saw from 9% to all of the step's kernels)")


_NO_TRACE = dict(kernel_us=None, kernel_sum_us=None, kernels_per_step=None,
                 device_span_us=None, host_gap_us=None, gap_method=None, gap_suspect=None,
                 gap_warning="")


def measure_device(run, pair, st, gen, ms_per_step, graphs=False):
  """{kernel_us, kernel_sum_us, kernels_per_step, device_span_us, host_gap_us, gap_method,
  gap_suspect, gap_warning} of a traced chunk of min(gen, TRACE_STEPS) steps from `st` (consumed); None
  values off-GPU. Per step = per step the traced chunk actually ran. graphs: `run` is a loop
  compiled with command buffers: the trace runs it op by op, so no gap (`GRAPH_GAP_METHOD`)."""
  gen = min(gen, TRACE_STEPS)
  first = int(st.steps)
  chunk = lambda a, out: (a[0], out, int(out.steps) + gen)
  error = None
  try:
    tr, st = timing.device_trace(run, (pair, st, first + gen), chunk, iters=1)
  except Exception as e:  # pylint: disable=broad-except  (the wall-time row stays)
    tr, error = None, f"{type(e).__name__}: {e}"[:300]
  if tr is None:
    return dict(_NO_TRACE, trace_error=error)
  ran = int(st[1].steps) - first - gen  # device_trace ran a warm-up chunk, then the traced one
  if ran < 1:
    return dict(_NO_TRACE,
                trace_error=f"the traced chunk ran {ran} steps (the loop stopped early)")
  busy = 1e3 * tr["busy_ms"] / ran
  trace = dict(kernel_us=busy, kernel_sum_us=1e3 * tr["kernel_sum_ms"] / ran,
               kernels_per_step=tr["kernels"] / ran, device_span_us=1e3 * tr["span_ms"] / ran)
  return dict(trace, **trace_gap(busy, ms_per_step, graphs))


def trace_gap(busy_us, ms_per_step, graphs):
  """{host_gap_us, gap_method, gap_suspect, gap_warning} from the trace's device-busy time per
  step; none for a graph loop (its trace ran op by op)."""
  if graphs:
    return dict(host_gap_us=None, gap_method=GRAPH_GAP_METHOD, gap_suspect=None, gap_warning="")
  gap = 1e3 * ms_per_step - busy_us
  return dict(host_gap_us=gap, gap_method=GAP_METHOD, gap_suspect=busy_us < 0.5e3 * ms_per_step,
              gap_warning=gap_verdict(gap, busy_us))


def measure_context(run, pair, st, gen, graphs=False):
  """measure_wall then measure_device of one context from `st` (consumed)."""
  st, m = measure_wall(run, pair, st, gen)
  return dict(m, **measure_device(run, pair, st, gen, m["ms_per_step"], graphs))


PAIRED_ROUNDS = 8  # rounds of an interleaved A/B (`paired_slopes`): 8 of 8 one way, p < 0.01


def paired_slopes(loops, gen, rounds=PAIRED_ROUNDS):
  """Interleaved wall slopes of two or more compiled loops: {label: (run, pair, state)} ->
  {label: [ms per step, one per round]}. Each loop first runs WARM_CALLS untimed chunks; then
  every round times each loop's (2, 2 + gen) chunk pair in turn, the order reversed every other
  round (A B, B A, ...), so a drift of clocks or machine over the run falls on every loop alike
  and round r's slopes are neighbours in time. A sequential A/B (every round of A, then every
  round of B, the first loop's trace pass between them) read a DDTree 64 loop 0.9% apart on an
  H100 with its fastest-of-3 walls 2.5% apart within each loop (WORKSPACE, twenty-fourth
  session).
  States are consumed; each needs room for 2 WARM_CALLS + rounds (4 + gen) steps (a state
  of `loop_state_steps(gen)` has it for PAIRED_ROUNDS)."""
  labels = list(loops)
  states = {label: _warm_up(run, pair, st)[0] for label, (run, pair, st) in loops.items()}
  slopes = {label: [] for label in labels}
  for r in range(rounds):
    for label in (labels if r % 2 == 0 else labels[::-1]):
      run, pair, _ = loops[label]
      st, (t_short, n_short, t_long, n_long, _) = _chunk_pair(run, pair, states[label], gen)
      if n_short < 2 or n_long < 2 + gen:
        raise RuntimeError(f"paired A/B: loop {label!r} stopped early in round {r} (ran "
                           f"{n_short} then {n_long} steps, asked 2 then {2 + gen}): its state "
                           f"lacks room for {2 * WARM_CALLS + rounds * (4 + gen)} steps")
      slopes[label].append(1e3 * (t_long - t_short) / (n_long - n_short))
      states[label] = st
  return slopes


# A round whose slope is this far from its loop's median (either way, as a factor) most likely
# saw a stall inside one of its chunks (not measured which): a host pause of tens of ms reads as
# a slope too high (in the long chunk) or too low (in the short one). s25 (H100, k26_tree): one
# round 10.62 / 4.96 ms against medians 6.28 / 6.24. The medians stay the decision; the range
# and the count say whether such a round sits in it.
STALL_FACTOR = 1.2


def paired_summary(base, variant):
  """{base_ms, variant_ms (medians of the rounds' slopes), ratio (median of the per-round
  variant / base ratios), ratio_min, ratio_max, variant_faster (rounds where the variant's slope
  was under the base's), rounds, stalled (rounds where either slope is off its loop's median by
  more than STALL_FACTOR)} of two `paired_slopes` lists."""
  if len(base) != len(variant) or not base:
    raise ValueError(f"paired_summary: {len(base)} and {len(variant)} rounds")
  ratios = [v / b for b, v in zip(base, variant)]
  mb, mv = float(np.median(base)), float(np.median(variant))
  off = lambda x, m: not m / STALL_FACTOR <= x <= m * STALL_FACTOR
  return dict(base_ms=mb, variant_ms=mv,
              ratio=float(np.median(ratios)), ratio_min=min(ratios), ratio_max=max(ratios),
              variant_faster=sum(v < b for b, v in zip(base, variant)), rounds=len(base),
              stalled=sum(off(b, mb) or off(v, mv) for b, v in zip(base, variant)))


def loop_state_steps(gen: int) -> int:
  """Committed-row room a throughput state needs: the wall pass's warm-up and timed chunks
  (2 WARM_CALLS + WALL_ROUNDS (4 + gen) steps), a warm-up chunk and a traced chunk (trace
  pass; a fresh state), or a `paired_slopes` pass (2 WARM_CALLS + PAIRED_ROUNDS (4 + gen))."""
  timed = 2 * WARM_CALLS + max(WALL_ROUNDS, PAIRED_ROUNDS) * (4 + gen)
  return max(timed, 2 * min(gen, TRACE_STEPS)) + 16


def time_contexts(pair, spec, ctxs, dtype, batch=1, gen=16, run=None, graphs=None):
  """One compiled device loop for `spec` (`run`, e.g. a compiled `loop_program`, or jitted
  here); one row per context (see the module docstring): every context's wall time first,
  then every context's trace (a fresh state each pass). graphs: whether the loop runs with
  command buffers (None: this process's setting, `runtime.command_buffers_on`; off-GPU always
  False: no graphs there)."""
  tcfg, dcfg = pair.tcfg, pair.dcfg
  run = run or loop_program(spec)
  if graphs is None:
    graphs = runtime.command_buffers_on()
  graphs = bool(graphs) and jax.default_backend() == "gpu"
  state = lambda ctx: at_context(bench_state(tcfg, dcfg, spec, batch, max(ctxs), dtype,
                                             steps=loop_state_steps(gen)), spec, ctx)
  walls = []
  for ctx in ctxs:  # one state shape (sized for the longest context): one compiled loop
    walls.append(measure_wall(run, pair, state(ctx), gen)[1])
  rows = []
  for ctx, m in zip(ctxs, walls):
    m = dict(m, **measure_device(run, pair, state(ctx), gen, m["ms_per_step"], graphs))
    rows.append(dict(mode=spec.mode, budget=spec.budget if spec.mode == "ddtree" else None,
                     block_size=spec.block_size if spec.mode != "ar" else None, ctx=ctx,
                     batch=batch, attn_backend=spec.attn_backend,
                     forced_accept=forced_accept.forced_count(spec),
                     verify_width=spec.verify_width, graphs=graphs, **m,
                     tokens_per_s=1e3 * m["accepted_per_step"] * batch / m["ms_per_step"],
                     layers=tcfg.num_hidden_layers, device=jax.devices()[0].device_kind))
  return rows
