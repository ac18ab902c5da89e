"""Parity with Hugging Face transformers' DeepseekV3ForCausalLM, from stored fixtures (no torch needed).

The fixtures under tests/fixtures/hf/<name>/ are real HF checkpoints written by
scripts/make_hf_fixtures.py (see notes/hf_fixtures.md): config.json, safetensors (sharded with an
index for some), reference.npz (`tokens` int32 [B, S], `logits` f32 [B, S, V] from the HF model in
f32, causal prefill from position 0) and meta.json (versions, the config values the script set).
"""

import dataclasses
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax
from kdtree_jax.target import config as C

FIXTURE_ROOT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
FIXTURES = sorted(
    d for d in (os.listdir(FIXTURE_ROOT) if os.path.isdir(FIXTURE_ROOT) else [])
    if os.path.exists(os.path.join(FIXTURE_ROOT, d, "reference.npz")))

# What scripts/make_hf_fixtures.py writes; a missing one means the fixtures were not regenerated.
EXPECTED = {
    "k2_qlora_yarn32", "noqlora_group4_yarn64_sharded", "plainrope_group2", "k25_real_rope",
    "k25_wrapper",
}

REL_TOL = 1e-4
ARGMAX_AGREEMENT = 0.99


def _path(name):
  return os.path.join(FIXTURE_ROOT, name)


def _meta(name):
  with open(os.path.join(_path(name), "meta.json")) as f:
    return json.load(f)


def _reference(name):
  with np.load(os.path.join(_path(name), "reference.npz")) as z:
    return z["tokens"], z["logits"]


def test_all_fixtures_present():
  assert EXPECTED <= set(FIXTURES), f"missing HF fixtures: {sorted(EXPECTED - set(FIXTURES))}"


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_files_consistent(name):
  """Shards named by the index exist; reference shapes match the config."""
  path = _path(name)
  tokens, logits = _reference(name)
  cfg = C.load_hf_config(path)
  assert tokens.dtype == np.int32 and tokens.ndim == 2
  assert logits.dtype == np.float32 and logits.shape == tokens.shape + (cfg.vocab_size,)
  assert tokens.min() >= 0 and tokens.max() < cfg.vocab_size
  assert np.isfinite(logits).all()
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = set(json.load(f)["weight_map"].values())
    assert len(files) > 1
    assert all(os.path.exists(os.path.join(path, f)) for f in files)
  else:
    assert os.path.exists(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("name", FIXTURES)
def test_config_parses_and_matches(name):
  """load_hf_config reads back every value the generator set (rope, routing, eps, shapes)."""
  cfg = C.load_hf_config(_path(name))
  want = _meta(name)["set_config"]
  fields = {f.name for f in dataclasses.fields(C.TargetConfig)}
  for key, value in want.items():
    if key == "rope_scaling" or key not in fields:
      continue
    got = getattr(cfg, key)
    if isinstance(value, float):
      assert math.isclose(got, value, rel_tol=1e-12), (key, got, value)
    else:
      assert got == value, (key, got, value)
  assert cfg.rope_theta == want["rope_theta"]
  rs = want["rope_scaling"]
  if rs is None:
    assert cfg.rope_scaling is None
  else:
    assert cfg.rope_scaling is not None
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim"):
      assert getattr(cfg.rope_scaling, key) == rs[key], (key, getattr(cfg.rope_scaling, key), rs[key])
  # Spot checks that do not go through meta.json (guards against a regenerated meta drifting).
  spot = {
      "k2_qlora_yarn32": dict(q_lora_rank=24, n_group=1, topk_group=1, first_k_dense_replace=1,
                              norm_topk_prob=True, rms_norm_eps=1e-6, factor=32.0, beta_fast=1.0),
      "noqlora_group4_yarn64_sharded": dict(q_lora_rank=None, n_group=4, topk_group=2,
                                            first_k_dense_replace=2, norm_topk_prob=False,
                                            rms_norm_eps=1e-5, factor=64.0, beta_fast=32.0),
      "plainrope_group2": dict(n_group=2, topk_group=1, first_k_dense_replace=1,
                               routed_scaling_factor=2.827, n_shared_experts=1, rms_norm_eps=1e-2),
      "k25_real_rope": dict(factor=64.0, beta_fast=32.0, original_max_position_embeddings=4096,
                            max_position_embeddings=262144),
      "k25_wrapper": dict(weight_prefix="language_model.", q_lora_rank=24, factor=64.0),
  }.get(name, {})
  for key, value in spot.items():
    obj = cfg.rope_scaling if key in ("factor", "beta_fast", "original_max_position_embeddings") else cfg
    assert getattr(obj, key) == value, (key, getattr(obj, key), value)
  if name != "k25_wrapper":
    assert cfg.weight_prefix == ""
  if name == "plainrope_group2":
    assert cfg.rope_scaling is None


@pytest.fixture(scope="module", params=FIXTURES)
def hf_logits(request):
  name = request.param
  cfg, params = kdtree_jax.load_hf_checkpoint(_path(name), dtype=jnp.float32)
  tokens, ref = _reference(name)
  logits = np.asarray(kdtree_jax.forward(cfg, params, jnp.asarray(tokens)), dtype=np.float32)
  return name, logits, ref


def test_logits_match_hf(hf_logits):
  name, logits, ref = hf_logits
  assert logits.shape == ref.shape, (name, logits.shape, ref.shape)
  err = float(np.linalg.norm(logits - ref) / np.linalg.norm(ref))
  assert err < REL_TOL, f"{name}: relative L2 error {err:.3e} vs HF (tolerance {REL_TOL}){_diagnose(name, err)}"


def _diagnose(name, err):
  """Names the known mistakes whose effect on this fixture (meta.json `sensitivity`) matches err."""
  sens = _meta(name).get("sensitivity", {})
  close = [k for k, v in sens.items() if v > REL_TOL and abs(v - err) <= 0.02 * v]
  if not close:
    return ""
  return ("; this is the size of the change HF's model shows under: " + ", ".join(close) +
          " (see notes/hf_fixtures.md)")


def test_argmax_matches_hf(hf_logits):
  name, logits, ref = hf_logits
  agree = float((logits.argmax(-1) == ref.argmax(-1)).mean())
  assert agree >= ARGMAX_AGREEMENT, f"{name}: argmax agrees on only {agree:.2%} of positions"
