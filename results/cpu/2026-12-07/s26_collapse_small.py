"""Does a reduced K2.6 (hidden D, expert FFN F, E experts all held, top-8, L layers) collapse on
the CPU with the full-range INT4 draws, and stay apart with the zero-mean ones? 16 tokens
decoded as a causal chain against C random cache rows; per MoE layer the distinct experts
and the MoE inputs' mean cosine.

  python3 results/cpu/2026-12-07/s26_collapse_small.py D F E L C
"""
import sys, time
import numpy as np, jax, jax.numpy as jnp
from kdtree_jax.target import config as C, params as params_lib, transformer
from kdtree_jax.target.cache import LatentCache
from kdtree_jax.checkpoint import int4

d, f, e, layers, ctx = map(int, sys.argv[1:6])
cfg = C.kimi_k2_6().replace(hidden_size=d, moe_intermediate_size=f, n_routed_experts=e,
                            num_hidden_layers=layers, num_attention_heads=8,
                            intermediate_size=4 * f, vocab_size=4096, weight_prefix="")
real = int4.random_int4
t = 16
for draw in ("full_range", "zero_mean"):
  params_lib.int4.random_int4 = lambda *a, zero_mean=False, _z=(draw == "zero_mean"), **k: real(
      *a, zero_mean=_z, **k)
  t0 = time.time()
  p = params_lib.init_params(jax.random.key(0), cfg, jnp.float32, int4_experts=True)
  lat = tuple(jax.random.normal(jax.random.key(i + 1), (1, ctx + t, cfg.cache_dim), jnp.float32)
              for i in range(layers))
  cache = LatentCache(latent=lat, lengths=jnp.array([ctx], jnp.int32))
  toks = jax.random.randint(jax.random.key(9), (1, t), 0, cfg.vocab_size)
  pos = ctx + jnp.arange(t, dtype=jnp.int32)[None]
  mask = jnp.tril(jnp.ones((t, t), bool))[None]
  routes, xs = [], []
  transformer.decode(cfg, p, cache, toks, pos, mask, attn_backend="xla", routes=routes,
                     moe_inputs=xs)
  cos = []
  for x in xs:
    u = np.asarray(x[0], np.float64)
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    g = u @ u.T
    cos.append(round(float((g.sum() - np.trace(g)) / (t * (t - 1))), 3))
  print(f"{draw}: {time.time() - t0:.1f} s; experts per MoE layer "
        f"{[len(np.unique(np.asarray(r))) for r in routes]} (independent "
        f"{e * (1 - (1 - 1 / e) ** (8 * t)):.0f}); MoE inputs' mean cosine {cos}", flush=True)
