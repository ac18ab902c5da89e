"""Sharded decoding on real GPUs, in order of value (a time box loses the least):

  1. allreduce: latency of one all-reduce of the step's hidden vector ([1, 7168] bf16) over all
     GPUs (a device loop of 200, so dispatch is amortised).
  2. tokens: f32, a mid-size random model: every mesh and mode emits the one-device tokens.
  4. projection: the 8-GPU full-depth step (ar, ddtree) from one GPU's measured share
     (--share_jsonl, bench_k26_full's phase tables) + the collectives per step (counted in the
     HLO) x the all-reduce latency measured in part 1 (`kdtree_jax/projection.py` lists the
     assumptions).
  3. timing: bf16 step time at K2.6 width (64 heads, 384 INT4 experts, `--layers` layers, all of
     them on 1 GPU or split by each mesh), ar and ddtree (budget --budget), random weights with
     acceptance forced to --forced_accept so every mode does the same work per step.

  python scripts/check_sharding_gpu.py --meshes ";tensor=2;expert=2" --out /tmp/sharding.jsonl
('' in --meshes = one device.) One JSON line per row; a table last.
"""

import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kdtree_jax import bench_models, cli, forced_accept, projection, sharding
from kdtree_jax.target import config as C
from kdtree_jax.decoding import loop
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.draft import model as DM
from kdtree_jax.draft.config import DraftConfig
from kdtree_jax.target import params as P
from kdtree_jax.pair import Pair

_MESHES = flags.DEFINE_string("meshes", ";tensor=2;expert=2",
                              "';'-separated meshes ('' = one device).")
_PARTS = flags.DEFINE_list("parts", ["allreduce", "tokens", "timing", "projection"],
                           "Parts, in order.")
_SHARE = flags.DEFINE_string("share_jsonl", "results/h200/2026-12-01/s9_k26_core.jsonl",
                             "bench_k26_full.jsonl with the one-GPU-share phase tables (the "
                             "latest: the ninth session's, decode loop as one CUDA graph).")
_LAYERS = flags.DEFINE_integer("layers", 4, "K2.6-width timing model layers (1 dense + MoE).")
_BUDGET = flags.DEFINE_integer("budget", 15, "ddtree budget of the timing.")
_FORCED = flags.DEFINE_integer("forced_accept", 3, "Forced acceptance of the timing runs.")
_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Tokens per timed generate.")
_OUT = flags.DEFINE_string("out", "/tmp/sharding.jsonl", "JSON lines output.")


def _mesh(spec):
  if not spec:
    return None
  n = int(np.prod([int(p.split("=")[1]) for p in spec.split(",")]))
  return sharding.make_mesh(spec, jax.devices()[:n])


def draft_for(tcfg, **kw):
  n = tcfg.num_hidden_layers
  return DraftConfig.tiny(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                          mask_token_id=tcfg.vocab_size - 1, num_target_layers=n,
                          target_layer_ids=tuple(sorted({0, n // 2, n - 1})), **kw)


def build(tcfg, dcfg, dtype, mesh, std, int4_experts=False):
  """Random target + draft, created directly sharded when a mesh is given."""
  ti = lambda k: P.init_params(k, tcfg, dtype, std=std, int4_experts=int4_experts)
  di = lambda k: DM.init_draft_params(k, dcfg, tcfg.hidden_size, dcfg.n_taps, dtype)
  if mesh is None:
    return jax.jit(ti)(jax.random.key(0)), jax.jit(di)(jax.random.key(1))
  return (sharding.init_sharded(ti, mesh, jax.random.key(0)),
          sharding.init_sharded(di, mesh, jax.random.key(1)))


def allreduce_rows():
  """us per all-reduce of [1, 7168] bf16 (and f32) over every device, 200 in one program."""
  n = jax.device_count()
  mesh = sharding.make_mesh(f"tensor={n}")
  rows = []
  for dtype in (jnp.bfloat16, jnp.float32):
    x = jnp.ones((n, 7168), dtype)

    def reduce_once(_, v):  # psum's result is the same on every device: mark it varying again
      return jax.lax.pcast((jax.lax.psum(v, "tensor") / n).astype(v.dtype), "tensor", to="varying")

    def body(x):
      return jax.lax.fori_loop(0, 200, reduce_once, x)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("tensor"), out_specs=jax.P("tensor")))
    jax.block_until_ready(fn(x))
    t0 = time.perf_counter()
    for _ in range(5):
      jax.block_until_ready(fn(x))
    us = (time.perf_counter() - t0) / 5 / 200 * 1e6
    rows.append(dict(check="allreduce", devices=n, dtype=jnp.dtype(dtype).name, us=us))
  return rows


def token_rows(mesh_specs):
  """f32, a mid-size model: every mesh and mode must emit the one-device tokens."""
  tcfg = C.tiny(vocab_size=1024, hidden_size=512, num_attention_heads=16, n_routed_experts=16,
                moe_intermediate_size=128, intermediate_size=1024, num_hidden_layers=3,
                eos_token_id=None)
  dcfg = draft_for(tcfg, block_size=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                   intermediate_size=1024)
  prompts = [list(np.random.default_rng(0).integers(0, 1000, 20))]
  rows = []
  for mode in ("ar", "chain", "ddtree"):
    spec = SpecConfig(mode=mode, budget=16, block_size=8, max_new_tokens=32)
    ref = None
    for m in mesh_specs:
      mesh = _mesh(m)
      tp, dp = build(tcfg, dcfg, jnp.float32, mesh, 0.15)
      toks = loop.generate(Pair(tcfg, tp, dcfg, dp), spec, prompts, 128, mesh=mesh).tokens
      ref = toks if ref is None else ref
      rows.append(dict(check="same_tokens", mode=mode, mesh=m or "1 device", same=toks == ref))
      print(rows[-1], flush=True)
  return rows


def timing_rows(mesh_specs):
  """bf16 ms per step of a K2.6-width model (INT4 routed experts) per mesh and mode."""
  tcfg = C.kimi_k2_6().replace(num_hidden_layers=_LAYERS.value, weight_prefix="")
  dcfg = draft_for(tcfg, num_hidden_layers=3, num_attention_heads=32, num_key_value_heads=8,
                   head_dim=128, intermediate_size=12288, block_size=16,
                   layer_types=("full_attention",) * 3)
  prompts = [list(np.random.default_rng(0).integers(0, 160000, 128))]
  rows = []
  for m in mesh_specs:
    mesh = _mesh(m)
    tp, dp = build(tcfg, dcfg, jnp.bfloat16, mesh, 0.02, int4_experts=True)
    for mode in ("ar", "ddtree"):
      spec = SpecConfig(mode=mode, budget=_BUDGET.value, block_size=16,
                        max_new_tokens=_NEW.value,
                        target_choice=forced_accept.target_choice(_FORCED.value))
      row = dict(check="timing", mesh=m or "1 device", mode=mode, layers=_LAYERS.value)
      try:
        t0 = time.perf_counter()
        loop.generate(Pair(tcfg, tp, dcfg, dp), spec, prompts, 4096, cache_dtype=jnp.bfloat16,
                      mesh=mesh)
        row["first_call_s"] = time.perf_counter() - t0
        res = loop.generate(Pair(tcfg, tp, dcfg, dp), spec, prompts, 4096, cache_dtype=jnp.bfloat16,
                            mesh=mesh)
        steps = max(1, len(res.accepted_per_step[0]))
        row.update(ms_per_step=1e3 * res.seconds / steps, steps=steps,
                   tokens_per_step=float(np.mean(res.accepted_per_step[0])))
      except Exception as e:  # pylint: disable=broad-except
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
      rows.append(row)
      print(row, flush=True)
    del tp, dp
  return rows


def projection_rows(done):
  """Projected 8-GPU full-depth step per mode from the share's step and the measured all-reduce."""
  ar = [r for r in done if r["check"] == "allreduce" and r.get("dtype") == "bfloat16"]
  if not ar or ar[0]["devices"] < 2:
    raise ValueError("needs the allreduce part on >= 2 GPUs in the same run")
  steps = projection.share_steps(_SHARE.value)
  if not steps:
    raise ValueError(f"no phase table with a fused step in {_SHARE.value}")
  dcfg = bench_models.k26_dflash_share(bench_models.k26_share())
  projs = [projection.Projection(mode, budget, ms,
                                 projection.collectives_per_step(mode, 61, dcfg.num_hidden_layers),
                                 ar[0]["us"], ar[0]["devices"])
           for (mode, budget), ms in sorted(steps.items(), key=str)]
  print(projection.__doc__ + "\n" + projection.table(projs), flush=True)
  return [dict(check="projection", mode=p.mode, budget=p.budget, share_step_ms=p.share_step_ms,
               collectives=p.collectives, allreduce_us=p.allreduce_us, gpus=p.gpus,
               step_ms=p.step_ms, source=_SHARE.value) for p in projs]


def _fmt(r):
  if "error" in r:
    return r["error"][:90]
  if r["check"] == "allreduce":
    return f"{r['us']:.1f} us ({r['dtype']}, {r['devices']} GPUs)"
  if r["check"] == "projection":
    return (f"{r['step_ms']:.2f} ms/step projected on 8 GPUs ({r['share_step_ms']:.2f} share + "
            f"{r['collectives']} x {r['allreduce_us']:.1f} us)")
  if r["check"] == "same_tokens":
    return str(r["same"])
  return f"{r['ms_per_step']:.2f} ms/step ({r['steps']} steps, {r['tokens_per_step']:.1f} tok/step)"


def main(argv):
  del argv
  sharding.initialize_distributed(cli.distributed_from_env())
  jax.config.update("jax_default_matmul_precision", "highest")  # the f32 check: no TF32
  print(jax.devices(), flush=True)
  specs = _MESHES.value.split(";")
  parts = {"allreduce": allreduce_rows, "tokens": lambda: token_rows(specs),
           "timing": lambda: timing_rows(specs), "projection": lambda: projection_rows(rows)}
  rows = []
  with open(_OUT.value, "w") as sink:
    for name in _PARTS.value:
      try:
        new = parts[name]()
      except Exception as e:  # pylint: disable=broad-except
        traceback.print_exc()
        new = [dict(check=name, mode="-", mesh="-", error=f"{type(e).__name__}: {str(e)[:300]}")]
      for r in new:
        sink.write(json.dumps(r) + "\n")
      sink.flush()
      rows += new
  print(f"\n{'check':>12} | {'mode':>6} | {'mesh':>18} | result")
  for r in rows:
    print(f"{r['check']:>12} | {r.get('mode', '-'):>6} | {r.get('mesh', '-'):>18} | {_fmt(r)}")
  if not all(r["same"] for r in rows if "same" in r):
    raise SystemExit("tokens differ across meshes")


if __name__ == "__main__":
  app.run(main)
