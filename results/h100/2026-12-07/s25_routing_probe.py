"""Routing probe (twenty-fifth session; queue row 14): the first DDTree verify of the bench pair,
its expert ids per MoE layer and how alike its tokens' MoE inputs are, per variant (the default
target, XLA's routing, XLA's attention). The CPU saw ~independent routing where the GPU phase
tables count 4.2 local experts for 13.9 pairs.

  python3 results/h100/2026-12-07/s25_routing_probe.py LAYERS BUDGET CTX [CONFIG]
"""
import dataclasses, sys, time
import numpy as np, jax, jax.numpy as jnp
from kdtree_jax.cli import load_config_file
from kdtree_jax import bench_setup, bench_state, phase_costs
from kdtree_jax.decoding import step

layers, budget, ctx = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
c = load_config_file(sys.argv[4] if len(sys.argv) > 4 else "configs/bench_k26_core.py")
if c.target.get("preset") == "k26_share":  # the tiny smoke config keeps its own depth
  c.target.layers = layers
dtype = jnp.bfloat16
t0 = time.time()
tcfg, tp, dcfg, dp = bench_setup.load_bench_pair(c, dtype, abstract=False)
spec = bench_setup.bench_spec(c, "ddtree", budget)
st = bench_state.bench_state(tcfg, dcfg, spec, 1, ctx, dtype, steps=4)
print(f"{jax.devices()[0].device_kind}: loaded {time.time() - t0:.1f} s; router_impl "
      f"{tcfg.router_impl}, attn_backend {spec.attn_backend}", flush=True)


def probe_for(cfg, sp):
  def probe(tp_, dp_, st):
    routes, xs = [], []
    _, logits = step.draft_phase(dcfg, dp_, tp_, sp, st)
    tree = step.tree_phase(sp, logits, st.bonus.shape[0])
    step.verify_phase(cfg, tp_, sp, st, tree, tuple(dcfg.target_layer_ids), routes=routes,
                      moe_inputs=xs)
    return tree.node_tokens, routes, [mean_cosine(x) for x in xs]
  return jax.jit(probe)


def mean_cosine(x):
  """Mean cosine similarity between distinct token rows of one MoE layer's input [T, D]."""
  x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
  u = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  g = u @ u.T
  t = g.shape[0]
  return (g.sum() - jnp.trace(g)) / (t * (t - 1))


local = tcfg.num_local_experts or tcfg.n_routed_experts
variants = (("default", tcfg, spec),
            ("xla_router", dataclasses.replace(tcfg, router_impl="xla"), spec),
            ("xla_attention", tcfg, dataclasses.replace(spec, attn_backend="xla")))
out = {}
for name, cfg, sp in variants:
  t0 = time.time()
  try:
    toks, routes, cos = probe_for(cfg, sp)(tp, dp, st)
    routes = [np.asarray(r) for r in routes]
  except Exception as e:  # pylint: disable=broad-except  (report and go on to the next variant)
    print(name, "FAILED", repr(e)[:300], flush=True)
    continue
  out[name] = routes
  g = [len(np.unique(r)) for r in routes]
  le = [len(np.unique(r[r < local])) for r in routes]
  lp = [int((r < local).sum()) for r in routes]
  print(f"{name}: {time.time() - t0:.1f} s; tree tokens distinct "
        f"{len(set(np.asarray(toks)[0].tolist()))}; T={routes[0].shape[0]}; per MoE layer "
        f"global experts {g}; local experts {le}; local pairs {lp}; means {np.mean(g):.1f} / "
        f"{np.mean(le):.1f} / {np.mean(lp):.1f}; MoE inputs' mean cosine "
        f"{[round(float(v), 3) for v in cos]}", flush=True)
print("independent model (local experts, local pairs):",
      phase_costs.independent_routing(tcfg, next(iter(out.values()))[0].shape[0]))
for other in ("xla_router", "xla_attention"):
  if "default" in out and other in out:
    diff = [int((np.sort(a, 1) != np.sort(b, 1)).any(1).sum())
            for a, b in zip(out["default"], out[other])]
    print(f"rows whose expert set differs, default vs {other}, per layer: {diff}")
