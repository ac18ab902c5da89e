"""Copies of cache-sized buffers in the compiled decode loop, per mode (reads XLA's optimized HLO).

A decode step should touch the caches only where it reads attention rows and writes new ones. This
compiles the `lax.while_loop` of steps (the program `generate` runs) and lists, per step, the
`copy` instructions at least one cache layer in size: buffer copies XLA inserted to keep an old
value alive (each costs a read and a write of that many bytes every step), and relayouts inside
fusions (a transposed K for an XLA attention dot). Runs on CPU; the copies come from XLA's
buffer assignment, which the CPU and GPU compilers share (fusion choices differ).

  python scripts/audit_cache_copies.py --layers 4 --rows 4096
  python scripts/audit_cache_copies.py --time_rows 2048,16384 --modes ar,ddtree   # + step times
"""

from absl import app, flags
import jax
import jax.numpy as jnp
import ml_collections

from kdtree_jax.target import config as C
from kdtree_jax import hlo_audit, loader, profiling, roofline, runtime
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.target.params import init_params
from kdtree_jax.pair import Pair
from kdtree_jax import forced_accept

_LAYERS = flags.DEFINE_integer("layers", 4, "Target layers (tiny widths, K2.6 latent width 576).")
_ROWS = flags.DEFINE_integer("rows", 4096, "Context the bench state is sized for.")
_MODES = flags.DEFINE_list("modes", ["ar", "chain", "ddtree"], "Modes.")
_TIME_ROWS = flags.DEFINE_list("time_rows", [], "Also time the loop (ms/step at context 1000, "
                               "slope over 4 vs 24 steps) with caches sized for these rows.")
runtime.define_flags()


def _setup(mode, layers):
  """(target config, params, draft config, params, spec) with random weights, f32."""
  cfg = C.tiny(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=layers)
  spec = SpecConfig(mode=mode, budget=16, block_size=8, max_new_tokens=64,
                    target_choice=forced_accept.target_choice(3 if mode != "ar" else -1))
  tp = init_params(jax.random.key(0), cfg, jnp.float32)
  dcfg = dp = None
  if mode != "ar":
    dcfg, dp = loader.load_draft(ml_collections.ConfigDict(dict(checkpoint="", preset="tiny",
                                                                seed=0)), cfg, jnp.float32)
  return cfg, tp, dcfg, dp, spec


def step_ms(mode, layers, rows, ctx=1000):
  """Loop time per step at context `ctx` with caches sized for `rows` (slope, 4 vs 24 steps)."""
  cfg, tp, dcfg, dp, spec = _setup(mode, layers)
  fn = profiling.while_steps_fn(spec)
  st = profiling.bench_state(cfg, dcfg, spec, 1, rows, jnp.float32, steps=40)
  st = profiling.at_context(st, spec, ctx).replace(steps=jnp.zeros((), jnp.int32))
  pair = Pair(cfg, tp, dcfg, dp)
  t = {n: roofline.wall_time_s(fn, pair, st, jnp.int32(n), reps=3) for n in (4, 24)}
  return 1e3 * (t[24] - t[4]) / 20


def audit(mode, layers, rows):
  """(cache bytes, per-layer bytes, [hlo_audit.Copy]) for one mode's compiled loop."""
  cfg, tp, dcfg, dp, spec = _setup(mode, layers)
  st = jax.eval_shape(lambda: profiling.bench_state(cfg, dcfg, spec, 1, rows, jnp.float32))
  txt = profiling.while_steps_fn(spec).lower(Pair(cfg, tp, dcfg, dp), st,
                                            jnp.int32(4)).compile().as_text()
  caches = [st.cache] + ([st.draft_cache] if st.draft_cache is not None else [])
  leaves = [a for c in caches for a in jax.tree.leaves(c) if a.ndim >= 3]
  total = sum(a.size * a.dtype.itemsize for a in leaves)
  per_layer = min(_layer_bytes(a, cfg.cache_dim) for a in leaves)
  return total, per_layer, hlo_audit.large_copies(txt, per_layer)


def _layer_bytes(a, cache_dim):
  """Bytes of one layer's buffer: latent [B, L, C] or draft [B, L, G, E]; for a stacked array
  (a leading layers axis, as this code had before per-layer buffers) one layer's slice."""
  n = a.size * a.dtype.itemsize
  stacked = a.ndim == (4 if a.shape[-1] == cache_dim else 5)
  return n // a.shape[0] if stacked else n


def main(_):
  print(f"{'mode':>7} {'cache MB':>9} {'buffer copies':>14} {'MB/step':>8} {'fused relayouts':>16} "
        f"{'MB/step':>8}")
  for mode in _MODES.value:
    total, _, copies = audit(mode, _LAYERS.value, _ROWS.value)
    buf = [c for c in copies if not c.fused]
    rel = [c for c in copies if c.fused]
    print(f"{mode:>7} {total / 1e6:9.1f} {len(buf):14d} {sum(c.nbytes for c in buf) / 1e6:8.1f} "
          f"{len(rel):16d} {sum(c.nbytes for c in rel) / 1e6:8.1f}")
    for c in copies:
      print(f"{'':>9}{'fused' if c.fused else 'BUFFER':>7} {c.name:>10} {c.shape} {c.nbytes / 1e6:.2f} MB")
  for mode in _MODES.value:
    for rows in _TIME_ROWS.value:
      print(f"{mode:>7} rows {int(rows):6d}: {step_ms(mode, _LAYERS.value, int(rows)):8.3f} ms/step "
            f"at context 1000", flush=True)


if __name__ == "__main__":
  app.run(main)
