"""The one-launch residual add + RMSNorm (TargetConfig.fused_add_norm, `target/add_norm_kernel.py`)
against a numpy float64 "add, round to the dtype, then RMSNorm" (Pallas interpret mode on a CPU);
the decode step with it vs XLA's adds and norms (one token per row: the kernel; more: unchanged);
its CUDA lowering in a K2.6-share decode step for an abstract H200."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kdtree_jax import bench_models
from kdtree_jax.target import add_norm_kernel, pack
from kdtree_jax.target import config as C
from kdtree_jax.target import params as P
from kdtree_jax.target import transformer as T
from kdtree_jax.target.cache import LatentCache

EPS = 1e-6
NP_DTYPE = {jnp.float32: np.float32, jnp.bfloat16: ml_dtypes.bfloat16}


def _numpy_add_norm(x, h, w, dtype):
  """float64 reference: s = x + h rounded once to dtype, y = w * s / sqrt(mean(s^2) + eps)
  (y unrounded, the exact value the kernel's output rounds)."""
  s = np.asarray(x, np.float64) + (0.0 if h is None else np.asarray(h, np.float64))
  s = s.astype(NP_DTYPE[dtype]).astype(np.float64)
  y = np.asarray(w, np.float64) * s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS)
  return s, y


def _rows(key, m, d, dtype):
  """x, h [m, 1, d] (rows at scales 1e-2 .. 1e2: the statistics matter) and w [d]."""
  kx, kh, kw = jax.random.split(key, 3)
  scale = 10.0 ** jnp.linspace(-2, 2, m)[:, None, None]
  x = (jax.random.normal(kx, (m, 1, d)) * scale).astype(dtype)
  h = (jax.random.normal(kh, (m, 1, d)) * scale * 0.3).astype(dtype)
  w = (1.0 + 0.5 * jax.random.normal(kw, (d,))).astype(dtype)
  return x, h, w


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 8e-3)])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("d", [7168, 96, 100])  # K2.6's D (8192 lanes, masked); not a power of 2
@pytest.mark.parametrize("with_h", [True, False])
def test_add_rms_norm_equals_numpy(dtype, rtol, m, d, with_h):
  """s: exactly numpy's rounded sum; y: within the dtype's rounding of numpy's f64 norm (bf16:
  half an ulp is 2^-9 relative, f32: summation order), and in bf16 the f64 norm rounded once to
  bf16 but where f32 statistics sit on a rounding midpoint (~1e-7 / 2^-9 of the elements; a
  norm of the unrounded sum, as XLA's fusion, misses ~1 in 4)."""
  x, h, w = _rows(jax.random.key(m * d), m, d, dtype)
  h = h if with_h else None
  s, y = add_norm_kernel.add_rms_norm(x, h, w, EPS)
  want_s, want_y = _numpy_add_norm(x, h, w, dtype)
  assert s.shape == y.shape == x.shape and s.dtype == y.dtype == dtype
  np.testing.assert_array_equal(np.asarray(s, np.float64), want_s)
  np.testing.assert_allclose(np.asarray(y, np.float64), want_y, rtol=rtol, atol=1e-30)
  if dtype == jnp.bfloat16:
    once = want_y.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.mean(np.asarray(y, np.float64) != once) < 1e-3


def test_add_rms_norm_refuses_what_it_does_not_take():
  x = jnp.zeros((2, 1, 64))
  assert add_norm_kernel.supports(16, 7168) and not add_norm_kernel.supports(17, 7168)
  assert not add_norm_kernel.supports(1, 2 * add_norm_kernel.MAX_DIM)
  for h, w in [(x.astype(jnp.bfloat16), jnp.ones(64)), (jnp.zeros((2, 1, 32)), jnp.ones(32)),
               (x, jnp.ones(32))]:
    with pytest.raises(ValueError, match="add_rms_norm"):
      add_norm_kernel.add_rms_norm(x, h, w, EPS)
  with pytest.raises(ValueError, match="rows <= 16"):
    add_norm_kernel.add_rms_norm(jnp.zeros((17, 64)), None, jnp.ones(64), EPS)


def test_fused_add_norm_is_validated_and_off_by_default():
  assert C.tiny().fused_add_norm is False
  with pytest.raises(ValueError, match="fused_add_norm"):
    C.tiny(fused_add_norm="yes")


def _decode_pair(dtype, n, seed=0):
  """(cfg, params, the decode step's inputs after an 8-token prefill) for B = 2 rows of N
  tokens (a chain)."""
  cfg = C.tiny()
  params = P.init_params(jax.random.key(seed), cfg, dtype, std=0.1)
  toks = jax.random.randint(jax.random.key(seed + 1), (2, 8 + n), 0, cfg.vocab_size)
  cache = LatentCache.zeros(cfg, 2, 32, dtype)
  _, cache, _ = T.prefill(cfg, params, cache, toks[:, :8])
  cache = cache.replace(lengths=jnp.full((2,), 8, jnp.int32))
  positions = jnp.broadcast_to(8 + jnp.arange(n, dtype=jnp.int32), (2, n))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (2, n, n))
  return cfg, params, (cache, toks[:, 8:], positions, mask)


def _decode(cfg, params, inputs, fused):
  c = dataclasses.replace(cfg, fused_add_norm=fused)
  step = jax.jit(lambda cache, t, p, m: T.decode(c, params, cache, t, p, m, tap_layers=(0, 2)))
  logits, cache, taps = step(*inputs)
  return np.asarray(logits, np.float64), np.asarray(taps, np.float64), cache.latent


def _count_kernel_calls(monkeypatch):
  calls = []
  real = add_norm_kernel.add_rms_norm
  monkeypatch.setattr(add_norm_kernel, "add_rms_norm",
                      lambda *a: calls.append(a[1] is None) or real(*a))
  return calls


def test_decode_one_token_fused_equals_xla_f32(monkeypatch):
  """ar (N = 1), f32: the same tokens, logits and taps within 1e-5, the same cache rows;
  the kernel made every norm: 1 without an add (the first), 2 per layer with one."""
  cfg, params, inputs = _decode_pair(jnp.float32, 1)
  want, want_taps, want_latent = _decode(cfg, params, inputs, False)
  calls = _count_kernel_calls(monkeypatch)
  got, taps, latent = _decode(cfg, params, inputs, True)
  assert calls == [True] + [False] * (2 * cfg.num_hidden_layers)
  np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  np.testing.assert_allclose(taps, want_taps, rtol=1e-5, atol=1e-5 * np.abs(want_taps).max())
  for a, b in zip(latent, want_latent):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_decode_one_token_fused_equals_xla_bf16(monkeypatch):
  """ar (N = 1), bf16: logits within 1e-2 of XLA's adds and norms. XLA (CPU here, and on a GPU
  under its default xla_allow_excess_precision) fuses the add into the norm and normalises the
  f32 sum, dropping the program's rounding of x + h to bf16 (~1% apart after 3 layers, the bf16
  noise itself); the kernel keeps it (as HF's bf16 residual). So the reference keeps it too: its
  norms see x + h through reduce_precision, which XLA does not drop."""
  cfg, params, inputs = _decode_pair(jnp.bfloat16, 1)
  real_norm = T.rms_norm
  monkeypatch.setattr(T, "rms_norm", lambda x, w, eps: real_norm(
      jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7), w, eps))
  want, want_taps, _ = _decode(cfg, params, inputs, False)
  monkeypatch.setattr(T, "rms_norm", real_norm)
  got, taps, _ = _decode(cfg, params, inputs, True)
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
  np.testing.assert_allclose(taps, want_taps, rtol=1e-2, atol=1e-2 * np.abs(want_taps).max())


def test_decode_above_one_token_is_unchanged(monkeypatch):
  """N = 4 with fused_add_norm: no kernel, the very same values as without."""
  cfg, params, inputs = _decode_pair(jnp.float32, 4)
  want, want_taps, _ = _decode(cfg, params, inputs, False)
  calls = _count_kernel_calls(monkeypatch)
  got, taps, _ = _decode(cfg, params, inputs, True)
  assert not calls
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(taps, want_taps)


def _lowered_k26_decode(n):
  """StableHLO of a 2-layer packed K2.6-share decode step (INT4 experts on the Mosaic kernels,
  the routing kernel, fused_add_norm) at N tokens, lowered for an abstract H200."""
  cfg = dataclasses.replace(bench_models.k26_share(layers=2), router_impl="pallas",
                            expert_backend="pallas", fused_add_norm=True)
  params = jax.eval_shape(lambda: pack.pack_for_decode(
      cfg, P.init_params(jax.random.key(0), cfg, jnp.bfloat16, int4_experts=True)))
  cache = jax.eval_shape(lambda: LatentCache.zeros(cfg, 1, 256, jnp.bfloat16))
  tokens = jax.ShapeDtypeStruct((1, n), jnp.int32)
  mask = jax.ShapeDtypeStruct((1, n, n), jnp.bool_)
  h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=h200)
  with jax.sharding.use_abstract_mesh(mesh):
    step = jax.jit(lambda p, c, t, pos, m: T.decode(cfg, p, c, t, pos, m))
    return step.trace(params, cache, tokens, tokens, mask).lower(
        lowering_platforms=("cuda",)).as_text()


def _triton_kernels(text):
  """[(kernel name, operand types)] of the Triton custom calls."""
  calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
  return [(re.search(r'name = "(\w+)"', line).group(1),
           line[line.rindex(" : (") + 4:line.rindex(") -> ")]) for line in calls]


def test_k26_share_decode_lowers_with_the_kernel_at_one_token():
  """One token (ar): 1 plain norm on the embedding + 2 adds-and-norms per layer on
  [1, 7168] bf16 rows, beside the routing kernel."""
  kernels = _triton_kernels(_lowered_k26_decode(1))
  row, w = "tensor<1x7168xbf16>", "tensor<7168xbf16>"
  assert [k for k in kernels if k[0] == "_norm_kernel"] == [("_norm_kernel", f"{row}, {w}")]
  assert [k for k in kernels if k[0] == "_add_norm_kernel"] == [
      ("_add_norm_kernel", f"{row}, {row}, {w}")] * 4
  assert any(k[0] == "_route_kernel" for k in kernels)
