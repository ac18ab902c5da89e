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


@pytest.mark.parametrize("n", [1, 5])  # 1: mla._one_token_queries (rope factors on the weights)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_queries_of_packed_weights_equal_absorbed_and_roped_joined(n, dtype):
  cfg = C.tiny()
  params = init_params(jax.random.key(0), cfg, dtype)
  p = params["layers"][1]["attn"]
  packed = pack.pack_for_decode(cfg, params)["layers"][1]["attn"]
  k = jax.random.split(jax.random.key(4), 2)
  q = jax.random.normal(k[0], (2, n, cfg.num_attention_heads, cfg.qk_head_dim)).astype(dtype)
  cos, sin = cos_sin(cfg, jax.random.randint(k[1], (2, n), 0, 5000))
  dn = cfg.qk_nope_head_dim
  want = jnp.concatenate([
      jnp.einsum("bnhk,rhk->bnhr", q[..., :dn], p["kv_b"][..., :dn],
                 preferred_element_type=jnp.float32).astype(dtype),
      apply_rope(q[..., dn:], cos[:, :, None, :], sin[:, :, None, :])], axis=-1)
  got = mla.kernel_queries(packed, cfg, q, cos, sin)
  assert got.dtype == dtype
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=tol, atol=tol)
  np.testing.assert_array_equal(np.asarray(got[..., cfg.kv_lora_rank:], np.float32),
                                np.asarray(want[..., cfg.kv_lora_rank:], np.float32))
  if dtype == jnp.float32:
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


@pytest.mark.parametrize("b,n", [(1, 1), (1, 4), (3, 1), (3, 4)])
def test_write_rows_writes_each_batch_rows_window_clamped(b, n):
  """write_rows against numpy: batch row i's rows land at [start_i, start_i + N), the start
  wrapped if negative and clamped to [0, L - N] (dynamic_update_slice's rule, which the
  vmapped scatter it replaced followed too); other rows and batch rows unchanged."""
  length = 16
  k = jax.random.split(jax.random.key(5), 2)
  cache = jax.random.normal(k[0], (b, length, 6))
  rows = jax.random.normal(k[1], (b, n, 6))
  starts = np.array([0, 7, length - 1, -3][:b] if b > 1 else [9], np.int32)
  got = jax.jit(mla.write_rows)(cache, rows, jnp.asarray(starts))
  want = np.array(cache)
  for i, s in enumerate(starts):
    s = min(max(s + length if s < 0 else s, 0), length - n)
    want[i, s:s + n] = rows[i]
  np.testing.assert_array_equal(got, want)


def test_write_rows_does_not_read_the_cache_back():
  """One batch row (decode): no dynamic-slice (the old rows read back for a scatter's
  out-of-bounds select) and no scatter in the optimised HLO: one dynamic-update-slice, in place
  (aliased)."""
  cache = jax.ShapeDtypeStruct((1, 64, 8), jnp.bfloat16)
  rows = jax.ShapeDtypeStruct((1, 4, 8), jnp.bfloat16)
  starts = jax.ShapeDtypeStruct((1,), jnp.int32)
  text = jax.jit(mla.write_rows, donate_argnums=0).lower(cache, rows, starts).compile().as_text()
  ops = [i.opcode for i in profiling_hlo.HloIndex(text).instr.values()]
  assert "dynamic-slice" not in ops and "scatter" not in ops
  assert ops.count("dynamic-update-slice") == 1
  assert "input_output_alias={ {}: (0, {}" in text
