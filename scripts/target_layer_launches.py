"""Kernel-like instructions per target MoE layer of one decode step, read from XLA's optimised HLO
of THIS machine's backend (on a CPU: CPU HLO, labelled so; XLA:GPU fuses differently, so the
counts show which launches a change removes, not the GPU's counts), for the per-layer weights and
for target.pack's decode layout. Per layer = the program of L + 1 layers minus that of L (both
extra layers MoE), so the embedding, head and dense layer 0 cancel.

  python scripts/target_layer_launches.py --model=k26_share --n=1,16 [--dump_dir=/tmp/hlo]
"""

import collections
import os

from absl import app, flags
import jax
import jax.numpy as jnp

from kdtree_jax import bench_models, profiling_hlo
from kdtree_jax.target import config as model_config
from kdtree_jax.target import pack, params as params_lib
from kdtree_jax.target import transformer
from kdtree_jax.target.cache import LatentCache

_MODEL = flags.DEFINE_enum("model", "k26_share", ["tiny", "k26_share"], "Target shape.")
_N = flags.DEFINE_list("n", ["1", "16"], "Tokens per decode step (1 = ar, 16 = ddtree 15).")
_CTX = flags.DEFINE_integer("ctx", 1024, "Cache rows.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Weights and cache "
                           "(XLA:CPU converts 16-bit weights to f32 before each dot: float32 "
                           "leaves those CPU-only converts out).")
_DUMP = flags.DEFINE_string("dump_dir", None, "Writes each program's optimised HLO here.")


def _config(layers):
  if _MODEL.value == "tiny":
    return model_config.tiny(num_hidden_layers=layers), False
  return bench_models.k26_share(layers=layers), True


def _decode_hlo(layers, n, packed):
  """Optimised HLO text of one decode step of n tokens (abstract weights: nothing allocated)."""
  cfg, int4 = _config(layers)

  def build():
    p = params_lib.init_params(jax.random.key(0), cfg, _DTYPE.value, int4_experts=int4)
    return pack.pack_for_decode(cfg, p) if packed else p

  params = jax.eval_shape(build)
  cache = jax.eval_shape(lambda: LatentCache.zeros(cfg, 1, _CTX.value, _DTYPE.value))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  mask = jax.ShapeDtypeStruct((1, n, n), jnp.bool_)
  step = jax.jit(lambda p, c, t, pos, m: transformer.decode(cfg, p, c, t, pos, m)[:2])
  return step.lower(params, cache, i32(1, n), i32(1, n), mask).compile().as_text()


def per_layer(n, packed, base=2):
  """(kernels per MoE layer, matmuls per MoE layer, {kind: per-layer count}) from the base and
  base + 1 layer programs."""
  structs = []
  for layers in (base, base + 1):
    text = _decode_hlo(layers, n, packed)
    if _DUMP.value:
      os.makedirs(_DUMP.value, exist_ok=True)
      layout = "packed" if packed else "per_layer"
      name = f"{_MODEL.value}_{_DTYPE.value}_n{n}_{layout}_L{layers}.hlo"
      with open(os.path.join(_DUMP.value, name), "w") as f:
        f.write(text)
    structs.append(profiling_hlo.launch_structure(text))
  kinds = collections.Counter(structs[1]["by_kind"])
  kinds.subtract(structs[0]["by_kind"])
  matmuls = structs[1]["matmuls"] - structs[0]["matmuls"]
  kernels = structs[1]["kernels"] - structs[0]["kernels"]
  return kernels, matmuls, {k: v for k, v in kinds.items() if v}


def main(_):
  platform = jax.devices()[0].platform.upper()
  print(f"{platform} HLO (optimised by XLA:{platform}), {_MODEL.value} {_DTYPE.value}, one "
        "decode step, per MoE layer (program of 3 layers minus that of 2):")
  for n in map(int, _N.value):
    for packed in (False, True):
      kernels, matmuls, kinds = per_layer(n, packed)
      layout = "packed   " if packed else "per-layer"
      by_kind = sorted(kinds.items(), key=lambda kv: -kv[1])
      print(f"  N={n:3d} {layout}: {kernels:3d} kernel-like instructions, {matmuls} matmuls; "
            + ", ".join(f"{k} {v}" for k, v in by_kind))


if __name__ == "__main__":
  app.run(main)
