"""TargetConfig.work_list_kernel (`target/work_list_kernel.py`): the lean glue's index arrays as
one Pallas Triton program, bit-exact against the XLA glue (experts._xla_pair_glue) in Pallas
interpret mode; the MoE layer with the field on equal to it off; the CUDA lowering for an
abstract H200 is one Triton call and no XLA reduction."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax.target import experts, moe
from kdtree_jax.target import params as P
from kdtree_jax.target import work_list_kernel as wlk

E = 384  # K2.6's routed experts
K = 8


def _top_k_like(rng, t, e=E, k=K):
  """Random distinct experts per token [T, K] int32 (as top-k gives)."""
  return np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)


def _routings(t, e_l, e0, seed):
  """Named routings [T, K]: random; every token on the same K local experts; every pair on one
  local expert (duplicates: the glue does not assume distinct ids); no local pair at all."""
  rng = np.random.default_rng(seed)
  same = np.broadcast_to((e0 + np.arange(K) * 5) % E, (t, K))
  same = np.where((same >= e0) & (same < e0 + e_l), same, e0)  # all local
  far = (e0 + e_l + rng.integers(0, E - e_l, (t, K))) % E  # all outside [e0, e0 + E_l)
  return {"random": _top_k_like(rng, t), "same_k": same.astype(np.int32),
          "one_expert": np.full((t, K), e0 + e_l - 1, np.int32), "no_local": far.astype(np.int32)}


def _assert_glue_equal(idx, e_l, e0, rows):
  got = wlk.pair_glue(jnp.asarray(idx), e_l, e0, rows)
  want = experts._xla_pair_glue(jnp.asarray(idx), e_l, e0, rows)  # pylint: disable=protected-access
  assert len(got) == len(want) == 6
  for name, a, b in zip(("order", "pair_rows", "sizes", "ends", "h_rows", "items"), got, want):
    if b is None:
      assert a is None, name
      continue
    assert a.dtype == b.dtype == jnp.int32 and a.shape == b.shape, (name, a.shape, b.shape)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("t", [2, pytest.param(9, marks=pytest.mark.slow), 16,
                               pytest.param(64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("e_l,e0", [(48, 0), (48, 336), (48, 100), (8, 0), (8, 203)])
def test_bit_exact_against_xla_glue(t, e_l, e0):
  """Every output array equal, for each named routing, R = 8 and 16 (K2.6's: DDTree 15's verify
  is T = 16, E_l = 48, R = 16) and no R (XLA's expert path: no work list). ~5 s a case: T = 9
  and 64 are in the slow set."""
  for name, idx in _routings(t, e_l, e0, seed=t * 1000 + e_l + e0).items():
    for rows in (8, 16, None):
      try:
        _assert_glue_equal(idx, e_l, e0, rows)
      except AssertionError as err:
        raise AssertionError(f"routing {name}, R={rows}") from err


@pytest.mark.parametrize("t,rows", [(16, 64), (64, 32), (5, 8)])
def test_bit_exact_wide_windows_and_small_t(t, rows):
  """Windows wider than an expert's rows (one item per expert) and a T that is no power of 2."""
  for e_l, e0 in ((48, 48), (8, 376)):
    _assert_glue_equal(_routings(t, e_l, e0, seed=t + rows)["random"], e_l, e0, rows)


def test_the_routings_cover_their_cases():
  """The named routings are what they say (else the tests above check less than they claim)."""
  r = _routings(16, 48, 100, seed=0)
  local = lambda idx: (idx >= 100) & (idx < 148)
  assert local(r["same_k"]).all() and not local(r["no_local"]).any()
  assert len(np.unique(r["one_expert"])) == 1 and local(r["one_expert"]).all()
  assert 0 < local(r["random"]).sum() < r["random"].size


def test_supports_and_limits():
  assert not wlk.supports(1, K)  # one token keeps its own path
  assert wlk.supports(2, K) and wlk.supports(64, K) and not wlk.supports(65, K)
  with pytest.raises(ValueError, match="work list kernel"):
    wlk.pair_glue(jnp.zeros((65, K), jnp.int32), 48, 0, 8)
  assert C.tiny().work_list_kernel is False


def _moe_layer(cfg, dtype, int4, seed):
  p = P.init_params(jax.random.key(seed), cfg, dtype, int4_experts=int4)["layers"]
  return p[cfg.first_k_dense_replace]["moe"]


@pytest.mark.parametrize("t,glue", [(6, "auto"), (7, "sorted"), (1, "sorted")])
def test_moe_layer_on_equals_off_f32(t, glue):
  """The tiny preset's MoE layer (f32, XLA experts: no work list), field on vs off, bitwise
  (the same integers feed the same ops). T = 1 (sorted glue): the kernel does not run."""
  cfg = C.tiny(n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
               num_local_experts=5, expert_backend="xla", moe_glue=glue)
  p = _moe_layer(cfg, jnp.float32, False, 0)
  x = jax.random.normal(jax.random.key(t), (t, cfg.hidden_size), jnp.float32)
  on = dataclasses.replace(cfg, work_list_kernel=True)
  want = jax.jit(lambda p, x: moe.moe(p, cfg, x))(p, x)
  got = jax.jit(lambda p, x: moe.moe(p, on, x))(p, x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert float(jnp.max(jnp.abs(want))) > 0
  jaxpr = str(jax.make_jaxpr(lambda p, x: moe.moe(p, on, x))(p, x))
  assert ("pallas_call" in jaxpr) == (t > 1), "the kernel runs above one token only"


@pytest.mark.slow
def test_moe_layer_on_equals_off_on_the_expert_kernel_interpret():
  """INT4 experts on the grouped-matmul kernel (GPU interpret mode: the work list drives it),
  field on vs off, bitwise (test_lean_glue's slow case, T = 12: several windows at R = 8)."""
  cfg = C.tiny(hidden_size=512, moe_intermediate_size=128, n_routed_experts=8,
               num_experts_per_tok=3, n_group=1, topk_group=1, num_local_experts=6,
               expert_backend="interpret")
  p = _moe_layer(cfg, jnp.bfloat16, True, 1)
  x = jax.random.normal(jax.random.key(22), (12, cfg.hidden_size), jnp.bfloat16)
  want = jax.jit(lambda p, x: moe.moe(p, cfg, x))(p, x)
  on = dataclasses.replace(cfg, work_list_kernel=True)
  got = jax.jit(lambda p, x: moe.moe(p, on, x))(p, x)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  assert float(jnp.max(jnp.abs(want.astype(jnp.float32)))) > 0


def _lower_h200(t, e_l, rows):
  """The lowered module of the glue kernel for an abstract H200."""
  h200 = jax.sharding.AbstractDevice("NVIDIA H200", None, "cuda")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h200)):
    f = jax.jit(lambda idx: wlk.pair_glue(idx, e_l, 0, rows)[:5 if rows is None else 6])
    return f.trace(jax.ShapeDtypeStruct((t, K), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("t,e_l,rows", [(16, 48, 16), (64, 48, 8), (9, 8, None)])
def test_lowers_for_h200_as_one_triton_call(t, e_l, rows):
  text = _lower_h200(t, e_l, rows)
  assert text.count("__gpu$xla.gpu.triton") == 1
  assert "stablehlo.reduce" not in text  # no XLA glue left around it
