"""INT4-resident routed experts equal the dequantised bf16 experts (bf16 tolerance)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax.checkpoint import quant
from kdtree_jax.checkpoint import int4
from kdtree_jax.target.moe import moe
from kdtree_jax.target.params import init_params


def test_pack_dequantize_round_trip():
  rng = np.random.default_rng(0)
  q = rng.integers(-8, 8, (3, 64, 5)).astype(np.int8)
  scale = rng.uniform(0.5, 2.0, (3, 2, 5)).astype(np.float32)
  w = int4.pack(q, scale)
  want = q.astype(np.float32) * np.repeat(np.asarray(jnp.asarray(scale, jnp.bfloat16),
                                                     np.float32), 32, axis=1)
  np.testing.assert_array_equal(np.asarray(int4.dequantize(w, jnp.float32)), want)
  assert w.shape == (3, 64, 5) and w.group == 32


def test_k_packed_stack_dequantises_to_the_same_weight():
  """pack_k permutes each 64-column block of the in-dim (a thread's 8 values in one 32-bit
  word, kpack's order): the dequantised [E, in, out] weight is unchanged, the stored columns are
  the numpy permutation of the independent column table; a non-multiple-of-64 in-dim stays."""
  w = int4.random_int4(jax.random.key(3), (2, 192, 40), 0.02)
  k = int4.pack_k(w)
  assert k.k_packed and not w.k_packed and int4.pack_k(k) is k
  np.testing.assert_array_equal(np.asarray(int4.dequantize(k), np.float32),
                                np.asarray(int4.dequantize(w), np.float32))
  q = np.asarray(w.packed.astype(jnp.int8)).reshape(2, 40, 3, 64)
  h, l, m = np.arange(64) // 32, (np.arange(64) % 32) // 8, np.arange(64) % 8
  stored_column = 8 * (4 * h + m // 2) + 2 * l + m % 2  # storage p holds logical column c(p)
  np.testing.assert_array_equal(np.asarray(k.packed.astype(jnp.int8)).reshape(2, 40, 3, 64),
                                q[..., stored_column])
  odd = int4.random_int4(jax.random.key(4), (1, 96, 8), 0.02)
  assert int4.pack_k(odd) is odd


def test_random_model_experts_are_zero_mean_and_kernel_stacks_use_every_code():
  """A random model's INT4 experts have no shared offset (a trained checkpoint's codes centre
  on 0; the full range's -0.5 code mean is an offset of -0.11 std in every weight, which the
  K2.6-share bench's tokens converged onto with depth), at the asked std; the kernels' test
  stacks still draw all 16 codes, -8 included."""
  cfg = C.tiny(hidden_size=64, moe_intermediate_size=64, n_routed_experts=8)
  moe_p = init_params(jax.random.key(0), cfg, jnp.float32, std=0.02, int4_experts=True)
  for name in ("gate", "up", "down"):
    w = np.asarray(int4.dequantize(moe_p["layers"][1]["moe"][name], jnp.float32), np.float64)
    assert abs(w.mean()) < 5 * 0.02 / np.sqrt(w.size), (name, w.mean())  # 5 sigma of the mean
    assert 0.018 < w.std() < 0.022, (name, w.std())  # scale jitter +-10%: E[j^2] = 1.0033
  full = np.asarray(int4.random_int4(jax.random.key(1), (8, 64, 64), 0.02).packed.astype(jnp.int8))
  assert set(np.unique(full).tolist()) == set(range(-8, 8))
  assert abs(full.mean() + 0.5) < 5 * 4.61 / np.sqrt(full.size)  # the full range's offset


def test_from_hf_matches_compressed_tensors_unpacking():
  rng = np.random.default_rng(1)
  q = rng.integers(-8, 8, (6, 64)).astype(np.int8)  # HF [out, in]
  packed = quant.pack_int4(q)
  scale = rng.uniform(0.5, 2.0, (6, 2)).astype(np.float32)
  q_ours, s_ours = int4.from_hf(packed, scale, (6, 64))
  np.testing.assert_array_equal(q_ours, q.T)
  np.testing.assert_array_equal(s_ours, scale.T)
  want = quant.dequant_int4(packed, scale, (6, 64), 32).T
  got = int4.dequantize(int4.pack(q_ours[None], s_ours[None]), jnp.float32)[0]
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-2)  # scale rounded to bf16


def test_int4_moe_equals_dequantised_bf16_moe():
  cfg = C.tiny(hidden_size=64, moe_intermediate_size=64, n_routed_experts=8)
  p = init_params(jax.random.key(0), cfg, jnp.float32, std=0.1)["layers"][1]["moe"]
  packed = dict(p, **{k: int4.quantize(p[k]) for k in ("gate", "up", "down")})
  dense = dict(p, **{k: int4.dequantize(packed[k], jnp.bfloat16) for k in ("gate", "up", "down")})
  dense = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 and a.ndim > 1
                       else a, dense)
  packed = dict(packed, router=dense["router"], shared=dense["shared"])
  x = jax.random.normal(jax.random.key(1), (40, cfg.hidden_size), jnp.bfloat16)
  y_int4 = moe(packed, cfg, x).astype(jnp.float32)
  y_bf16 = moe(dense, cfg, x).astype(jnp.float32)
  assert float(jnp.linalg.norm(y_int4 - y_bf16) / jnp.linalg.norm(y_bf16)) < 1e-2


def test_int4_checkpoint_loads_packed_and_matches_dequantised(tmp_path):
  """An INT4 (compressed-tensors) checkpoint loaded packed == loaded dequantised, bf16 tolerance."""
  import os  # pylint: disable=import-outside-toplevel
  import kdtree_jax  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant", "int4_k25")
  cfg, dense = kdtree_jax.load_hf_checkpoint(path, dtype=jnp.bfloat16)
  _, packed = kdtree_jax.target.checkpoint.load_hf_checkpoint(path, dtype=jnp.bfloat16,
                                                          int4_experts=True)
  gate = packed["layers"][1]["moe"]["gate"]
  assert isinstance(gate, int4.Int4Weight) and gate.packed.dtype == jnp.int4
  assert gate.shape == dense["layers"][1]["moe"]["gate"].shape
  # q * scale is exact in f32; both paths then round once to bf16: bit-identical.
  np.testing.assert_array_equal(np.asarray(int4.dequantize(gate, jnp.bfloat16), np.float32),
                                np.asarray(dense["layers"][1]["moe"]["gate"], np.float32))
  tokens = np.load(os.path.join(path, "reference.npz"))["tokens"]
  a = kdtree_jax.forward(cfg, packed, tokens)
  b = kdtree_jax.forward(cfg, dense, tokens)
  assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 1e-2


@pytest.mark.slow
def test_int4_experts_expert_parallel_on_8_devices():
  """Int4Weight stacks shard by the rules and the EP MoE equals the single-device one (f32)."""
  from kdtree_jax import sharding  # pylint: disable=import-outside-toplevel
  cfg = C.tiny(hidden_size=64, moe_intermediate_size=64, n_routed_experts=8,
               num_attention_heads=8)
  p = init_params(jax.random.key(0), cfg, jnp.float32, std=0.1)["layers"][1]["moe"]
  pk = dict(p, **{k: int4.quantize(p[k]) for k in ("gate", "up", "down")})
  x = jax.random.normal(jax.random.key(1), (24, cfg.hidden_size), jnp.float32)
  ref = moe(pk, cfg, x)
  for spec in ("expert=8", "tensor=2,expert=4"):
    mesh = sharding.make_mesh(spec)
    shard = sharding.param_shardings({"layers": [{"moe": pk}]}, mesh)["layers"][0]["moe"]
    placed = jax.device_put(pk, shard)
    assert placed["gate"].packed.sharding.spec[0] == "expert"
    with sharding.use_mesh(mesh):
      out = jax.jit(lambda p, x: moe(p, cfg, x))(placed, x)
    assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 1e-5, spec
