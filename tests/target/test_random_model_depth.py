"""The random INT4 model's tokens stay apart with depth (the benches' routing depends on it).

A reduced K2.6 (hidden 1024, expert FFN 512, 32 experts all held, top-8, 8 layers) decodes 16
tokens against 256 random cache rows. With the zero-mean expert draws `init_params` uses, the
tokens' MoE inputs grow no more alike layer by layer; with the full code range [-8, 7] (the
init before 2026-12-07, a shared -0.5 code offset in every expert weight) their mean cosine
triples over the same 7 MoE layers: the collapse the K2.6-share bench showed on the GPU (WORKSPACE,
twenty-sixth session). The second half shows the check can fail.
"""

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.checkpoint import int4
from kdtree_jax.target import config as C
from kdtree_jax.target import params as params_lib
from kdtree_jax.target import transformer
from kdtree_jax.target.cache import LatentCache

T, CTX, LAYERS = 16, 256, 8


def _cfg():
  return C.kimi_k2_6().replace(hidden_size=1024, moe_intermediate_size=512, n_routed_experts=32,
                               num_hidden_layers=LAYERS, num_attention_heads=8,
                               intermediate_size=2048, vocab_size=4096, weight_prefix="")


def _moe_input_cosines(cfg):
  """Mean pairwise cosine of the T tokens' MoE inputs, per MoE layer (float64 numpy)."""
  p = params_lib.init_params(jax.random.key(0), cfg, jnp.float32, int4_experts=True)
  latent = tuple(jax.random.normal(jax.random.key(i + 1), (1, CTX + T, cfg.cache_dim))
                 for i in range(cfg.num_hidden_layers))
  cache = LatentCache(latent=latent, lengths=jnp.array([CTX], jnp.int32))
  tokens = jax.random.randint(jax.random.key(9), (1, T), 0, cfg.vocab_size)
  positions = CTX + jnp.arange(T, dtype=jnp.int32)[None]
  xs = []
  transformer.decode(cfg, p, cache, tokens, positions, jnp.tril(jnp.ones((T, T), bool))[None],
                     attn_backend="xla", moe_inputs=xs)
  out = []
  for x in xs:
    u = np.asarray(x[0], np.float64)
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    g = u @ u.T
    out.append((g.sum() - np.trace(g)) / (T * (T - 1)))
  return np.array(out)


def test_zero_mean_experts_keep_tokens_apart_and_full_range_ones_collapse(monkeypatch):
  cfg = _cfg()
  apart = _moe_input_cosines(cfg)
  assert len(apart) == LAYERS - cfg.first_k_dense_replace
  assert apart[-1] <= apart[0], apart  # measured: 0.067 -> 0.026
  real = int4.random_int4
  monkeypatch.setattr(params_lib.int4, "random_int4",
                      lambda *a, zero_mean=False, **k: real(*a, zero_mean=False, **k))
  collapsing = _moe_input_cosines(cfg)
  assert collapsing[0] == apart[0]  # the first MoE layer's input precedes any routed expert
  assert collapsing[-1] >= 2 * collapsing[0], collapsing  # measured: 0.067 -> 0.200
