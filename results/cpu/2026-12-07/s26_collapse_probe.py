"""Collapse probe (twenty-sixth session; queue row 15): the first DDTree verify of the K2.6-share
bench pair, per MoE layer its global expert count and its tree tokens' MoE inputs' mean cosine,
with the random INT4 experts drawn zero-mean (today's init) or over the full code range (the
init before 2026-12-07, mean -0.5 code). Default variant only (s25_routing_probe.py has the
kernel-vs-XLA ones).

  python3 results/cpu/2026-12-07/s26_collapse_probe.py LAYERS BUDGET CTX zero_mean|full_range
"""
import functools, sys, time
import numpy as np, jax, jax.numpy as jnp
from kdtree_jax.cli import load_config_file
from kdtree_jax import bench_setup, bench_state, phase_costs
from kdtree_jax.checkpoint import int4
from kdtree_jax.decoding import step
from kdtree_jax.target import params as params_lib

layers, budget, ctx, draw = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if draw not in ("zero_mean", "full_range"):
  raise SystemExit(f"draw must be zero_mean or full_range, not {draw!r}")
if draw == "full_range":  # the old init: route params.init_params's draws to the full range
  real = int4.random_int4
  params_lib.int4.random_int4 = lambda *a, zero_mean=False, **k: real(*a, zero_mean=False, **k)
c = load_config_file("configs/bench_k26_core.py")
c.target.layers = layers
t0 = time.time()
tcfg, tp, dcfg, dp = bench_setup.load_bench_pair(c, jnp.bfloat16, abstract=False)
spec = bench_setup.bench_spec(c, "ddtree", budget)
st = bench_state.bench_state(tcfg, dcfg, spec, 1, ctx, jnp.bfloat16, steps=4)
print(f"{jax.devices()[0].device_kind}: {draw}, {layers} layers, ctx {ctx}: loaded "
      f"{time.time() - t0:.1f} s", flush=True)


def mean_cosine(x):
  """Mean cosine similarity between distinct token rows of one MoE layer's input [T, D]."""
  x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  u = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  g = u @ u.T
  t = g.shape[0]
  return (g.sum() - jnp.trace(g)) / (t * (t - 1))


@jax.jit
def probe(tp_, dp_, st):
  routes, xs = [], []
  _, logits = step.draft_phase(dcfg, dp_, tp_, spec, st)
  tree = step.tree_phase(spec, logits, st.bonus.shape[0])
  step.verify_phase(tcfg, tp_, spec, st, tree, tuple(dcfg.target_layer_ids), routes=routes,
                    moe_inputs=xs)
  return routes, [mean_cosine(x) for x in xs]


t0 = time.time()
routes, cos = probe(tp, dp, st)
routes = [np.asarray(r) for r in routes]
local = tcfg.num_local_experts
g = [len(np.unique(r)) for r in routes]
le = [len(np.unique(r[r < local])) for r in routes]
print(f"{draw}: {time.time() - t0:.1f} s; T={routes[0].shape[0]}; per MoE layer global experts "
      f"{g}; local experts {le}; MoE inputs' mean cosine {[round(float(v), 3) for v in cos]}",
      flush=True)
print("independent model (local experts, local pairs):",
      phase_costs.independent_routing(tcfg, routes[0].shape[0]))
