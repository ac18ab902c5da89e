"""pallas_kernels.skinny_dot (few-row dots over out-major weights) vs an f64 numpy reference in
Pallas interpret mode at K2.6's one-GPU-share shapes (K cut to 1024 where it is longer, plus one
full shape), the tuning heuristic, and the CUDA lowering for an abstract H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.skinny_dot import Tuning, default_tuning, skinny_dot, supports
from pallas_kernels.skinny_dot import tuning as tuning_lib

# (name, N, K) of pack.dot_t's weights on bench_k26_full (issue 13's listing)
SHAPES = [("qkv_a", 2112, 7168), ("o", 7168, 1024), ("router_gate_up", 896, 7168),
          ("q_b", 1536, 1536), ("shared_down", 7168, 256)]
CUT_K = 1024


def _inputs(m, n, k, dtype, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)).astype(dtype)
  return x, w


def _rel_to_f64(y, x, w):
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  got = np.asarray(y.astype(jnp.float32), np.float64)
  return np.linalg.norm(got - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("name,n,k", SHAPES)
def test_bf16_matches_f64(name, n, k, m):
  """bf16 in and out (one bf16 rounding of each output: ~2e-3), K cut to CUT_K."""
  del name
  x, w = _inputs(m, n, min(k, CUT_K), jnp.bfloat16)
  y = jax.jit(skinny_dot)(x, w)
  assert y.shape == (m, n) and y.dtype == jnp.bfloat16
  assert _rel_to_f64(y, x, w) <= 1e-2


@pytest.mark.parametrize("m", [1, 16])
def test_full_qkv_a_f32_out(m):
  """The full q_a | kv_a shape (K 7168, split K at M = 16), f32 output as the router's dot asks:
  bf16 products are exact in f32, so only f32 accumulation error is left."""
  x, w = _inputs(m, 2112, 7168, jnp.bfloat16, seed=1)
  y = jax.jit(lambda x, w: skinny_dot(x, w, preferred_element_type=jnp.float32))(x, w)
  assert y.dtype == jnp.float32
  assert _rel_to_f64(y, x, w) <= 1e-5


@pytest.mark.parametrize("m", [1, 5, 16])
def test_f32_inputs(m):
  x, w = _inputs(m, 896, CUT_K, jnp.float32, seed=2)
  y = jax.jit(skinny_dot)(x, w)
  assert y.dtype == jnp.float32
  assert _rel_to_f64(y, x, w) <= 1e-5


@pytest.mark.parametrize("m,tuning", [(1, Tuning(bn=4, bk=128, splits=4)),
                                      (5, Tuning(bn=32, bk=64, splits=2)),
                                      (16, Tuning(bn=64, bk=256, num_warps=8, splits=1))])
def test_explicit_tunings(m, tuning):
  """Other block shapes and K splits than the heuristic's (the bench's A/B rows)."""
  x, w = _inputs(m, 1536, CUT_K, jnp.float32, seed=3)
  assert supports(m, 1536, CUT_K, x.dtype, w.dtype, tuning)
  y = jax.jit(lambda x, w: skinny_dot(x, w, tuning=tuning))(x, w)
  assert _rel_to_f64(y, x, w) <= 1e-5


def test_dtype_as_xla():
  x, w = _inputs(1, 896, 256, jnp.bfloat16)
  for pref in (None, jnp.float32):
    want = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=pref)
    assert skinny_dot(x, w, preferred_element_type=pref).dtype == want.dtype


def test_supports_refuses():
  bf = jnp.bfloat16
  assert supports(16, 896, 7168, bf, bf)
  assert not supports(17, 896, 7168, bf, bf)                  # too many rows
  assert not supports(1, 896, 7168, jnp.float32, bf)          # mixed dtypes
  assert not supports(16, 8, 7168, bf, bf)                    # N < tl.dot's 16
  assert not supports(1, 896, 7168, bf, bf, Tuning(bn=4, bk=1024, splits=2))  # 3584 % 1024
  with pytest.raises(ValueError):
    skinny_dot(jnp.zeros((17, 256), bf), jnp.zeros((64, 256), bf))


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("name,n,k", SHAPES)
def test_heuristic(name, n, k, m):
  """The default tuning is valid and fills the GPU (>= 2 programs per SM) at K2.6's shapes."""
  del name
  t = default_tuning(m, n, k)
  assert supports(m, n, k, jnp.bfloat16, jnp.bfloat16, t)
  assert n // t.bn * t.splits >= tuning_lib.PROGRAMS_PER_SM * tuning_lib.NUM_SMS
  assert tuning_lib.parse(str(t)) == t


def _lower_text(fn, *structs):
  h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h200)):
    return jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("name,n,k", SHAPES)
def test_lowers_for_h200(name, n, k, m):
  """One Triton call per dot at the full shapes, no interpret-mode loop left."""
  del name
  sd = jax.ShapeDtypeStruct
  text = _lower_text(lambda x, w: skinny_dot(x, w, preferred_element_type=jnp.float32),
                     sd((m, k), jnp.bfloat16), sd((n, k), jnp.bfloat16))
  assert text.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.while" not in text
