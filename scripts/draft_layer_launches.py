"""Kernel-like instructions per draft layer of draft_block, read from XLA's optimised HLO of THIS
machine's backend (on a CPU: CPU HLO, labelled so; XLA:GPU fuses differently, so the counts show
which launches a change removes, not the GPU's counts), for the older kernel I/O
(packed_io=False: q, k, v sliced and transposed for the ctx kernel, its partials merged by XLA)
the packed one, and the packed one with the q/k norm and rope in the kernel (qk_in_kernel, the
default). Off a GPU the Triton kernels have no lowering, so each is
replaced by an opaque stand-in of the same operands and results (a host callback: one
custom-call, as the kernel is one launch). Per layer = the program of 3 layers minus that of 2
(embedding, head and the first layer cancel).

  python scripts/draft_layer_launches.py [--ctx=46016] [--dump_dir=/tmp/hlo]
"""

import contextlib
import os
from unittest import mock

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import bench_models, profiling_hlo
from kdtree_jax.draft import ctx_attention, model

_CTX = flags.DEFINE_integer("ctx", 46016, "Cache rows (the draft of bench_k26_full at 46k).")
_DUMP = flags.DEFINE_string("dump_dir", None, "Writes each program's optimised HLO here.")


def _stand_in(kernel):
  """kernel's results (shapes from jax.eval_shape of the real call) from an opaque host callback
  reading every operand: one custom-call where the GPU runs one kernel."""
  def call(*args, **kw):
    out = jax.eval_shape(lambda *a: kernel(*a, **kw), *args)
    zeros = lambda *_: jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), out)
    return jax.pure_callback(zeros, out, *args)
  return call


def _kernels_stood_in():
  """Patches the draft's Pallas calls with _stand_in off a GPU (interpret=False as on a GPU)."""
  stack = contextlib.ExitStack()
  if jax.default_backend() != "gpu":
    for name in ("ctx_partials", "packed_block_partials", "merge_to_heads"):
      stack.enter_context(mock.patch.object(ctx_attention, name,
                                            _stand_in(getattr(ctx_attention, name))))
  return stack


FORMS = {"split I/O (packed_io=False)": dict(packed_io=False, qk_in_kernel=False),
         "packed I/O": dict(qk_in_kernel=False),
         "packed I/O + qk_in_kernel (default)": dict()}


def _block_hlo(layers, form):
  """Optimised HLO text of draft_block for k26_dflash_share with `layers` layers (abstract
  weights, pack_for_decode's layout, block 16, bf16 cache of _CTX rows)."""
  tcfg = bench_models.k26_share(layers=61)
  cfg = bench_models.k26_dflash_share(tcfg)
  cfg = cfg.__class__(**{**cfg.__dict__, "num_hidden_layers": layers,
                         "layer_types": cfg.layer_types[:1] * layers})
  D, V, S = cfg.hidden_size, cfg.vocab_size, cfg.block_size
  params = jax.eval_shape(lambda: model.pack_for_decode(
      model.init_draft_params(jax.random.key(0), cfg, D, cfg.n_taps, jnp.bfloat16)))
  cache = jax.eval_shape(lambda: model.init_draft_cache(cfg, 1, _CTX.value, jnp.bfloat16))
  sd = jax.ShapeDtypeStruct
  args = (params, cache, sd((1, S), jnp.int32), sd((1,), jnp.int32), sd((V, D), jnp.bfloat16),
          sd((D, V), jnp.bfloat16))
  f = lambda p, c, t, s, e, h: model.draft_block(p, cfg, c, t, s, e, h, ctx_impl="pallas",
                                                 **FORMS[form])
  with _kernels_stood_in():
    return jax.jit(f).lower(*args).compile().as_text()


def per_layer(form, base=2):
  """(kernel-like instructions per layer, {kind: per-layer count}) from base and base + 1."""
  structs = []
  for layers in (base, base + 1):
    text = _block_hlo(layers, form)
    if _DUMP.value:
      os.makedirs(_DUMP.value, exist_ok=True)
      name = form.split(" (")[0].replace(" ", "_").replace("/", "").replace("+", "")
      with open(os.path.join(_DUMP.value, f"draft_block_{name}_L{layers}.hlo"), "w") as f:
        f.write(text)
    structs.append(profiling_hlo.launch_structure(text))
  kinds = {k: structs[1]["by_kind"].get(k, 0) - structs[0]["by_kind"].get(k, 0)
           for k in set(structs[1]["by_kind"]) | set(structs[0]["by_kind"])}
  return structs[1]["kernels"] - structs[0]["kernels"], {k: n for k, n in kinds.items() if n}


def main(_):
  platform = jax.devices()[0].platform.upper()
  print(f"{platform} HLO (optimised by XLA:{platform}), draft_block of k26_dflash_share, "
        f"{_CTX.value} cache rows, per draft layer (program of 3 layers minus that of 2):")
  for form in FORMS:
    kernels, kinds = per_layer(form)
    by_kind = sorted(kinds.items(), key=lambda kv: -kv[1])
    print(f"  {form:28}: {kernels:3d} kernel-like instructions; "
          + ", ".join(f"{k} {v}" for k, v in by_kind))


if __name__ == "__main__":
  app.run(main)
