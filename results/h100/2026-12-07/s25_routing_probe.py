"""GPU probe (s25): the bench verify's routing on the GPU vs the CPU's near-independent routing."""
import dataclasses, sys, time, numpy as np, jax, jax.numpy as jnp
from kdtree_jax.cli import load_config_file
from kdtree_jax import bench_setup, bench_state, phase_costs
from kdtree_jax.decoding import step

layers, budget, ctx = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
c = load_config_file("configs/bench_k26_core.py")
c.target.layers = layers
dtype = jnp.bfloat16
t0 = time.time()
tcfg, tp, dcfg, dp = bench_setup.load_bench_pair(c, dtype, abstract=False)
spec = bench_setup.bench_spec(c, "ddtree", budget)
st = bench_state.bench_state(tcfg, dcfg, spec, 1, ctx, dtype, steps=4)
print(f"loaded {time.time() - t0:.1f} s; router_impl {tcfg.router_impl} moe_glue {tcfg.moe_glue}",
      flush=True)

def probe_for(cfg):
  def probe(tp_, dp_, st):
    routes = []
    _, logits = step.draft_phase(dcfg, dp_, tp_, spec, st)
    tree = step.tree_phase(spec, logits, st.bonus.shape[0])
    step.verify_phase(cfg, tp_, spec, st, tree, tuple(dcfg.target_layer_ids), routes=routes)
    return tree.node_tokens, routes
  return jax.jit(probe)

local = tcfg.num_local_experts
out = {}
for name, cfg in (("default", tcfg), ("xla_router", dataclasses.replace(tcfg, router_impl="xla"))):
  t0 = time.time()
  try:
    toks, routes = probe_for(cfg)(tp, dp, st)
    routes = [np.asarray(r) for r in routes]
  except Exception as e:  # noqa
    print(name, "FAILED", repr(e)[:300], flush=True)
    continue
  out[name] = routes
  g = [len(np.unique(r)) for r in routes]
  le = [len(np.unique(r[r < local])) for r in routes]
  lp = [int((r < local).sum()) for r in routes]
  print(f"{name}: {time.time() - t0:.1f} s; tree tokens distinct {len(set(np.asarray(toks)[0].tolist()))}; "
        f"T={routes[0].shape[0]}; per MoE layer global experts {g}; local experts {le}; "
        f"local pairs {lp}; means {np.mean(g):.1f} / {np.mean(le):.1f} / {np.mean(lp):.1f}", flush=True)
print("independent model (local experts, local pairs):",
      phase_costs.independent_routing(tcfg, routes[0].shape[0]))
if "default" in out and "xla_router" in out:
  diff = [int((np.sort(a, 1) != np.sort(b, 1)).any(1).sum()) for a, b in
          zip(out["default"], out["xla_router"])]
  print("rows whose expert set differs, default vs xla_router, per layer:", diff)
