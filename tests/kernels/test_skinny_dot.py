"""pallas_kernels.skinny_dot (few-row dots over out-major weights) vs an f64 numpy reference in
Pallas interpret mode at K2.6's one-GPU-share shapes (K cut to 1024 where it is longer, plus one
full shape), the tuning heuristic, the CUDA lowering for an abstract H200, and pack.dot_t /
a packed model's decode step with TargetConfig.dense_dot_impl="pallas" vs "xla"."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax.target import pack
from kdtree_jax.target import params as P
from kdtree_jax.target import transformer as T
from kdtree_jax.target.cache import LatentCache
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
                                      (1, Tuning(bn=2, bk=64, splits=2, unroll=4)),
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
  assert not supports(1, 896, 7168, bf, bf, Tuning(bn=4, bk=1024, unroll=2))  # 7 steps
  assert not supports(16, 896, 7168, bf, bf, Tuning(bn=16, bk=512, unroll=2))  # M > 1
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


def test_dot_t_pallas_matches_xla_and_falls_back():
  """pack.dot_t(impl="pallas") on [B, S, K] x: the kernel's values where it takes the dot; XLA's
  dot_general itself for more than 16 rows or an asked precision; an unknown impl refused."""
  x, w = _inputs(2 * 5, 896, 256, jnp.float32, seed=4)
  x = x.reshape(2, 5, 256)
  want = pack.dot_t(x, w)
  got = pack.dot_t(x, w, impl="pallas")
  assert got.shape == want.shape == (2, 5, 896)
  assert _rel_to_f64(got.reshape(10, 896), x.reshape(10, 256), w) <= 1e-5
  hidden = lambda f: "pallas_call" in str(jax.make_jaxpr(f)(x, w))
  assert hidden(lambda x, w: pack.dot_t(x, w, impl="pallas"))
  big = jnp.concatenate([x, x], axis=1)  # 20 rows: XLA's dot
  assert "pallas_call" not in str(
      jax.make_jaxpr(lambda x, w: pack.dot_t(x, w, impl="pallas"))(big, w))
  assert not hidden(lambda x, w: pack.dot_t(x, w, impl="pallas",
                                            precision=jax.lax.Precision.HIGHEST))
  with pytest.raises(ValueError):
    pack.dot_t(x, w, impl="cublas")


@pytest.mark.parametrize("b,n", [(1, 1), (2, 5)])
def test_decode_with_pallas_dense_dots_matches_xla(b, n):
  """A packed f32 model's decode step (mla's q_a | kv_a, q_b, o, the dense layer's MLP and the
  shared expert through pack.dot_t) with dense_dot_impl="pallas" vs "xla": the same logits up to f32 summation order
  (B x N rows: 1 (the multiply-sum) and 10 (tl.dot)); the kernel is in the step's program."""
  cfg = C.tiny(qk_rope_head_dim=16)  # q_a | kv_a: 32 + 32 + 16 = 80 rows, a multiple of 16
  params = pack.pack_for_decode(cfg, P.init_params(jax.random.key(5), cfg, jnp.float32, std=0.1))
  tokens = jax.random.randint(jax.random.key(6), (b, 8), 0, cfg.vocab_size)
  cache = LatentCache.zeros(cfg, b, 12, jnp.float32)
  _, cache, _ = T.prefill(cfg, params, cache, tokens[:, :8 - n])
  cache = cache.replace(lengths=jnp.full((b,), 8 - n, jnp.int32))
  pos = jnp.broadcast_to(8 - n + jnp.arange(n, dtype=jnp.int32), (b, n))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
  step = lambda cfg: (lambda c, t: T.decode(cfg, params, c, t, pos, mask)[0])
  pallas_cfg = dataclasses.replace(cfg, dense_dot_impl="pallas")
  want = jax.jit(step(cfg))(cache, tokens[:, 8 - n:])
  got = jax.jit(step(pallas_cfg))(cache, tokens[:, 8 - n:])
  jaxpr = str(jax.make_jaxpr(step(pallas_cfg))(cache, tokens[:, 8 - n:]))
  dense, moe_layers = cfg.first_k_dense_replace, cfg.num_hidden_layers - cfg.first_k_dense_replace
  # qkv_a, q_b, o per layer; the dense MLP's gate | up and down; the shared expert's down (the
  # f32 router | shared gate | up dot is HIGHEST precision: XLA's)
  assert jaxpr.count("pallas_call") >= 3 * cfg.num_hidden_layers + 2 * dense + moe_layers
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-5


def test_bench_variants_are_valid_and_distinct():
  """The bench's rows (importable beside the other benches: its flags are its own): every
  variant it runs is a tuning the kernel takes, and none repeats the default under a new name."""
  from pallas_kernels.grouped_matmul import bench as moe_bench  # pylint: disable=import-outside-toplevel,unused-import
  from pallas_kernels.skinny_dot import bench  # pylint: disable=import-outside-toplevel
  for m in (1, 16):
    for n, k, _ in bench.SHAPES.values():
      default = bench.variant_tuning("default", m, n, k)
      assert default == default_tuning(m, n, k)
      for name in ("u1", "x2", "b2", "w8+s1"):
        t = bench.variant_tuning(name, m, n, k)
        assert t is None or (t != default and supports(m, n, k, jnp.bfloat16, jnp.bfloat16, t))
  assert bench.variant_tuning("n32k256w4s3x4", 16, 2112, 7168) == Tuning(32, 256, splits=4)
  with pytest.raises(ValueError):
    bench.variant_tuning("q3", 1, 896, 7168)
