"""TargetConfig.qkv_split_k: the packed q_a | kv_a dot as S K-partials that ONE kernel sums into
y, normalises into c_q (the q LoRA RMSNorm) and reduces into c_kv's mean square
(`qkv_kernel.qkv_epilogue`, `mla._qkv_epilogue`): the kernel against numpy float64 on partials
whose sums are exact, the absorbed attention and a decode step against the field off (a spy
checks the kernel got the partials), where the path is taken, and what the CUDA lowering of a
K2.6-share attention hands the kernel."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import bench_models
from kdtree_jax.target import config as C
from kdtree_jax.target import mla, pack, qkv_kernel, transformer
from kdtree_jax.target import params as P
from kdtree_jax.target.cache import LatentCache
from test_joint_logits import _triton_operands  # neighbours' helpers (pytest imports by folder)
from test_route_shared import spy_partials

EPS = 1e-6


def _exact_partials(rng, s, t, w):
  """[S, T, W] f32 partials whose sums over S are exact in any order (every partial and partial
  sum a multiple of 1/64 below 2^12), and that sum [T, W] in float64: 12 significant bits, so
  its bf16 rounding is not the identity (and the statistics of the unrounded sum would differ)."""
  total = rng.integers(-4000, 4000, (t, w))
  parts = rng.integers(-4096, 4096, (s - 1, t, w))
  parts = np.concatenate([parts, (total - parts.sum(axis=0))[None]])
  return (parts / 64).astype(np.float32), total / 64


def _rounded(a, dtype):
  """a rounded to dtype, as float64."""
  return np.asarray(jnp.asarray(a, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("s,rq,r,p", [(8, 1536, 512, 64), (3, 24, 20, 6)])  # K2.6; small, odd
@pytest.mark.parametrize("t", [1, 16, qkv_kernel.MAX_ROWS])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_sums_normalises_and_reduces_as_numpy(s, rq, r, p, t, dtype):
  rng = np.random.default_rng(s * 1000 + t + rq)
  parts, total = _exact_partials(rng, s, t, rq + r + p)
  gain = _rounded(1 + rng.normal(size=rq) / 4, dtype)
  y, c_q, ms_kv = qkv_kernel.qkv_epilogue(jnp.asarray(parts), jnp.asarray(gain, dtype), rq, r,
                                          EPS, dtype)
  assert (y.shape, c_q.shape, ms_kv.shape) == ((t, rq + r + p), (t, rq), (t, 1))
  assert y.dtype == c_q.dtype == dtype and ms_kv.dtype == jnp.float32
  want_y = _rounded(total, dtype)  # the exact sum, rounded once (the identity in f32)
  np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32), np.float64), want_y)
  y_q, y_kv = want_y[:, :rq], want_y[:, rq:rq + r]
  want_c_q = gain * y_q / np.sqrt(np.mean(y_q * y_q, axis=-1, keepdims=True) + EPS)
  got_c_q = np.asarray(c_q.astype(jnp.float32), np.float64)
  if dtype == jnp.float32:
    np.testing.assert_allclose(got_c_q, want_c_q, rtol=1e-6, atol=1e-6 * np.abs(want_c_q).max())
  else:  # one bf16 rounding of the f64 value (8 significant bits: half an ulp <= 2^-8 relative)
    np.testing.assert_allclose(got_c_q, want_c_q, rtol=2.0 ** -8, atol=1e-30)
  np.testing.assert_allclose(np.asarray(ms_kv, np.float64),
                             np.mean(y_kv * y_kv, axis=-1, keepdims=True), rtol=1e-6)


def test_kernel_refuses_shapes_it_does_not_take():
  with pytest.raises(ValueError, match="qkv_epilogue"):
    qkv_kernel.qkv_epilogue(jnp.zeros((2, qkv_kernel.MAX_ROWS + 1, 50)), jnp.zeros(24), 24, 20,
                            EPS, jnp.float32)
  with pytest.raises(ValueError, match="W > Rq \\+ R"):
    qkv_kernel.qkv_epilogue(jnp.zeros((2, 4, 44)), jnp.zeros(24), 24, 20, EPS, jnp.float32)
  with pytest.raises(ValueError, match="qkv_split_k"):
    C.tiny(qkv_split_k=-1)


def _attention_inputs(cfg, dtype, b, n, seed=0):
  """(packed layer-1 attention params, x [B, N, D], positions, cache [B, L, C], lengths, mask)."""
  k = jax.random.split(jax.random.key(seed), 4)
  params = P.init_params(k[0], cfg, dtype, std=0.15)
  p = pack.pack_for_decode(cfg, params)["layers"][1]["attn"]
  x = jax.random.normal(k[1], (b, n, cfg.hidden_size)).astype(dtype)
  lengths = jnp.arange(3, 3 + b, dtype=jnp.int32)
  positions = lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
  cache = (jax.random.normal(k[2], (b, 24, cfg.cache_dim)) / 2).astype(dtype)
  mask = jax.random.bernoulli(k[3], 0.5, (b, n, n)) | jnp.eye(n, dtype=bool)[None]
  return p, x, positions, cache, lengths, mask


@pytest.mark.parametrize("b,n", [(1, 1), (2, 5)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_absorbed_attention_equals_the_field_off(b, n, dtype, tol, monkeypatch):
  """The attention output and the cache rows it writes, with the field on (S = 4) and off: the
  same values up to the sums' order (f32) or bf16 rounding; the kernel got [S, B * N, W]."""
  cfg = C.tiny()
  p, x, positions, cache, lengths, mask = _attention_inputs(cfg, dtype, b, n)
  run = lambda c: mla.absorbed_attention(p, c, x, positions, cache, lengths, mask, backend="xla")
  off = run(cfg)
  shapes = spy_partials(monkeypatch, qkv_kernel, "qkv_epilogue")
  on = run(dataclasses.replace(cfg, qkv_split_k=4))
  assert shapes == [(4, b * n, p["qkv_a_t"].shape[0])]
  for got, want in zip(on, off):
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol,
                               atol=tol * np.abs(want).max())


def test_decode_step_equals_the_field_off(monkeypatch):
  """A tiny packed f32 decode step (3 layers, B = 2, 4 tokens): logits and the written cache
  rows within f32 rounding of the field off; the kernel ran once per layer."""
  cfg = C.tiny()
  params = pack.pack_for_decode(cfg, P.init_params(jax.random.key(7), cfg, jnp.float32))
  cache = LatentCache.zeros(cfg, 2, 32, jnp.float32)
  cache = dataclasses.replace(cache, lengths=jnp.array([2, 5], jnp.int32))
  tokens = jnp.array([[5, 6, 7, 8], [9, 10, 11, 12]], jnp.int32)
  positions = cache.lengths[:, None] + jnp.arange(4, dtype=jnp.int32)[None]
  mask = jnp.tril(jnp.ones((2, 4, 4), bool))
  step = lambda c: transformer.decode(c, params, cache, tokens, positions, mask,
                                      attn_backend="xla")[:2]
  off = step(cfg)
  shapes = spy_partials(monkeypatch, qkv_kernel, "qkv_epilogue")
  on = step(dataclasses.replace(cfg, qkv_split_k=2))
  assert shapes == [(2, 8, cfg.q_lora_rank + cfg.cache_dim)] * cfg.num_hidden_layers
  for got, want in zip(jax.tree.leaves(on), jax.tree.leaves(off)):
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("change,rows,taken", [
    ({}, 16, True), ({}, qkv_kernel.MAX_ROWS, True), ({"qkv_split_k": 0}, 16, False),
    ({}, qkv_kernel.MAX_ROWS + 1, False), ({"qkv_split_k": 3}, 16, False),  # 3 does not divide D
    ({"fold_norm_weights": True}, 16, False), ({"q_lora_rank": None}, 16, False)])
def test_where_the_path_is_taken(change, rows, taken):
  cfg = C.tiny(**{"qkv_split_k": 4, **change})
  params = P.init_params(jax.random.key(1), cfg, jnp.float32)
  p = pack.pack_for_decode(cfg, params)["layers"][1]["attn"]
  assert mla.qkv_in_kernel(p, cfg, rows) is taken
  assert not mla.qkv_in_kernel(params["layers"][1]["attn"], cfg, rows)  # per-layer params


@pytest.mark.parametrize("t", [1, 16])
def test_k26_lowering_hands_the_kernel_the_partials(t):
  """K2.6 share (Rq 1536, R 512, P 64) at T = 1 and 16 with S = 8: one Triton call in the
  attention (XLA's tree-verify backend), on the [8, T, 2112] partials."""
  cfg = dataclasses.replace(bench_models.k26_share(layers=2), qkv_split_k=8)
  build = lambda: pack.pack_for_decode(cfg, P.init_params(jax.random.key(0), cfg, jnp.bfloat16,
                                                          int4_experts=True))
  p = jax.eval_shape(build)["layers"][1]["attn"]
  sd = jax.ShapeDtypeStruct
  args = (sd((1, t, cfg.hidden_size), jnp.bfloat16), sd((1, t), jnp.int32),
          sd((1, 256, cfg.cache_dim), jnp.bfloat16), sd((1,), jnp.int32), sd((1, t, t), jnp.bool_))
  text = _lower_for_h200(lambda p, *a: mla.absorbed_attention(p, cfg, *a, backend="xla"), p,
                        *args)
  assert _triton_operands(text) == [f"tensor<8x{t}x2112xf32>"]


def _lower_for_h200(fn, *structs):
  """test_route_kernel.TestLowersForH200.lower_text with the abstract mesh's axis in Auto mode:
  under its default (Explicit) axis the attention's cache write fails to trace with or without
  this field (dynamic_update_slice: the rows' sharding differs from the cache's)."""
  h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=h200)
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
