"""throughput.measure_wall: per-step time divides by the steps the loop actually ran, and one-off
costs of single calls (XLA recording a command buffer on an executable's second run) stay out of
the slope; gap_verdict flags a loop faster than its kernels."""
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
