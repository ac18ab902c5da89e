"""TargetConfig.router_split_k: the joint router | shared gate | up dot as S K-partials that the
routing kernel sums, routes on and turns into the shared expert's SwiGLU activation
(`route_kernel.route_with_shared`, `pack.dot_t_partials`): the kernel against numpy (routing:
HF's top-k on the summed logits; the activation: silu(gate) * up on the dtype-rounded sums), the
MoE layer against a numpy per-token loop (f32) and against the field off (bf16), where the path
is taken, and what the CUDA lowering of a K2.6-share layer hands the kernel."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import bench_models
from kdtree_jax.target import config as C
from kdtree_jax.target import moe, pack, route_kernel
from kdtree_jax.target import params as P
from test_joint_logits import _packed_layer, _tiny, _triton_operands, numpy_moe_layer
from test_route_kernel import SCALE, _assert_separated, _numpy_route
from test_route_kernel import TestLowersForH200 as _Lowering  # (not collected again here)


def _exact_partials(rng, s, t, e, f):
  """[S, T, E + 2F] f32 partials whose sums over S are exact in any order (every partial and
  partial sum a small multiple of 1/64), with the router columns' sums on the coarse grid of
  test_route_kernel (exact ties among experts, different choices far apart)."""
  logits = rng.integers(-24, 24, (t, e)) * 8  # in units of 1/64: the 1/8 grid
  logits[:, [0, e - 1]] = 192  # 3.0 at experts 0 and E-1: the largest, tied
  shared = rng.integers(-160, 160, (t, 2 * f))
  total = np.concatenate([logits, shared], axis=1)
  parts = rng.integers(-64, 64, (s - 1, t, e + 2 * f))
  parts = np.concatenate([parts, (total - parts.sum(axis=0))[None]])
  bias = (rng.integers(-3, 4, e) / 16).astype(np.float32)
  bias[[0, e - 1]] = 0.25
  return (parts / 64).astype(np.float32), total / 64, bias


def _numpy_shared(total, e, f, dtype):
  """silu(gate) * up in float64 from the gate and up sums rounded to dtype, rounded to dtype."""
  gate, up = (np.asarray(jnp.asarray(total[:, e + i * f:e + (i + 1) * f], jnp.float32)
                         .astype(dtype).astype(jnp.float32), np.float64) for i in (0, 1))
  return gate / (1 + np.exp(-gate)) * up


@pytest.mark.parametrize("s,t,e,f,k", [(16, 16, 384, 256, 8), (4, 5, 100, 24, 6),
                                       (2, route_kernel.MAX_TOKENS, 384, 256, 8)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_routes_the_summed_partials_and_makes_the_shared_activation(s, t, e, f, k, dtype):
  rng = np.random.default_rng(s * 100 + t + e)
  parts, total, bias = _exact_partials(rng, s, t, e, f)
  want_ids, want_w, choice = _numpy_route(total[:, :e].astype(np.float32), bias, k, True, SCALE)
  _assert_separated(choice)
  ids, w, h = route_kernel.route_with_shared(jnp.asarray(parts), jnp.asarray(bias), k, True,
                                             SCALE, dtype)
  assert ids.shape == (t, k) and w.shape == (t, k) and h.shape == (t, f) and h.dtype == dtype
  np.testing.assert_array_equal(np.asarray(ids), want_ids)  # ties to the lower index included
  np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-6, atol=1e-6)
  want_h = _numpy_shared(total, e, f, dtype)
  got_h = np.asarray(h.astype(jnp.float32), np.float64)
  if dtype == jnp.float32:
    np.testing.assert_allclose(got_h, want_h, rtol=1e-6, atol=1e-6 * np.abs(want_h).max())
  else:  # one bf16 rounding of the f64 value (8 significant bits: half an ulp <= 2^-8 relative)
    np.testing.assert_allclose(got_h, want_h, rtol=2.0 ** -8, atol=1e-30)


def test_refuses_a_width_that_is_not_e_plus_two_f():
  with pytest.raises(ValueError, match="E \\+ 2F"):
    route_kernel.route_with_shared(jnp.zeros((2, 4, 101)), jnp.zeros(100), 8, True, 1.0,
                                   jnp.float32)
  with pytest.raises(ValueError, match="route kernel"):
    route_kernel.route_with_shared(jnp.zeros((2, route_kernel.MAX_TOKENS + 1, 104)),
                                   jnp.zeros(100), 8, True, 1.0, jnp.float32)
  with pytest.raises(ValueError, match="router_split_k"):
    C.tiny(router_split_k=-1)


@pytest.mark.parametrize("lead", [(5,), (2, 3)])
def test_partials_sum_to_the_dot(lead):
  """dot_t_partials' S slices: each the dot of its D slice, summing to x @ w^T (f32 HIGHEST on
  f32 inputs), for any leading dims of x."""
  x = jax.random.normal(jax.random.key(0), (*lead, 64))
  w = jax.random.normal(jax.random.key(1), (48, 64))
  parts = pack.dot_t_partials(x, w, 4)
  assert parts.shape == (4, *lead, 48) and parts.dtype == jnp.float32
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  for s in range(4):
    want = x64[..., 16 * s:16 * (s + 1)] @ w64[:, 16 * s:16 * (s + 1)].T
    np.testing.assert_allclose(np.asarray(parts[s], np.float64), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
  with pytest.raises(ValueError, match="does not divide"):
    pack.dot_t_partials(x, w, 5)


def spy_partials(monkeypatch, module=route_kernel, name="route_with_shared"):
  """The shapes of the partials (first argument) each call of module.name gets, recorded by a
  wrapper around the real function (a spy, not a mock)."""
  shapes = []
  real = getattr(module, name)
  monkeypatch.setattr(module, name,
                      lambda parts, *a, **kw: shapes.append(parts.shape) or real(parts, *a, **kw))
  return shapes


def test_moe_layer_with_split_router_equals_numpy_f32(monkeypatch):
  """f32 packed layer, T=6, S=4: the routed experts (numpy per-token loop on the per-layer
  params) plus numpy's shared SwiGLU, and the kernel got the [S, T, E + 2F] partials."""
  cfg = dataclasses.replace(_tiny("pallas"), router_split_k=4)
  per_layer, p = _packed_layer(cfg, jnp.float32)
  shapes = spy_partials(monkeypatch)
  x = np.asarray(jax.random.normal(jax.random.key(26), (6, cfg.hidden_size)), np.float32)
  want = numpy_moe_layer(per_layer, cfg, x)
  got = np.asarray(moe.moe(p, cfg, jnp.asarray(x)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert shapes == [(4, 6, p["router_gate_up_t"].shape[0])]


def test_the_layer_passes_its_router_warps(monkeypatch):
  """cfg.router_warps reaches the shared form's call (the lowering test checks that the value
  becomes the Triton program's num_warps)."""
  cfg = dataclasses.replace(_tiny("pallas"), router_split_k=2, router_warps=4)
  _, p = _packed_layer(cfg, jnp.float32)
  seen = []
  real = route_kernel.route_with_shared
  monkeypatch.setattr(route_kernel, "route_with_shared",
                      lambda *a, **kw: seen.append(kw.get("num_warps")) or real(*a, **kw))
  moe.moe(p, cfg, jax.random.normal(jax.random.key(4), (5, cfg.hidden_size)))
  assert seen == [4]


def test_bf16_layer_routes_as_with_the_field_off(monkeypatch):
  """bf16, T=9: the same expert ids as XLA's dot, sum and SwiGLU (field off), the outputs within
  bf16 rounding of each other."""
  cfg = _tiny("pallas")
  _, p = _packed_layer(cfg, jnp.bfloat16)
  x = jax.random.normal(jax.random.key(9), (9, cfg.hidden_size), jnp.bfloat16)
  routes_off, routes_on = [], []
  off = moe.moe(p, cfg, x, routes_off)
  shapes = spy_partials(monkeypatch)
  on = moe.moe(p, dataclasses.replace(cfg, router_split_k=2), x, routes_on)
  assert len(shapes) == 1
  np.testing.assert_array_equal(np.asarray(routes_on[0]), np.asarray(routes_off[0]))
  off, on = np.asarray(off, np.float32), np.asarray(on, np.float32)
  np.testing.assert_allclose(on, off, rtol=1e-2, atol=1e-2 * np.abs(off).max())


@pytest.mark.parametrize("change,t,taken", [
    ({}, 6, True), ({}, 1, False), ({"router_split_k": 0}, 6, False),
    ({"router_impl": "xla"}, 6, False), ({"router_split_k": 3}, 6, False),  # 3 does not divide D
    ({"moe_glue": "dense"}, 6, False)])
def test_where_the_path_is_taken(change, t, taken):
  cfg = dataclasses.replace(_tiny("pallas"), **{"router_split_k": 4, **change})
  _, p = _packed_layer(cfg, jnp.float32)
  assert moe._shared_in_routing_kernel(p, cfg, t) is taken  # pylint: disable=protected-access
  unpacked = P.init_params(jax.random.key(1), cfg, jnp.float32)["layers"][1]["moe"]
  assert not moe._shared_in_routing_kernel(unpacked, cfg, t)  # pylint: disable=protected-access


def test_k26_lowering_hands_the_kernel_the_partials():
  """K2.6 share (384 experts, shared F 256) at T=16 with S=16: one Triton call, on the
  [16, 16, 896] partials, and no other reduction of them before it."""
  cfg = dataclasses.replace(bench_models.k26_share(layers=2), router_impl="pallas",
                            expert_backend="pallas", router_split_k=16)
  build = lambda: pack.pack_for_decode(cfg, P.init_params(jax.random.key(0), cfg, jnp.bfloat16,
                                                          int4_experts=True))
  p = jax.eval_shape(build)["layers"][1]["moe"]
  x = jax.ShapeDtypeStruct((16, cfg.hidden_size), jnp.bfloat16)
  text = _Lowering.lower_text(lambda p, x: moe.moe(p, cfg, x), p, x)
  assert _triton_operands(text) == ["tensor<16x16x896xf32>"]
