"""throughput.measure_wall: per-step time divides by the steps the loop actually ran, and one-off
costs of single calls (XLA recording a command buffer on an executable's second run) stay out of
the slope; gap_verdict flags a host-launched loop faster than its kernels, and says what a graph
loop under its no-graph kernels is instead (no error)."""
import collections
import types

import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import throughput

State = collections.namedtuple("State", "steps accepted n_out")
STEP_S = 0.004
WARM = throughput.WARM_CALLS * 2  # steps the warm-up calls run


@pytest.fixture(autouse=True)
def clock(monkeypatch):
  """measure_wall's clock, advanced only by the fake loops (no sleeps: exact, not flaky)."""
  now = types.SimpleNamespace(t=0.0)
  monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=lambda: now.t))
  return now


def fake_loop(clock, cap, tokens_per_step=1, once=None):
  """A 'device loop' that takes STEP_S per step, emits `tokens_per_step` tokens per step and
  stops at step `cap` (every row done). once: {call index: extra seconds} for single calls."""
  calls = []

  def run(_, st, until):
    start, end = int(st.steps), min(int(until), cap)
    clock.t += STEP_S * max(0, end - start) + (once or {}).get(len(calls), 0.0)
    calls.append(end - start)
    n_out = st.n_out + tokens_per_step * max(0, end - start)
    return State(jnp.int32(end), st.accepted, n_out)
  return run


def _state(accepted=1):
  return State(jnp.int32(0), jnp.full((256,), accepted, jnp.int32), jnp.ones((1,), jnp.int32))


def test_full_chunks_time_per_step(clock):
  _, m = throughput.measure_wall(fake_loop(clock, cap=10**6, tokens_per_step=2), None,
                                 _state(2), gen=8)
  assert m["steps_timed"] == 10 and m["timing"].startswith("slope")
  np.testing.assert_allclose(m["ms_per_step"], 1e3 * STEP_S, rtol=1e-9)
  assert m["accepted_per_step"] == 2.0 and m["emitted_per_step"] == 2.0
  assert len(m["wall_long_ms"]) == throughput.WALL_ROUNDS


def test_graph_recording_on_the_second_call_stays_out_of_the_slope(clock):
  """XLA runs a command buffer op by op on an executable's first call and records its CUDA graph
  on the second: a one-off cost of the second call. With one warm-up call it landed in the short
  chunk (here 40 ms over gen = 16 steps: the slope read 1.5 ms for a 4 ms step; on the H200 the
  ar loop read 2.77 ms per step against 6.5 ms of kernels per step)."""
  run = fake_loop(clock, cap=10**6, once={1: 0.040})
  _, m = throughput.measure_wall(run, None, _state(), gen=16)
  np.testing.assert_allclose(m["ms_per_step"], 1e3 * STEP_S, rtol=1e-9)


def test_a_slow_call_among_the_timed_ones_stays_out_of_the_slope(clock):
  """A one-off stall (GC, a graph update) in one timed short call: the fastest of the rounds."""
  run = fake_loop(clock, cap=10**6, once={throughput.WARM_CALLS + 2: 0.040})
  _, m = throughput.measure_wall(run, None, _state(), gen=16)
  np.testing.assert_allclose(m["ms_per_step"], 1e3 * STEP_S, rtol=1e-9)


def test_early_stop_divides_by_steps_run(clock):
  """The loop stops 3 steps into the first long chunk: the slope uses 3 - 2 steps, not gen, and
  the row says so (dividing by the asked steps read ~1/8 of the true time here)."""
  _, m = throughput.measure_wall(fake_loop(clock, cap=WARM + 2 + 3), None, _state(), gen=8)
  assert m["steps_timed"] == 3 and "stopped after 3 of 10" in m["timing"]
  np.testing.assert_allclose(m["ms_per_step"], 1e3 * STEP_S, rtol=1e-9)


def test_loop_already_done_raises(clock):
  with pytest.raises(RuntimeError, match="stopped early"):
    throughput.measure_wall(fake_loop(clock, cap=WARM + 1), None, _state(), gen=8)


def test_gap_verdict_flags_a_loop_faster_than_its_kernels():
  # the H200 ar row: 2.768 ms per step against 6498 us of kernels per step
  assert "IMPOSSIBLE" in throughput.gap_verdict(2768.0 - 6498.1, 6498.1)
  assert throughput.gap_verdict(-40.0, 6498.1) == ""   # within noise
  assert throughput.gap_verdict(251.8, 12769.9) == ""  # a real host gap
  assert throughput.gap_verdict(None, None) == ""


# The H200 run s9_k26_core (2026-12-01, 61 layers at 46k, command buffers on: the whole loop one
# CUDA graph) against the same step's CUPTI kernel sum compiled without graphs (step_nograph).
AR_GRAPH = dict(loop_us=5239.0, kernels_us=5355.0)
DDTREE_GRAPH = dict(loop_us=9826.0, kernels_us=10312.0)


def _gap(row):
  return row["loop_us"] - row["kernels_us"], row["kernels_us"]


def test_gap_verdict_host_launched_loop_under_its_kernels_stays_impossible():
  assert "IMPOSSIBLE: loop 486 us/step" in throughput.gap_verdict(*_gap(DDTREE_GRAPH))


def test_gap_verdict_graph_loop_under_its_no_graph_kernels_is_no_error():
  """Graph loop 486 us/step under the no-graph kernel sum (beyond noise: 3% of 10.3 ms is 309
  us): PDL overlap and launch savings inside the graph, not a measurement error."""
  note = throughput.gap_verdict(*_gap(DDTREE_GRAPH), graphs=True)
  assert "IMPOSSIBLE" not in note
  assert note.startswith("graph loop 486 us/step under the no-graph kernel sum")
  assert "no host gap visible" in note and "not separable" in note


def test_gap_verdict_graph_loop_within_noise_and_over():
  ar = throughput.gap_verdict(*_gap(AR_GRAPH), graphs=True)  # -116 us, noise 161 us
  assert ar.startswith("graph loop 116 us/step within noise of") and "no host gap visible" in ar
  over = throughput.gap_verdict(500.0, 10312.0, graphs=True)  # beyond the 309 us of noise
  assert over.startswith("graph loop 500 us/step over") and "at most that much host gap" in over
  assert throughput.gap_verdict(None, None, graphs=True) == ""


def test_trace_gap_of_a_graph_loop_is_not_a_number():
  """The trace of a graph loop ran op by op (XLA turns graphs off while profiling): no gap, no
  SUSPECT flag, the method says n/a; a host-launched loop keeps its gap and flag (the s9
  ddtree trace saw 1283.5 us of a 9.826 ms step)."""
  graph = throughput.trace_gap(1283.5, 9.826, graphs=True)
  assert graph["host_gap_us"] is None and graph["gap_suspect"] is None
  assert graph["gap_method"].startswith("n/a (graph)") and graph["gap_warning"] == ""
  plain = throughput.trace_gap(1283.5, 9.826, graphs=False)
  np.testing.assert_allclose(plain["host_gap_us"], 9826.0 - 1283.5)
  assert plain["gap_suspect"] and plain["gap_warning"] == ""


def drifting_loop(clock, name, log, step_s, drift):
  """A fake loop whose steps take step_s * (1 + drift * (calls so far by every loop)): a machine
  slowing down over the run. Appends its name to `log` per call."""
  def run(_, st, until):
    start, end = int(st.steps), int(until)
    clock.t += step_s * (1 + drift * len(log)) * (end - start)
    log.append(name)
    return State(jnp.int32(end), st.accepted, st.n_out)
  return run


def test_paired_slopes_alternate_the_order_every_round(clock):
  log = []
  loops = {k: (drifting_loop(clock, k, log, STEP_S, 0.0), None, _state()) for k in "AB"}
  slopes = throughput.paired_slopes(loops, gen=8, rounds=4)
  warm = ["A"] * throughput.WARM_CALLS + ["B"] * throughput.WARM_CALLS
  assert log == warm + ["A", "A", "B", "B", "B", "B", "A", "A"] * 2  # (short, long) per turn
  for k in "AB":
    np.testing.assert_allclose(slopes[k], [1e3 * STEP_S] * 4, rtol=1e-9)


def test_paired_ab_of_one_loop_on_a_drifting_machine_reads_no_difference(clock):
  """Two identical loops while every call is 1% slower than the one before: a sequential A/B
  (all of A, then all of B) reads B 16% slower; interleaved, the rounds' ratios straddle 1 and
  the sign count is even (4 of 8)."""
  log = []
  loops = {k: (drifting_loop(clock, k, log, STEP_S, 0.01), None, _state()) for k in "AB"}
  s = throughput.paired_summary(*throughput.paired_slopes(loops, gen=8, rounds=8).values())
  assert s["rounds"] == 8 and s["variant_faster"] == 4
  assert s["ratio_min"] < 1 < s["ratio_max"] and abs(s["ratio"] - 1) < 0.01
  seq = []
  a = throughput.paired_slopes({"A": (drifting_loop(clock, "A", seq, STEP_S, 0.01), None,
                                      _state())}, gen=8, rounds=8)["A"]
  b = throughput.paired_slopes({"B": (drifting_loop(clock, "B", seq, STEP_S, 0.01), None,
                                      _state())}, gen=8, rounds=8)["B"]
  assert np.median(b) / np.median(a) > 1.15


def test_paired_ab_sees_a_two_percent_faster_variant_in_every_round(clock):
  log = []
  loops = {"A": (drifting_loop(clock, "A", log, STEP_S, 0.001), None, _state()),
           "B": (drifting_loop(clock, "B", log, 0.98 * STEP_S, 0.001), None, _state())}
  s = throughput.paired_summary(*throughput.paired_slopes(loops, gen=8).values())
  assert s["variant_faster"] == s["rounds"] == throughput.PAIRED_ROUNDS
  np.testing.assert_allclose(s["ratio"], 0.98, atol=0.003)


def test_paired_slopes_of_a_loop_that_stops_early_raise(clock):
  loops = {"A": (fake_loop(clock, cap=WARM + 2 + 3), None, _state())}
  with pytest.raises(RuntimeError, match="'A' stopped early in round 0"):
    throughput.paired_slopes(loops, gen=8)


def test_paired_summary_medians_and_sign_count():
  s = throughput.paired_summary([10.0, 12.0, 11.0, 13.0], [9.0, 12.6, 10.45, 13.0])
  # medians of each loop's rounds: (11 + 12) / 2 and (10.45 + 12.6) / 2
  np.testing.assert_allclose([s["base_ms"], s["variant_ms"]], [11.5, 11.525])
  # ratios 0.9, 1.05, 0.95, 1.0: median 0.975, range [0.9, 1.05], 2 rounds under the base
  np.testing.assert_allclose([s["ratio"], s["ratio_min"], s["ratio_max"]], [0.975, 0.9, 1.05])
  assert s["variant_faster"] == 2 and s["rounds"] == 4
  assert s["stalled"] == 1  # the variant's 9.0 is 11.525 / 9.0 = 1.28x under its median
  with pytest.raises(ValueError, match="3 and 2 rounds"):
    throughput.paired_summary([1.0, 2.0, 3.0], [1.0, 2.0])


def test_paired_summary_counts_a_stalled_round_and_keeps_the_median():
  """s25's k26_tree rows (H100): round 0 read 10.62 / 4.96 ms, a stall between the chunks of
  the two loops' pairs; the other rounds sit within 6% of their medians."""
  base = [10.616, 5.975, 6.146, 6.167, 6.246, 6.323, 6.324, 6.479]
  var = [4.958, 6.165, 6.165, 6.227, 6.245, 6.414, 6.502, 6.682]
  s = throughput.paired_summary(base, var)
  assert s["stalled"] == 1
  assert s["ratio_min"] < 0.5 and 1.0 < s["ratio"] < 1.02
  clean = throughput.paired_summary(base[1:], var[1:])
  assert clean["stalled"] == 0 and abs(clean["ratio"] - s["ratio"]) < 0.01
