"""Decode throughput vs context: the program `generate` and `Stream` run (`loop.steps_device`,
state donated), compiled once per (config, spec); contexts are data.

Per context: ms per step = slope of loop wall time over two chunk lengths (the per-dispatch cost
cancels), tokens per step measured from the loop, GPU kernel time per step (CUPTI over a chunk)
and the host gap = wall - kernel per step (time the GPU idles inside the loop).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import forced_accept, timing
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


def measure_context(run, pair, st, gen):
  """{ms_per_step, timing, accepted_per_step, kernel_us, host_gap_us} from `st` (consumed)."""
  st, _ = _run(run, pair, st, 2)                        # warm: compile, record command buffers
  first = int(st.steps)
  st, t_short = _run(run, pair, st, 2)
  st, t_long = _run(run, pair, st, 2 + gen)
  ms, how = 1e3 * (t_long - t_short) / gen, "slope"
  if ms <= 0:  # timing noise swamped the slope (tiny CPU runs): whole chunk per step
    ms, how = 1e3 * t_long / (2 + gen), "total"
  acc = np.asarray(jax.device_get(st.accepted))[first:int(st.steps)]
  chunk = lambda a, out: (a[0], out, int(out.steps) + gen)
  kern, _ = timing.kernel_ms(run, (pair, st, int(st.steps) + gen), chunk, iters=1)
  kernel_us = None if kern is None else 1e3 * kern / gen
  return dict(ms_per_step=ms, timing=how, accepted_per_step=float(acc.mean()),
              kernel_us=kernel_us, host_gap_us=None if kern is None else 1e3 * ms - kernel_us)


def loop_state_steps(gen: int) -> int:
  """Committed-row room a throughput state needs: warm-up, two timed chunks, a CUPTI chunk."""
  return 4 * gen + 16


def time_contexts(pair, spec, ctxs, dtype, batch=1, gen=16, run=None):
  """One compiled device loop for `spec` (`run`, e.g. a compiled `loop_program`, or jitted
  here); one row per context (see the module docstring)."""
  tcfg, dcfg = pair.tcfg, pair.dcfg
  run = run or loop_program(spec)
  rows = []
  for ctx in ctxs:  # one state shape (sized for the longest context): one compiled loop
    big = bench_state(tcfg, dcfg, spec, batch, max(ctxs), dtype, steps=loop_state_steps(gen))
    m = measure_context(run, pair, at_context(big, spec, ctx), gen)
    del big
    rows.append(dict(mode=spec.mode, budget=spec.budget if spec.mode == "ddtree" else None,
                     block_size=spec.block_size if spec.mode != "ar" else None, ctx=ctx,
                     batch=batch, attn_backend=spec.attn_backend,
                     forced_accept=forced_accept.forced_count(spec), verify_width=spec.verify_width, **m,
                     tokens_per_s=1e3 * m["accepted_per_step"] * batch / m["ms_per_step"],
                     layers=tcfg.num_hidden_layers, device=jax.devices()[0].device_kind))
  return rows
