"""TargetConfig.int4_k_interleaved: decode's INT4 routed stacks pair-packed ("kpairs",
kpairs.pack_int4_k_pairs) and the expert calls on Tuning.int4_k_interleaved (the PRMT-free
dequantise), exactly when the stacks are so.

Ground truth: the dequantise-first XLA path (each plain stack dequantised to bf16 by numpy,
q * scale rounded once, then the model's bf16 expert path on XLA). The layouts only permute
columns inside a 32-column scale group and the kpi dequantise gives the kp dequantise's bf16
values bit for bit (dq11: interpret mode, numpy on every nibble), so ON vs OFF is compared
BIT-EQUAL (same tunings otherwise, same MMAs in the same order); vs the ground truth within bf16
rounding (the kernel's per-expert products and the h = silu(g) * u rounding differ in order
from XLA's ragged_dot)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kdtree_jax.checkpoint import int4
from kdtree_jax.target import config as C
from kdtree_jax.target import grouped_matmul as gm
from kdtree_jax.target import moe
from kdtree_jax.target import pack
from kdtree_jax.target import params as P
from kdtree_jax.target import transformer as T
from kdtree_jax.target.cache import LatentCache
from pallas_kernels.grouped_matmul import api as gmm_api
from pallas_kernels.grouped_matmul import kernel as gmm_kernel
from pallas_kernels.grouped_matmul import kpack, kpairs
from pallas_kernels.grouped_matmul.tuning import Tuning

BF16_REL = 1e-2  # bf16 products and roundings in another order (the kernel vs XLA)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _numpy_dequantize(w: int4.Int4Weight) -> np.ndarray:
  """A plain stack's [E, in, out] weight as float32 of q * scale rounded once to bf16 (numpy
  only: the independent reference of every layout's dequantise)."""
  assert w.k_layout == "plain"
  q = np.asarray(w.packed.astype(jnp.int8), np.float32).transpose(0, 2, 1)  # [E, in, out]
  s = np.repeat(np.asarray(w.scale.astype(jnp.float32)), w.group, axis=1)
  return (q * s).astype(ml_dtypes.bfloat16).astype(np.float32)


def _stored_columns(w):
  return np.asarray(w.packed.astype(jnp.int8), np.int32)


@pytest.mark.parametrize("layout,table", [("kpack", kpack.STORED_COLUMN),
                                          ("kpairs", kpairs.STORED_COLUMN)])
def test_dequantize_undoes_every_layout(layout, table):
  """pack_k to each K layout stores, in every 64-column block, logical column table[p] at p (the
  kernels' own tables); dequantize of it equals numpy's q * scale of the plain stack exactly;
  re-laying between the layouts (and back to plain) gives the directly packed stack."""
  plain = int4.random_int4(jax.random.key(0), (3, 192, 40), 0.02)
  packed = int4.pack_k(plain, layout=layout)
  assert packed.k_layout == layout and packed.k_packed
  got, src = _stored_columns(packed), _stored_columns(plain)
  for b in range(192 // 64):
    np.testing.assert_array_equal(got[..., 64 * b:64 * (b + 1)], src[..., 64 * b + table])
  assert not np.array_equal(got, src)
  want = _numpy_dequantize(plain)
  for w in (plain, packed):
    np.testing.assert_array_equal(np.asarray(int4.dequantize(w), np.float32), want)
  other = "kpairs" if layout == "kpack" else "kpack"
  relaid = int4.pack_k(int4.pack_k(plain, layout=other), layout=layout)
  np.testing.assert_array_equal(_stored_columns(relaid), got)
  np.testing.assert_array_equal(_stored_columns(int4.pack_k(packed, layout="plain")), src)
  assert int4.pack_k(packed, layout=layout) is packed


def test_layout_checks():
  """An unknown layout is refused; an in-dim that is not a multiple of 64 stays plain; the old
  `k_packed` reads keep their meaning; donation deletes the input's buffer."""
  w = int4.random_int4(jax.random.key(1), (2, 128, 16), 0.02)
  with pytest.raises(ValueError, match="k_layout='kpi' must be one of"):
    int4.Int4Weight(w.packed, w.scale, k_layout="kpi")
  with pytest.raises(ValueError, match="unknown K layout"):
    int4.pack_k(w, layout="pairs")
  odd = int4.random_int4(jax.random.key(2), (2, 96, 16), 0.02)
  assert int4.pack_k(odd, layout="kpairs") is odd
  assert not w.k_packed and int4.pack_k(w).k_layout == "kpack"  # the default stays kpack
  donated = int4.pack_k(w, donate=True, layout="kpairs")
  assert w.packed.is_deleted() and donated.k_layout == "kpairs"


def test_stacks_and_tunings_must_agree():
  """One call's stacks share one layout; the layout arguments say kpairs exactly when the
  stacks are pair-packed; an explicit tuning that contradicts them is refused."""
  plain = int4.random_int4(jax.random.key(3), (4, 128, 64), 0.02)
  kp, kpi = int4.pack_k(plain), int4.pack_k(plain, layout="kpairs")
  assert gm.layout_args(kpi, kpi) == {"k_packed": True, "k_interleaved": True}
  assert gm.layout_args(kp) == {"k_packed": True, "k_interleaved": False}
  assert gm.layout_args(plain) == {"k_packed": False, "k_interleaved": False}
  with pytest.raises(ValueError, match="share one K layout"):
    gm.layout_args(kp, kpi)
  x = jax.random.normal(jax.random.key(4), (8, 128), jnp.bfloat16)
  sizes = jnp.asarray([3, 0, 5, 0], jnp.int32)
  t_kp = Tuning(rows=8, block_n=64, block_k=128, stages=2, a_operand="smem", int4_k_packed=True)
  t_kpi = Tuning(rows=8, block_n=64, block_k=128, stages=2, a_operand="smem",
                 int4_k_packed=True, int4_k_interleaved=True)
  with pytest.raises(ValueError, match="explicit tuning has int4_k_interleaved=False"):
    gmm_api.grouped_matmul(x, (kpi.packed, kpi.scale), sizes, backend="xla", tuning=t_kp,
                           **gm.layout_args(kpi))
  with pytest.raises(ValueError, match="explicit tuning has int4_k_interleaved=True"):
    gmm_api.grouped_matmul(x, (kp.packed, kp.scale), sizes, backend="xla", tuning=t_kpi,
                           **gm.layout_args(kp))
  with pytest.raises(ValueError, match="pass k_packed=True"):
    gmm_api.grouped_matmul(x, (kpi.packed, kpi.scale), sizes, backend="xla", k_packed=False,
                           k_interleaved=True)
  for w in (plain, kp, kpi):  # each layout through the model's entry: the same values (XLA)
    np.testing.assert_array_equal(
        np.asarray(gm.grouped_matmul(x, w, sizes, impl="xla"), np.float32),
        np.asarray(gm.grouped_matmul(x, plain, sizes, impl="xla"), np.float32))


def test_f16_x_on_pair_packed_stacks_takes_xla():
  """kpi's dequantise is bf16's: with f16 x the kernel does not take the call (auto -> XLA),
  and an explicit kernel backend says why."""
  plain = int4.random_int4(jax.random.key(5), (4, 128, 64), 0.02)
  kpi = int4.pack_k(plain, layout="kpairs")
  t = Tuning(rows=8, block_n=64, block_k=128, stages=2, int4_k_packed=True,
             int4_k_interleaved=True)
  x = jnp.zeros((8, 128), jnp.float16)
  assert not gmm_kernel.supports(x, 128, 64, 32, t)
  assert gmm_kernel.supports(x.astype(jnp.bfloat16), 128, 64, 32, t)
  with pytest.raises(ValueError, match="dequantises to bf16"):
    gm.grouped_matmul(x, kpi, jnp.asarray([8, 0, 0, 0], jnp.int32), impl="interpret")


# ---- the model: a MoE layer and a 2-layer INT4 model, kpairs on vs off ---------------------------

def _cfg(backend, on):
  return C.tiny(hidden_size=128, moe_intermediate_size=64, n_routed_experts=8,
                num_experts_per_tok=3, n_group=1, topk_group=1, num_hidden_layers=2,
                first_k_dense_replace=1, expert_backend=backend, int4_k_interleaved=on)


def _models(backend):
  """(cfg off, packed off, cfg on, packed on, the dequantise-first reference (cfg, packed)):
  one set of random INT4 weights, bf16."""
  off, on = _cfg(backend, False), _cfg(backend, True)
  params = P.init_params(jax.random.key(7), off, jnp.bfloat16, int4_experts=True)
  dense = [lp | {"moe": lp["moe"] | {n: jnp.asarray(_numpy_dequantize(lp["moe"][n]),
                                                    jnp.bfloat16)
                                     for n in ("gate", "up", "down")}} if "moe" in lp else lp
           for lp in params["layers"]]
  ref_cfg = _cfg("xla", False)
  ref = pack.pack_for_decode(ref_cfg, params | {"layers": dense})
  return (off, pack.pack_for_decode(off, params), on, pack.pack_for_decode(on, params),
          ref_cfg, ref)


@pytest.fixture
def tunings_seen(monkeypatch):
  """The (int4_k_packed, int4_k_interleaved) of every INT4 kernel call traced."""
  seen = []
  real = gmm_kernel.grouped_matmul_mgpu

  def spy(x_mk, stacks, *a, tuning, **kw):
    if len(stacks[0]) == 2:
      seen.append((tuning.int4_k_packed, tuning.int4_k_interleaved))
    return real(x_mk, stacks, *a, tuning=tuning, **kw)
  monkeypatch.setattr(gmm_kernel, "grouped_matmul_mgpu", spy)
  return seen


def test_decode_pack_follows_the_field():
  off, p_off, on, p_on, _, _ = _models("xla")
  layer = off.first_k_dense_replace
  assert pack.expert_k_layout(off) == "kpack" and pack.expert_k_layout(on) == "kpairs"
  for name in ("gate", "up", "down"):
    w_off, w_on = p_off["layers"][layer]["moe"][name], p_on["layers"][layer]["moe"][name]
    assert (w_off.k_layout, w_on.k_layout) == ("kpack", "kpairs")
    np.testing.assert_array_equal(np.asarray(int4.dequantize(w_on), np.float32),
                                  np.asarray(int4.dequantize(w_off), np.float32))
    relaid = pack.apply_pack_fields(on, p_off)["layers"][layer]["moe"][name]
    np.testing.assert_array_equal(_stored_columns(relaid), _stored_columns(w_on))
  assert pack.apply_pack_fields(off, p_off)["layers"][layer]["moe"]["gate"] is \
      p_off["layers"][layer]["moe"]["gate"]


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_moe_layer_kpairs_on_equals_off(backend, tunings_seen):
  """The packed MoE layer at 5 rows (the sorted glue) and 1 row (one-token path): ON ==
  OFF bit for bit; the kernel ran kpi exactly for the ON weights; both within bf16 rounding of
  the dequantise-first XLA layer."""
  off, p_off, on, p_on, ref_cfg, ref = _models(backend)
  layer = off.first_k_dense_replace
  for rows in (5, 1):
    x = jax.random.normal(jax.random.key(rows), (rows, off.hidden_size), jnp.bfloat16)
    tunings_seen.clear()
    got_off = np.asarray(moe.moe(p_off["layers"][layer]["moe"], off, x), np.float32)
    seen_off = list(tunings_seen)
    tunings_seen.clear()
    got_on = np.asarray(moe.moe(p_on["layers"][layer]["moe"], on, x), np.float32)
    np.testing.assert_array_equal(got_on, got_off)
    want = np.asarray(moe.moe(ref["layers"][layer]["moe"], ref_cfg, x), np.float32)
    assert rel(got_on, want) < BF16_REL
    if backend == "interpret":
      assert seen_off and set(seen_off) == {(True, False)}
      assert tunings_seen and set(tunings_seen) == {(True, True)}
    else:
      assert not seen_off and not tunings_seen


@pytest.mark.parametrize("n", [1, 5])
def test_two_layer_int4_decode_kpairs_on_equals_off(n, tunings_seen):
  """A 2-layer INT4 model (dense layer, MoE layer; the grouped-matmul kernel in GPU interpret
  mode) decodes an N-token step (ar N = 1, a causal chain N = 5) to the same logits bit for bit
  with the pair-packed experts as with the K-packed ones; both within bf16 rounding of the
  dequantise-first XLA model."""
  off, p_off, on, p_on, ref_cfg, ref = _models("interpret")
  tokens = jax.random.randint(jax.random.key(9), (1, n), 0, off.vocab_size)
  pos = jnp.arange(n, dtype=jnp.int32)[None]
  mask = jnp.tril(jnp.ones((n, n), bool))[None]

  def logits(cfg, params):
    cache = LatentCache.zeros(cfg, 1, 8, jnp.bfloat16)
    return np.asarray(T.decode(cfg, params, cache, tokens, pos, mask)[0], np.float32)
  got_off = logits(off, p_off)
  seen_off = set(tunings_seen)
  tunings_seen.clear()
  got_on = logits(on, p_on)
  np.testing.assert_array_equal(got_on, got_off)
  assert seen_off == {(True, False)} and set(tunings_seen) == {(True, True)}
  assert rel(got_on, logits(ref_cfg, ref)) < BF16_REL
