"""mla.latent_rows and mla.kernel_queries (one full-width expression / one product, no concatenate
per layer) against the formulations they replaced: rms_norm of c_kv and apply_rope of k_pe
joined by a concatenate; q_nope through kv_b's key half and the rotated q_pe joined (the norm
and rope modules' own functions, the per-layer weights' path); the same values in f32 (and bf16
for the rows); and the packed decode program's HLO has no concatenate per layer from either."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import profiling_hlo
from kdtree_jax.target import config as C
from kdtree_jax.target import mla, pack, transformer
from kdtree_jax.target.cache import LatentCache
from kdtree_jax.target.norm import rms_norm
from kdtree_jax.target.params import init_params
from kdtree_jax.target.rope import apply_rope, cos_sin


def _reference_rows(cfg, p, a, cos, sin, mean_square):
  c_kv = rms_norm(a[..., :cfg.kv_lora_rank], p["kv_a_norm"], cfg.lora_norm_eps, mean_square)
  k_pe = apply_rope(a[..., cfg.kv_lora_rank:], cos, sin)
  return jnp.concatenate([c_kv, k_pe], axis=-1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("given_mean_square", [False, True])
def test_latent_rows_equal_norm_and_rope_joined(dtype, given_mean_square):
  cfg = C.tiny()
  k = jax.random.split(jax.random.key(3), 3)
  a = (3 * jax.random.normal(k[0], (2, 5, cfg.cache_dim))).astype(dtype)
  p = {"kv_a_norm": (1 + jax.random.normal(k[1], (cfg.kv_lora_rank,))).astype(dtype)}
  cos, sin = cos_sin(cfg, jax.random.randint(k[2], (2, 5), 0, 5000))
  ms = None
  if given_mean_square:
    af = a[..., :cfg.kv_lora_rank].astype(jnp.float32)
    ms = jnp.mean(af * af, axis=-1, keepdims=True)
  got = mla.latent_rows(cfg, p, a, cos, sin, ms)
  want = _reference_rows(cfg, p, a, cos, sin, ms)
  assert got.dtype == want.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_kernel_queries_of_packed_weights_equal_absorbed_and_roped_joined():
  cfg = C.tiny()
  params = init_params(jax.random.key(0), cfg, jnp.float32)
  p = params["layers"][1]["attn"]
  packed = pack.pack_for_decode(cfg, params)["layers"][1]["attn"]
  k = jax.random.split(jax.random.key(4), 2)
  q = jax.random.normal(k[0], (2, 5, cfg.num_attention_heads, cfg.qk_head_dim))
  cos, sin = cos_sin(cfg, jax.random.randint(k[1], (2, 5), 0, 5000))
  dn = cfg.qk_nope_head_dim
  want = jnp.concatenate([
      jnp.einsum("bnhk,rhk->bnhr", q[..., :dn], p["kv_b"][..., :dn]),
      apply_rope(q[..., dn:], cos[:, :, None, :], sin[:, :, None, :])], axis=-1)
  got = mla.kernel_queries(packed, cfg, q, cos, sin)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(got[..., cfg.kv_lora_rank:], want[..., cfg.kv_lora_rank:])
  np.testing.assert_array_equal(mla.kernel_queries(p, cfg, q, cos, sin), want)


def _concats(layers, fn):
  """Concatenates made by mla.`fn` in the CPU-optimised HLO of a tiny packed decode step."""
  cfg = C.tiny(num_hidden_layers=layers)
  params = jax.eval_shape(lambda: pack.pack_for_decode(
      cfg, init_params(jax.random.key(0), cfg, jnp.float32)))
  cache = jax.eval_shape(lambda: LatentCache.zeros(cfg, 1, 64, jnp.float32))
  i32 = jax.ShapeDtypeStruct((1, 4), jnp.int32)
  mask = jax.ShapeDtypeStruct((1, 4, 4), jnp.bool_)
  step = jax.jit(lambda p, c, t, pos, m: transformer.decode(cfg, p, c, t, pos, m)[:2])
  index = profiling_hlo.HloIndex(step.lower(params, cache, i32, i32, mask).compile().as_text())
  frames = [profiling_hlo._FRAME_ID.search(i.attrs) for i in index.instr.values()  # pylint: disable=protected-access
            if i.opcode == "concatenate"]
  return [s for f in frames if f for s in [index.sources.get(int(f.group(1)), "")]
          if f" {fn}" in s]


@pytest.mark.parametrize("fn", ["latent_rows", "absorbed_attention", "kernel_queries"])
def test_packed_decode_hlo_has_no_concatenate_per_layer(fn):
  """Before: per layer one concatenate joined c_kv and k_pe (latent_rows) and one the absorbed
  q_nope and q_pe (absorbed_attention): on the H200 two `input_concatenate_fusion` kernels per
  layer. Now the program of 3 layers has no more of them than that of 2 (the per-step
  [1 | cos | cos] factors of rope.rotate_tail are shared by the layers)."""
  assert len(_concats(3, fn)) == len(_concats(2, fn))
