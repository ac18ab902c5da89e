"""The phase profiler compiles each program once per (config, spec): a second table at another
context (data) compiles nothing; its phase programs consume (donate) the state like the step."""

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from kdtree_jax.target import config as C
from kdtree_jax import loader, profiling, timing
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.target.params import init_params
from kdtree_jax.pair import Pair
from kdtree_jax import forced_accept

CEIL = dict(copy_tbps=0.01, mm_tflops=0.1)


def _setup(mode):
  tcfg = C.tiny()
  tp = init_params(jax.random.key(0), tcfg, jnp.float32)
  ref = ml_collections.ConfigDict(dict(checkpoint="", preset="tiny", seed=1))
  dcfg, dp = loader.load_draft(ref, tcfg, jnp.float32)
  spec = SpecConfig(mode=mode, budget=6, block_size=dcfg.block_size, max_new_tokens=256,
                    target_choice=forced_accept.target_choice(2))
  return Pair(tcfg, tp, dcfg, dp), spec


@pytest.mark.slow
def test_second_context_compiles_nothing_and_state_is_donated():
  pair, spec = _setup("ddtree")
  big = profiling.bench_state(pair.tcfg, pair.dcfg, spec, 1, 96, jnp.float32)
  first = profiling.clone(profiling.at_context(big, spec, 48))
  with timing.CompileCounter() as c1:
    rows = profiling.profile_step(pair, spec, first, CEIL, reps=1)
  with timing.CompileCounter() as c2:
    profiling.profile_step(pair, spec, profiling.at_context(big, spec, 96), CEIL, reps=1)
  assert c1.compiles > 0 and c2.compiles == 0, (c1.as_dict(), c2.as_dict())
  assert {r.phase for r in rows} >= {"draft_ctx", "draft_block", "tree", "verify", "attention",
                                     "moe", "rest", "accept", "commit", "step"}
  # The fused step donated the state it was given, caches included.
  assert first.cache.latent[0].is_deleted() and first.draft_cache.k[0].is_deleted()


def test_commit_phase_bytes_only_where_rows_move():
  pair, spec = _setup("ddtree")
  tcfg, dcfg = pair.tcfg, pair.dcfg
  ddtree = profiling.phase_costs(tcfg, dcfg, spec, 1, 100)
  chain = profiling.phase_costs(tcfg, dcfg, SpecConfig(mode="chain", block_size=spec.block_size),
                                1, 100)
  width = 2 * tcfg.num_hidden_layers * spec.commit_width * tcfg.cache_dim * 2
  assert ddtree["commit"][0] == width and chain["commit"][0] == 0


def test_moe_part_sees_the_routing_of_the_step():
  """The MoE inputs the profiler captures route, layer by layer, to the experts the step's own
  verify routes to (the router's ids recorded during the step's forward), and capturing them
  leaves the verify's logits unchanged."""
  from kdtree_jax.decoding import step  # pylint: disable=import-outside-toplevel
  from kdtree_jax.target.moe import route  # pylint: disable=import-outside-toplevel
  pair, spec = _setup("ddtree")
  tcfg, tp = pair.tcfg, pair.tparams
  state = profiling.bench_state(tcfg, pair.dcfg, spec, 1, 40, jnp.float32)
  _, logits = step.draft_phase(pair.dcfg, pair.dparams, tp, spec, state)
  tree = step.tree_phase(spec, logits, 1)
  routes, xs = [], []
  ref, _, _ = step.verify_phase(tcfg, tp, spec, state, tree, (), routes=routes)
  got, _, _ = step.verify_phase(tcfg, tp, spec, state, tree, (), moe_inputs=xs)
  assert jnp.array_equal(ref, got)
  moe_layers = [lp["moe"] for lp in tp["layers"] if "moe" in lp]
  assert len(xs) == len(moe_layers) == len(routes) == tcfg.num_moe_layers > 0
  for p, x, ids in zip(moe_layers, xs, routes):
    idx, _ = route(p, tcfg, x.reshape(-1, x.shape[-1]))
    assert jnp.array_equal(jnp.sort(idx, -1), jnp.sort(ids, -1))


def test_counted_routing_counts_local_experts_and_pairs():
  tcfg = C.tiny()
  local = tcfg.num_local_experts or tcfg.n_routed_experts
  ids = jnp.array([[0, 1], [1, local], [0, local]])  # 2 local experts, 4 local pairs
  assert profiling.counted_routing(tcfg, [ids, ids[:1]]) == (2.0, 3.0)


def test_table_has_parts_on_step_routing_and_a_step_without_command_buffers():
  pair, spec = _setup("ar")
  state = profiling.bench_state(pair.tcfg, pair.dcfg, spec, 1, 48, jnp.float32)
  rows = profiling.profile_step(pair, spec, state, CEIL, reps=1, nograph_step=True)
  by = {r.phase: r for r in rows}
  assert {"attention", "moe", "rest", "step", "step_nograph"} <= set(by)
  assert by["verify"].listing == [] and profiling.format_listing(rows, "verify") == ""  # no CUPTI
  assert "on the step's own routing" in by["moe"].note
  assert "matmuls" in by["verify"].note


def test_parts_compile_without_command_buffers_when_the_process_uses_them(monkeypatch):
  """Verify's parts run their layers side by side in a CONCURRENT graph (they do not depend on
  each other), so where the runtime turns graphs on they are compiled without them."""
  pair, spec = _setup("ar")
  state = profiling.bench_state(pair.tcfg, pair.dcfg, spec, 1, 48, jnp.float32)
  seen, compile_programs = [], profiling.compile_phase_programs
  def spy(*args, **kw):
    seen.append(args[6] if len(args) > 6 else kw.get("extra_options"))
    return compile_programs(*args, **kw)
  monkeypatch.setattr(profiling, "compile_phase_programs", spy)
  monkeypatch.setattr(profiling.runtime, "command_buffers_on", lambda: True)
  rows = profiling.profile_step(pair, spec, state, CEIL, reps=1)
  assert seen == [timing.NO_COMMAND_BUFFERS]
  assert {"attention", "moe", "rest", "step_nograph"} <= {r.phase for r in rows}


def test_rest_kernels_subtract_the_parts_families():
  verify = [("gemm", 4, 40.0), ("tree_verify", 2, 30.0), ("glue", 3, 9.0)]
  parts = [[("tree_verify", 2, 30.0)], [("gemm", 1, 10.0), ("router", 1, 2.0)]]
  assert profiling.rest_kernels(verify, parts) == [("gemm", 3, 30.0), ("glue", 3, 9.0)]
