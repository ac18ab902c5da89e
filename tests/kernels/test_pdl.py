"""Tuning.pdl (programmatic dependent launch, pallas_kernels/pdl.py) in the INT4 grouped matmul
and the tree-verify kernels: interpret mode (where pdl is a no-op) still matches the references;
lowered for an abstract H200 the pdl modules carry `mosaic_gpu.uses_pdl` and one
griddepcontrol.wait, the default modules neither; TargetConfig.mosaic_pdl's trace-time scope
reaches the tunings the kernel APIs pick. The PTX order (wait before the first TMA / global load)
is checked by scripts/pdl_modules.py --ptx_dir (deviceless compile, notes/runtime.md)."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import pytest

import test_grouped_matmul_kernel as base  # tests/kernels is on sys.path (pytest's prepend mode)
import test_grouped_matmul_small_t as small_t
import test_tree_verify_attention as tva
from pallas_kernels import pdl
from pallas_kernels.grouped_matmul import api as gmm_api
from pallas_kernels.grouped_matmul.tuning import Tuning, apply_variant
from pallas_kernels.tree_verify import api as tv_api
from pallas_kernels.tree_verify.tuning import Tuning as TvTuning

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import pdl_modules  # pylint: disable=wrong-import-position


def _int4_interpret(**opts):
  """An interpret-mode (SMEM-operand) INT4 tuning with pdl."""
  return Tuning(**dict(dict(rows=32, block_n=64, block_k=128, stages=2, a_operand="smem",
                            pdl=True, **base.LEAN), **opts))


@pytest.mark.parametrize("opts", [dict(), dict(items_smem=True, slots=2)])
def test_int4_plain_with_pdl_interpret_matches_reference(opts):
  small_t._check_plain(_int4_interpret(**opts))


def test_int4_gated_with_pdl_interpret_matches_reference():
  small_t._check_gated(_int4_interpret(int4_interleave_stacks=True))


@pytest.mark.parametrize("b,n,h,l,lengths,tuning", [
    (2, 1, 8, 760, [759, 0], TvTuning(num_splits=5, swap_ab=True, merge="triton", pdl=True)),
    (1, 2, 8, 200, [190], TvTuning(num_splits=3, pdl=True)),
])
def test_tree_verify_with_pdl_interpret_matches_reference(b, n, h, l, lengths, tuning):
  q, cache, ln, mask = tva.make_inputs(b, n, h, l, lengths, seed=n * h + l)
  tva.check_against_reference(q, cache, ln, mask, tuning)


def test_variant_and_validation():
  t = apply_variant("once+pdl", Tuning(), 7168, 2048)
  assert t.pdl and t.store_once


@pytest.mark.parametrize("call", pdl_modules.CALLS)
def test_lowered_modules_carry_pdl_only_when_asked(call):
  """K2.6's shapes (INT4 T=1 / T=16 control rows, tree verify ar and DDTree 15), abstract H200."""
  for on in (False, True):
    for text in pdl_modules.module_texts(call, on):
      assert ("mosaic_gpu.uses_pdl" in text) == on, (call, on)
      assert text.count("griddepcontrol.wait") == int(on), (call, on)
      assert (text.count("griddepcontrol.launch_dependents") > 0) == on, (call, on)


def test_model_default_reaches_api_picked_tunings_only():
  x = jax.ShapeDtypeStruct((8, 512), jnp.bfloat16)
  stacks = [(jax.ShapeDtypeStruct((4, 256, 512), jnp.int4),
             jax.ShapeDtypeStruct((4, 16, 256), jnp.bfloat16))]
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  plan = lambda t=None: gmm_api._plan(x, stacks, sizes, "pallas", t)[1]
  assert not plan().pdl and not pdl.model_default_on()
  with pdl.model_default(True):
    assert plan().pdl
    assert not plan(Tuning(rows=8)).pdl  # an explicit tuning stays as given
    with pdl.model_default(False):
      assert not plan().pdl
  assert not plan().pdl


def test_model_default_reaches_tree_verify(monkeypatch):
  seen = []
  monkeypatch.setattr(tv_api, "tree_verify_attention_mgpu",
                      lambda *a, tuning=None, **kw: seen.append(tuning) or (None, None))
  q, cache, ln, mask = tva.make_inputs(1, 1, 8, 128, [100], seed=0)
  for on in (False, True):
    with pdl.model_default(on):
      tv_api.tree_verify_attention(q, cache, ln, mask, scale=0.1, backend="interpret")
  assert seen[0] is None and seen[1].pdl
  assert dataclasses.replace(seen[1], pdl=False) == tv_api.default_tuning(1, 1, 8, 128)


@pytest.mark.parametrize("on", [False, True])
def test_target_config_scopes_decode_layers(monkeypatch, on):
  """TargetConfig.mosaic_pdl: transformer.decode traces every layer's attention and FFN inside
  pdl.model_default(cfg.mosaic_pdl) (tiny config, CPU; the kernels themselves are checked above),
  and the same logits either way (pdl changes no value)."""
  # pylint: disable=import-outside-toplevel
  from kdtree_jax.target import config as C
  from kdtree_jax.target import mla, params as P, transformer
  from kdtree_jax.target.cache import LatentCache
  cfg = dataclasses.replace(C.tiny(), mosaic_pdl=on)
  params = P.init_params(jax.random.key(0), cfg, jnp.float32, std=0.1)
  seen = []
  attention = mla.absorbed_attention
  monkeypatch.setattr(mla, "absorbed_attention",
                      lambda *a, **kw: seen.append(pdl.model_default_on()) or attention(*a, **kw))
  cache = LatentCache.zeros(cfg, 1, 16, jnp.float32)
  args = (jnp.ones((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1, 1), bool))
  logits, _, _ = transformer.decode(cfg, params, cache, *args)
  assert seen == [on] * cfg.num_hidden_layers and not pdl.model_default_on()
  off, _, _ = transformer.decode(dataclasses.replace(cfg, mosaic_pdl=False), params, cache, *args)
  assert jnp.array_equal(logits, off)
