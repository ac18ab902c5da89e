"""TargetConfig.expert_variants: overrides of the INT4 expert calls' promoted tunings by class
(`tuning.variant_overrides`), the in-step A/B of an expert-call form. The scope changes only the
class it names, typos fail at config time naming the field, and a decode step's expert calls
(traced on the kernel in GPU interpret mode) get exactly the tuning the override names."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from kdtree_jax.target import config as C
from kdtree_jax.target import pack
from kdtree_jax.target import params as P
from kdtree_jax.target import transformer as T
from kdtree_jax.target.cache import LatentCache
from pallas_kernels.grouped_matmul import api
from pallas_kernels.grouped_matmul import tuning

T1_DOWN_UNSPLIT = "once+ismem+cat+il+a2+k128+p8|once+ismem+cat+a2"
_API_DEFAULT_TUNING = api.default_tuning  # the real one: each spy below wraps it, not another spy


def test_override_changes_only_its_class_inside_its_scope():
  before = [tuning.promoted_variant(m, gated) for m in (8, 100, 300) for gated in (False, True)]
  with tuning.variant_overrides(f"8={T1_DOWN_UNSPLIT}; 520=s2+cat"):
    assert tuning.promoted_variant(8, gated=True) == "once+ismem+cat+il+a2+k128+p8"
    assert tuning.promoted_variant(8) == "once+ismem+cat+a2"
    assert tuning.promoted_variant(300) == tuning.promoted_variant(300, gated=True) == "s2+cat"
    assert tuning.promoted_variant(100) == before[2]  # T=2..32 not named: unchanged
    with tuning.variant_overrides(""):  # an inner empty scope: the defaults again
      assert tuning.promoted_variant(8) == before[0]
  assert [tuning.promoted_variant(m, g) for m in (8, 100, 300) for g in (False, True)] == before
  assert tuning.promoted_variant(8) == "once+ismem+cat+a2+p4"  # DEFAULT_VARIANTS' T=1 down


@pytest.mark.parametrize("spec,match", [("9=default", "BOUND"), ("8", "BOUND"), ("none=", "BOUND"),
                                        ("8=once+fast", "unknown tuning change"),
                                        ("263=a|b|c", "at most one")])
def test_bad_overrides_fail_at_config_time(spec, match):
  with pytest.raises(ValueError, match=match):
    tuning.parse_overrides(spec)
  with pytest.raises(ValueError, match="expert_variants"):
    C.tiny(expert_variants=spec)


def _int4_tunings(cfg, monkeypatch):
  """The INT4 tunings `api` picks while one decode step of a tiny INT4 model on the kernel (GPU
  interpret mode, D 512) is traced: [(M, K, N, gated, Tuning)]."""
  seen = []
  real = _API_DEFAULT_TUNING

  def spy(m, g, k, n, int4, *args, **kw):
    t = real(m, g, k, n, int4, *args, **kw)
    if int4:
      seen.append((m, k, n, kw.get("gated", False), t))
    return t

  monkeypatch.setattr(api, "default_tuning", spy)
  params = P.init_params(jax.random.key(0), cfg, jnp.bfloat16, int4_experts=True)
  packed = pack.pack_for_decode(cfg, params)
  cache = LatentCache.zeros(cfg, 1, 8, jnp.bfloat16)
  tokens, pos = jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32)
  mask = jnp.ones((1, 1, 1), bool)
  jax.eval_shape(lambda p: T.decode(cfg, p, cache, tokens, pos, mask)[0], packed)
  return seen


def test_decode_step_expert_calls_take_the_override(monkeypatch):
  cfg = C.tiny(hidden_size=512, moe_intermediate_size=128, n_routed_experts=8,
               num_experts_per_tok=3, n_group=1, topk_group=1, expert_backend="interpret")
  default = _int4_tunings(cfg, monkeypatch)
  variant = T1_DOWN_UNSPLIT + "+s3"  # + 3 stages: the tiny down call's K has one step (no p4)
  changed = _int4_tunings(dataclasses.replace(cfg, expert_variants=f"8={variant}"), monkeypatch)
  assert default and len(changed) == len(default)  # the step's INT4 calls were traced
  for (m, k, n, gated, got), (*_, was) in zip(changed, default):
    want = tuning.default_tuning(m, cfg.n_routed_experts, k, n, True, interpret=True,
                                 gated=gated, variant=variant)
    assert got == want, (m, k, n, gated)
    assert was == tuning.default_tuning(m, cfg.n_routed_experts, k, n, True, interpret=True,
                                        gated=gated)
  assert any(got != was for (*_, got), (*_, was) in zip(changed, default))
