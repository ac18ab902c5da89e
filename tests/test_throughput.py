"""throughput.measure_wall: per-step time divides by the steps the loop actually ran."""
import collections
import time

import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import throughput

State = collections.namedtuple("State", "steps accepted")
STEP_S = 0.004


def fake_loop(cap):
  """A 'device loop' that sleeps STEP_S per step and stops at step `cap` (every row done)."""
  def run(_, st, until):
    start, end = int(st.steps), min(int(until), cap)
    time.sleep(STEP_S * max(0, end - start))
    return State(jnp.int32(end), st.accepted)
  return run


def test_full_chunks_time_per_step():
  st = State(jnp.int32(0), jnp.full((64,), 2, jnp.int32))
  _, m = throughput.measure_wall(fake_loop(cap=10**6), None, st, gen=8)
  assert m["steps_timed"] == 10 and m["timing"] == "slope"
  np.testing.assert_allclose(m["ms_per_step"], 1e3 * STEP_S, rtol=0.5)
  assert m["accepted_per_step"] == 2.0


def test_early_stop_divides_by_steps_run():
  """The loop stops 3 steps into the long chunk: the slope uses 3 - 2 steps, not gen, and the
  row says so (dividing by the asked steps read ~1/8 of the true time here)."""
  st = State(jnp.int32(0), jnp.ones((64,), jnp.int32))
  _, m = throughput.measure_wall(fake_loop(cap=2 + 2 + 3), None, st, gen=8)
  assert m["steps_timed"] == 3 and "stopped after 3 of 10" in m["timing"]
  assert m["ms_per_step"] > 0.5e3 * STEP_S


def test_loop_already_done_raises():
  st = State(jnp.int32(0), jnp.ones((64,), jnp.int32))
  with pytest.raises(RuntimeError, match="stopped early"):
    throughput.measure_wall(fake_loop(cap=3), None, st, gen=8)
