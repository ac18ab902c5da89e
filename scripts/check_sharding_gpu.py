"""Sharded decoding on GPUs: same tokens across meshes (f32), and step time at K2.6 width (bf16).

  python scripts/check_sharding_gpu.py --meshes ";tensor=2;expert=2" --out /tmp/out
('' in --meshes = one device.) Random weights: acceptance is ~1 token per step, so ms/step is
the verify-step cost. Writes check_sharding.json to --out and prints a table.
"""

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from kdtree_jax import config as C  # noqa: E402
from kdtree_jax import sharding  # noqa: E402
from kdtree_jax.decoding import loop  # noqa: E402
from kdtree_jax.decoding.spec_config import SpecConfig  # noqa: E402
from kdtree_jax.draft import model as DM  # noqa: E402
from kdtree_jax.draft.config import DraftConfig  # noqa: E402
from kdtree_jax.model import params as P  # noqa: E402

_MESHES = flags.DEFINE_string("meshes", ";tensor=2;expert=2",
                              "';'-separated meshes ('' = one device).")
_LAYERS = flags.DEFINE_integer("layers", 3, "Timing model layers (1 dense + MoE); 3 = ~75 GB bf16.")
_EXPERTS = flags.DEFINE_integer("experts", 384, "Routed experts of the timing model.")
_NEW = flags.DEFINE_integer("max_new_tokens", 48, "Tokens per timed generate.")
_BACKENDS = flags.DEFINE_string("attn_backends", "xla,auto", "Attention backends to time.")
_TIMING = flags.DEFINE_bool("timing", True, "Also time the K2.6-width model.")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "/tmp"), "Folder for the JSON.")


def meshes():
  return _MESHES.value.split(";")


def draft_for(tcfg, **kw):
  n = tcfg.num_hidden_layers
  return DraftConfig.tiny(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                          mask_token_id=tcfg.vocab_size - 1, num_target_layers=n,
                          target_layer_ids=tuple(sorted({0, n // 2, n - 1})), **kw)


def build(tcfg, dcfg, dtype, mesh, std):
  """Random target + draft, created directly sharded when a mesh is given."""
  ti = lambda k: P.init_params(k, tcfg, dtype, std=std)
  di = lambda k: DM.init_draft_params(k, dcfg, tcfg.hidden_size, dcfg.n_taps, dtype)
  if mesh is None:
    return ti(jax.random.key(0)), di(jax.random.key(1))
  return (sharding.init_sharded(ti, mesh, jax.random.key(0)),
          sharding.init_sharded(di, mesh, jax.random.key(1)))


def same_tokens(mesh_specs):
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
      mesh = sharding.make_mesh(m) if m else None
      tp, dp = build(tcfg, dcfg, jnp.float32, mesh, 0.15)
      toks = loop.generate(tcfg, tp, dcfg, dp, spec, prompts, 128, mesh=mesh).tokens
      ref = toks if ref is None else ref
      rows.append({"check": "same_tokens", "mode": mode, "mesh": m or "1 device",
                   "same": toks == ref})
  return rows


def timing(mesh_specs):
  """bf16 step time of a K2.6-width model (few layers) per mesh and attention backend."""
  tcfg = C.kimi_k2_6().replace(num_hidden_layers=_LAYERS.value, n_routed_experts=_EXPERTS.value)
  dcfg = draft_for(tcfg, num_hidden_layers=3, num_attention_heads=32, num_key_value_heads=8,
                   head_dim=128, intermediate_size=12288, block_size=16,
                   layer_types=("full_attention",) * 3)
  prompts = [list(np.random.default_rng(0).integers(0, 160000, 128))]
  rows = []
  for m in mesh_specs:
    mesh = sharding.make_mesh(m) if m else None
    tp, dp = build(tcfg, dcfg, jnp.bfloat16, mesh, 0.02)
    for backend in _BACKENDS.value.split(","):
      for mode, budget in (("ar", 1), ("ddtree", 32)):
        spec = SpecConfig(mode=mode, budget=budget, block_size=16, max_new_tokens=_NEW.value,
                          attn_backend=backend)
        row = {"check": "timing", "mesh": m or "1 device", "mode": mode, "backend": backend}
        try:
          for _ in range(2):  # the first call compiles; the second is timed
            res = loop.generate(tcfg, tp, dcfg, dp, spec, prompts, 4096,
                                cache_dtype=jnp.bfloat16, mesh=mesh)
          steps = max(1, len(res.accepted_per_step[0]))
          row.update(ms_per_step=1e3 * res.seconds / steps, steps=steps,
                     tokens_per_s=res.tokens_per_s)
        except Exception as e:  # pylint: disable=broad-except
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
          traceback.print_exc()
        rows.append(row)
        print(row, flush=True)
    del tp, dp
  return rows


def main(argv):
  del argv
  sharding.maybe_initialize_distributed()
  jax.config.update("jax_default_matmul_precision", "highest")  # f32 check: no TF32
  print(jax.devices())
  specs = meshes()
  rows = same_tokens(specs) + (timing(specs) if _TIMING.value else [])
  print(f"{'check':>12} | {'mode':>6} | {'mesh':>10} | {'backend':>7} | result")
  for r in rows:
    res = (str(r["same"]) if "same" in r else r.get("error") or
           f"{r['ms_per_step']:.2f} ms/step ({r['steps']} steps)")
    print(f"{r['check']:>12} | {r['mode']:>6} | {r['mesh']:>10} | {r.get('backend', '-'):>7} | "
          f"{res}")
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "check_sharding.json"), "w") as f:
    json.dump({"devices": [str(d) for d in jax.devices()], "rows": rows}, f, indent=1)
  if not all(r["same"] for r in rows if "same" in r):
    sys.exit("tokens differ across meshes")


if __name__ == "__main__":
  app.run(main)
