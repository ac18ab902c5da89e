"""TargetConfig.route_work_list: the routing kernel's second launch (`route_kernel.pair_layout`,
Pallas interpret mode on a CPU) emits the lean glue's index arrays bitwise equal to the XLA glue
(`experts.lean_pair_layout`: order, rank, sizes, ends, the work list), the MoE layer with it
bitwise equal to the lean path, and the K2.6 share's layer lowers for CUDA with it."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax.target import experts, moe, route_kernel
from kdtree_jax.target import params as P
from test_joint_logits import lower_k26_layer  # neighbours' helpers (pytest imports by folder)


def _routing(t, k, e, seed, lo=0):
  """Random distinct experts per token in [lo, e) [T, K] int32 (as top-k gives)."""
  rng = np.random.default_rng(seed)
  return np.stack([lo + rng.choice(e - lo, k, replace=False) for _ in range(t)]).astype(np.int32)


def _assert_layouts_equal(idx, e_l, rows):
  got = route_kernel.pair_layout(jnp.asarray(idx), e_l, rows)
  want = experts.lean_pair_layout(jnp.asarray(idx), e_l, 0, rows)
  names = ("order", "rank", "sizes", "ends", "items")
  for name, g, w in zip(names, got, want):
    if w is None:
      assert g is None, name
      continue
    assert g.dtype == jnp.int32 and g.shape == w.shape, (name, g.shape, w.shape)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
  return got


@pytest.mark.parametrize("t", [2, 5, 16, 64])
@pytest.mark.parametrize("k,e,e_l,rows", [(8, 384, 48, 16), (8, 384, 48, 8), (8, 384, 48, 64),
                                          (8, 384, 48, None), (3, 8, 6, 8), (3, 8, 8, 16)])
def test_pair_layout_bitwise_equals_xla_glue(t, k, e, e_l, rows):
  idx = _routing(t, k, e, seed=t * 1000 + e_l * 10 + (rows or 0))
  order, rank, sizes, ends, _ = _assert_layouts_equal(idx, e_l, rows)
  key = np.where(idx.reshape(-1) < e_l, idx.reshape(-1), e_l)  # an independent check too
  np.testing.assert_array_equal(np.asarray(order), np.argsort(key, kind="stable"))
  np.testing.assert_array_equal(np.asarray(rank)[np.asarray(order)], np.arange(t * k))
  np.testing.assert_array_equal(np.asarray(sizes), np.bincount(key, minlength=e_l + 1)[:e_l])
  np.testing.assert_array_equal(np.asarray(ends), np.cumsum(np.asarray(sizes)))


@pytest.mark.parametrize("t", [2, 16, 64])
def test_pair_layout_all_pairs_elsewhere(t):
  """No pair routed here: sizes and ends 0, the work list all 0, the order the identity."""
  idx = _routing(t, 8, 384, seed=t, lo=48)
  order, _, sizes, ends, items = _assert_layouts_equal(idx, 48, 16)
  assert not np.asarray(sizes).any() and not np.asarray(ends).any()
  assert not np.asarray(items).any()
  np.testing.assert_array_equal(np.asarray(order), np.arange(t * 8))


def test_pair_layout_one_expert_many_windows():
  """Every token routes to experts 0..7 (all local): 8 experts of T rows, each over several
  R-row windows; the other 40 experts empty."""
  t = 64
  idx = np.tile(np.arange(8, dtype=np.int32), (t, 1))
  _, _, sizes, _, items = _assert_layouts_equal(idx, 48, 16)
  np.testing.assert_array_equal(np.asarray(sizes)[:8], [t] * 8)
  assert int(np.sum(np.asarray(items)[3])) == 8 * t  # every row stored once


def _with_layout_launch(cfg, monkeypatch):
  """cfg with route_work_list on; the returned list counts `pair_layout` calls (the layer must
  take the new path, not fall back to the XLA glue)."""
  calls, real = [], route_kernel.pair_layout
  monkeypatch.setattr(route_kernel, "pair_layout", lambda *a: calls.append(a) or real(*a))
  return dataclasses.replace(cfg, route_work_list=True), calls


def _moe_cfg(t_backend, **kw):
  return C.tiny(hidden_size=512, moe_intermediate_size=128, n_routed_experts=8,
                num_experts_per_tok=3, n_group=1, topk_group=1, num_local_experts=6,
                expert_backend=t_backend, router_impl="pallas", moe_glue="sorted", **kw)


@pytest.mark.parametrize("t", [2, 5, 16])
def test_moe_layer_bitwise_equals_lean_xla_experts(t, monkeypatch):
  """expert_backend "xla" (no work list): the layer with route_work_list == without, bitwise."""
  cfg = _moe_cfg("xla")
  p = P.init_params(jax.random.key(2), cfg, jnp.float32)["layers"][cfg.first_k_dense_replace]
  p = p["moe"]
  x = jax.random.normal(jax.random.key(30 + t), (t, cfg.hidden_size), jnp.float32)
  want = jax.jit(lambda p, x: moe.moe(p, cfg, x))(p, x)
  on, calls = _with_layout_launch(cfg, monkeypatch)
  got = jax.jit(lambda p, x: moe.moe(p, on, x))(p, x)
  assert len(calls) == 1
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert float(jnp.max(jnp.abs(want))) > 0


@pytest.mark.slow
@pytest.mark.parametrize("t", [5, 12])
def test_moe_layer_bitwise_equals_lean_on_the_kernel_interpret(t, monkeypatch):
  """INT4 experts on the Mosaic kernels (GPU interpret mode), D 512 (the gated call splits K):
  the layer with the kernel-built work list == the lean path's, bitwise."""
  cfg = _moe_cfg("interpret")
  p = P.init_params(jax.random.key(1), cfg, jnp.bfloat16, int4_experts=True)["layers"]
  p = p[cfg.first_k_dense_replace]["moe"]
  x = jax.random.normal(jax.random.key(10 + t), (t, cfg.hidden_size), jnp.bfloat16)
  want = jax.jit(lambda p, x: moe.moe(p, cfg, x))(p, x)
  on, calls = _with_layout_launch(cfg, monkeypatch)
  got = jax.jit(lambda p, x: moe.moe(p, on, x))(p, x)
  assert len(calls) == 1
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert float(jnp.max(jnp.abs(want.astype(jnp.float32)))) > 0


def _triton_results(text):
  calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line]
  return [line.rsplit("->", 1)[1].strip() for line in calls]


def test_k26_share_lowers_for_cuda_with_the_layout_launch():
  """T=16 (ddtree 15): the routing call, then one layout call taking its [128] ids and giving
  order, rank [128], sizes, ends [48] and the work list [4, 56]; without the field, the
  routing call alone."""
  off = _triton_results(lower_k26_layer(16, route_work_list=False))
  on = _triton_results(lower_k26_layer(16, route_work_list=True))
  assert len(off) == 1 and len(on) == 2, (off, on)
  assert on[0] == off[0]
  shapes = re.findall(r"tensor<([\dx]+)xi32>", on[1])
  assert shapes == ["128", "128", "48", "48", "4x56"], on[1]
