"""The routing kernel reads the router's E columns straight out of the packed router|shared dot's
[T, E + 2F] output (`moe.router_and_shared(wide=True)`, no slice made for it): the kernel on wider
logits vs a numpy top-k, the packed MoE layer on that path within f32 rounding of a numpy
per-token loop (a spy checks the kernel got the wide logits), and what the CUDA lowering of a
K2.6-share layer hands the kernel."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import bench_models
from kdtree_jax.target import config as C
from kdtree_jax.target import moe, pack, route_kernel
from kdtree_jax.target import params as P
from test_moe_glue import _numpy_routed  # neighbours' references (pytest imports by folder)
from test_route_kernel import SCALE, _grid_logits, _numpy_route

@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("e,width,k", [(384, 896, 8), (100, 120, 6)])
def test_route_kernel_reads_the_first_e_columns(t, e, width, k):
  """Wider logits (K2.6 share: 384 router + 2 x 256 shared columns; 100 of 120: the padded lanes
  reach past the array) whose extra columns would win every pick if read: the same ids and
  weights as on the E columns, bitwise, and as numpy's top-k on them; the one-token form too."""
  rng = np.random.default_rng(t * 7 + e)
  logits, bias = _grid_logits(rng, t, e)
  wide = np.concatenate([logits, np.full((t, width - e), 50.0, np.float32)], axis=1)
  ids, w = route_kernel.route_pallas(jnp.asarray(logits), jnp.asarray(bias), k, True, SCALE)
  ids_w, w_w = route_kernel.route_pallas(jnp.asarray(wide), jnp.asarray(bias), k, True, SCALE)
  np.testing.assert_array_equal(np.asarray(ids_w), np.asarray(ids))
  np.testing.assert_array_equal(np.asarray(w_w), np.asarray(w))
  want_ids, want_w, _ = _numpy_route(logits, bias, k, True, SCALE)
  np.testing.assert_array_equal(np.asarray(ids_w), want_ids)
  np.testing.assert_allclose(np.asarray(w_w), want_w, rtol=1e-6, atol=1e-6)
  if t == 1:
    items, w1 = route_kernel.route_one_token(jnp.asarray(logits), jnp.asarray(bias), k, True,
                                            SCALE, 48)
    items_w, w1_w = route_kernel.route_one_token(jnp.asarray(wide), jnp.asarray(bias), k, True,
                                                 SCALE, 48)
    np.testing.assert_array_equal(np.asarray(items_w), np.asarray(items))
    np.testing.assert_array_equal(np.asarray(w1_w), np.asarray(w1))


def test_route_kernel_refuses_logits_narrower_than_the_bias():
  with pytest.raises(ValueError, match="route kernel"):
    route_kernel.route_pallas(jnp.zeros((2, 300)), jnp.zeros(384), 8, True, 1.0)


def _packed_layer(cfg, dtype, seed=1):
  params = P.init_params(jax.random.key(seed), cfg, dtype)
  layer = cfg.first_k_dense_replace
  packed = pack.pack_for_decode(cfg, params)["layers"][layer]["moe"]
  assert "router_gate_up_t" in packed  # the joint router|shared dot runs
  return params["layers"][layer]["moe"], packed


def _tiny(router, glue="auto"):
  return C.tiny(n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1,
                num_local_experts=10, expert_backend="xla", router_impl=router, moe_glue=glue)


@pytest.mark.parametrize("t,router", [(1, "pallas"), (1, "xla"), (6, "pallas")])
def test_moe_layer_on_the_joint_logits_equals_numpy_f32(t, router, monkeypatch):
  """f32 packed layer vs a numpy per-token loop over the routed experts (on the per-layer params)
  plus numpy's shared SwiGLU; the routing kernel (router pallas) gets the joint dot's whole
  [T, E + 2F] output, the XLA routing none."""
  cfg = _tiny(router)
  per_layer, p = _packed_layer(cfg, jnp.float32)
  widths = []
  real_call = route_kernel._call  # pylint: disable=protected-access
  monkeypatch.setattr(route_kernel, "_call",
                      lambda logits, *a: widths.append(logits.shape[1]) or real_call(logits, *a))
  x = np.asarray(jax.random.normal(jax.random.key(20 + t), (t, cfg.hidden_size)), np.float32)
  s = {n: np.asarray(per_layer["shared"][n], np.float64) for n in ("gate", "up", "down")}
  a, b = x @ s["gate"], x @ s["up"]
  want = _numpy_routed(per_layer, dataclasses.replace(cfg, router_impl="xla"), x)
  want = want + (a / (1 + np.exp(-a)) * b) @ s["down"]
  got = np.asarray(moe.moe(p, cfg, jnp.asarray(x)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  assert widths == ([p["router_gate_up_t"].shape[0]] if router == "pallas" else [])


def _lower_k26_layer(t):
  """StableHLO of one packed K2.6-share MoE layer (INT4 experts on the Mosaic kernels, the
  routing kernel) lowered for an abstract H200."""
  cfg = dataclasses.replace(bench_models.k26_share(layers=2), router_impl="pallas",
                            expert_backend="pallas")
  build = lambda: pack.pack_for_decode(cfg, P.init_params(jax.random.key(0), cfg, jnp.bfloat16,
                                                          int4_experts=True))
  p = jax.eval_shape(build)["layers"][1]["moe"]
  x = jax.ShapeDtypeStruct((t, cfg.hidden_size), jnp.bfloat16)
  h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h200)):
    return jax.jit(lambda p, x: moe.moe(p, cfg, x)).trace(p, x).lower(
        lowering_platforms=("cuda",)).as_text()


def _triton_operands(text):
  calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
  return [re.findall(r": \((tensor<\w+>), tensor<", line)[-1] for line in calls]  # the signature


@pytest.mark.parametrize("t", [1, 16])
def test_k26_lowering_hands_the_kernel_the_joint_dot_output(t):
  """K2.6 share (384 experts, shared F 256): the Triton routing call's logits operand is the
  [T, 896] dot output, not a [T, 384] slice of it."""
  assert _triton_operands(_lower_k26_layer(t)) == [f"tensor<{t}x896xf32>"]
