"""TargetConfig.fold_norm_weights (target/pack.py fold_norm_gains): attn_norm's gain folded into
the packed q_a | kv_a dot and the q LoRA norm's into q_b, the norms' scales applied to the dots'
outputs. Against the unfolded packed layout (itself tested against the per-layer weights and HF:
tests/target/test_pack.py) in f32, against the f32 per-layer reference in bf16, and against HF's
own logits on the HF fixtures."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax
from kdtree_jax.target import config as C
from kdtree_jax.target import pack
from kdtree_jax.target import params as P
from kdtree_jax.target import transformer as T
from kdtree_jax.target.cache import LatentCache

FIXTURE_ROOT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
FIXTURES = sorted(d for d in (os.listdir(FIXTURE_ROOT) if os.path.isdir(FIXTURE_ROOT) else [])
                  if os.path.exists(os.path.join(FIXTURE_ROOT, d, "reference.npz")))
F32_REL = 1e-5   # the fold reorders one product per weight: f32 rounding
BF16_REL = 1e-2  # bf16 rounding (tests/target/test_pack.py's bf16 tolerance)
HF_REL = 1e-4    # tests/target/test_hf_parity.py's tolerance against HF's own logits

# q LoRA at K2's 3:1 ratio (the two LoRA norms' mean squares from one reduction), a q LoRA whose
# mean squares each norm reduces itself (17 | 16: rows of gcd 1), and no q LoRA (q in the dot)
CONFIGS = {"k2_ratio": dict(q_lora_rank=96, kv_lora_rank=32),
           "own_reductions": dict(q_lora_rank=17, kv_lora_rank=16),
           "no_q_lora": dict(q_lora_rank=None)}


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _random_gains(params, seed):
  """Every norm gain drawn around 1 (init_params' are ones: a fold that dropped a gain, or
  applied the wrong one, would still pass)."""
  leaves, treedef = jax.tree.flatten_with_path(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = [(1 + 0.3 * jax.random.normal(k, w.shape)).astype(w.dtype)
         if jax.tree_util.keystr(path).endswith("norm']") else w
         for (path, w), k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, out)


def _model(name, seed=5, std=0.1):
  cfg = C.tiny(**CONFIGS[name])
  return cfg, _random_gains(P.init_params(jax.random.key(seed), cfg, jnp.float32, std=std), seed)


def _bf16(params):
  """The weights in bf16, the routing bias kept f32 (as init_params and the loader hold it)."""
  leaves, treedef = jax.tree.flatten_with_path(params)
  return jax.tree.unflatten(treedef, [w if jax.tree_util.keystr(path).endswith("['bias']")
                                      else w.astype(jnp.bfloat16) for path, w in leaves])


def _tokens(cfg, seed=6):
  return np.asarray(jax.random.randint(jax.random.key(seed), (2, 12), 0, cfg.vocab_size))


def _run(cfg, params, tokens, n, dtype=jnp.float32):
  """(prefill logits of tokens[:, :-n], logits of one decode step of the last n tokens, causal)."""
  b, s = tokens.shape
  split = s - n
  cache = LatentCache.zeros(cfg, b, s + 4, dtype)
  first, cache = jax.jit(lambda p, c, t: T.prefill(cfg, p, c, t)[:2])(
      params, cache, jnp.asarray(tokens[:, :split]))
  cache = cache.replace(lengths=jnp.full((b,), split, jnp.int32))
  pos = jnp.broadcast_to(split + jnp.arange(n, dtype=jnp.int32), (b, n))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
  step = jax.jit(lambda p, c, t: T.decode(cfg, p, c, t, pos, mask)[0])
  return first, step(params, cache, jnp.asarray(tokens[:, split:]))


def test_fold_replaces_the_norm_gains_and_their_dots():
  """With the flag, the packed layer's qkv_a_t and q_b_t become their folded forms (columns
  times the gains), attn_norm and q_a_norm are gone, nothing else changes; without it (the
  default) the packed layout is as before."""
  cfg, params = _model("k2_ratio")
  plain = pack.pack_for_decode(cfg, params)
  assert not cfg.fold_norm_weights
  folded = pack.pack_for_decode(cfg.replace(fold_norm_weights=True), params)
  for lp, fp, pl in zip(params["layers"], folded["layers"], plain["layers"]):
    assert "attn_norm" in pl and "qkv_a_t_folded" not in pl["attn"]
    assert "attn_norm" not in fp and "q_a_norm" not in fp["attn"]
    assert "qkv_a_t" not in fp["attn"] and "q_b_t" not in fp["attn"]
    np.testing.assert_allclose(fp["attn"]["qkv_a_t_folded"],
                               pl["attn"]["qkv_a_t"] * lp["attn_norm"][None, :], rtol=1e-7)
    np.testing.assert_allclose(fp["attn"]["q_b_t_folded"],
                               pl["attn"]["q_b_t"] * lp["attn"]["q_a_norm"][None, :], rtol=1e-7)
    assert set(fp) == set(pl) - {"attn_norm"}
    assert set(fp["attn"]) == set(pl["attn"]) - {"qkv_a_t", "q_b_t", "q_a_norm"} | {
        "qkv_a_t_folded", "q_b_t_folded"}
  assert pack.fold_norm_gains(cfg, plain) is plain


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_folded_f32_matches_unfolded(name):
  """f32: prefill and one-token / 5-token decode logits of the folded packed layout within f32
  rounding of the unfolded one, the same greedy tokens."""
  cfg, params = _model(name)
  plain = pack.pack_for_decode(cfg, params)
  folded = pack.pack_for_decode(cfg.replace(fold_norm_weights=True), params)
  assert "qkv_a_t_folded" in folded["layers"][1]["attn"]
  tokens = _tokens(cfg)
  for n in (1, 5):
    for got, want in zip(_run(cfg, folded, tokens, n), _run(cfg, plain, tokens, n)):
      assert rel(got, want) <= F32_REL, (name, n)
      np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))


def test_folded_bf16_within_bf16_of_the_f32_reference():
  """bf16 weights and cache: the folded packed layout's logits within bf16 rounding of the f32
  per-layer forward of the same (bf16-valued) weights, the bound the unfolded bf16 layout meets
  too (checked beside it; on this model both sit at 0.7-0.8e-2: std 0.05 weights, since at
  init_params' 0.1 the unfolded layout itself exceeds 1e-2 against f32 over three layers)."""
  cfg, params = _model("k2_ratio", std=0.05)
  tokens = _tokens(cfg)
  bf16 = _bf16(params)
  reference = jax.tree.map(lambda w: w.astype(jnp.float32), bf16)
  for n in (1, 5):
    ref = _run(cfg, reference, tokens, n)
    for fold in (False, True):
      packed = pack.pack_for_decode(cfg.replace(fold_norm_weights=fold), bf16)
      for got, want in zip(_run(cfg, packed, tokens, n, jnp.bfloat16), ref):
        assert rel(got, want) < BF16_REL, (fold, n, rel(got, want))


@pytest.mark.parametrize("name", FIXTURES)
def test_hf_checkpoint_loading_is_unaffected(name):
  """A loaded HF checkpoint's config leaves the fold off and its params keep every norm gain
  (packed as before); folded, the packed prefill still matches HF's own logits."""
  path = os.path.join(FIXTURE_ROOT, name)
  cfg, params = kdtree_jax.load_hf_checkpoint(path, dtype=jnp.float32)
  assert not cfg.fold_norm_weights
  assert all("attn_norm" in lp for lp in pack.pack_for_decode(cfg, params)["layers"])
  with np.load(os.path.join(path, "reference.npz")) as z:
    tokens, hf_logits = z["tokens"], z["logits"]
  folded = pack.pack_for_decode(cfg.replace(fold_norm_weights=True), params)
  assert all("attn_norm" not in lp for lp in folded["layers"])
  assert rel(kdtree_jax.forward(cfg, folded, tokens), hf_logits) < HF_REL, name
