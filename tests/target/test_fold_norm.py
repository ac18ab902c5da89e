"""TargetConfig.fold_norm_weights (target/pack.py fold_norm_gains): attn_norm's gain folded into
the packed q_a | kv_a dot, the q LoRA norm's into q_b and the dense layer's mlp_norm into gate |
up, the norms' scales applied to the dots' outputs; and TargetConfig.one_token_rows_first: at
one token the MoE layer's experts' rows broadcast first, the router | shared dot reading row 0
(moe._one_token_moe). Against the unfolded packed layout (itself tested against the per-layer
weights and HF: tests/target/test_pack.py) in f32, with the same routing as XLA's routing of the
unfolded layout, against the f32 per-layer reference in bf16, and against HF's own logits on the
HF fixtures."""


import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax
from kdtree_jax.target import config as C
from kdtree_jax.target import moe
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
  return _run_with_routes(cfg, params, tokens, n, dtype)[:2]


def _run_with_routes(cfg, params, tokens, n, dtype=jnp.float32):
  """`_run`'s two logits and the decode step's expert ids per MoE layer ([B * n, K] each)."""
  b, s = tokens.shape
  split = s - n
  cache = LatentCache.zeros(cfg, b, s + 4, dtype)
  first, cache = jax.jit(lambda p, c, t: T.prefill(cfg, p, c, t)[:2])(
      params, cache, jnp.asarray(tokens[:, :split]))
  cache = cache.replace(lengths=jnp.full((b,), split, jnp.int32))
  pos = jnp.broadcast_to(split + jnp.arange(n, dtype=jnp.int32), (b, n))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))

  def step(p, c, t):
    routes = []
    return T.decode(cfg, p, c, t, pos, mask, routes=routes)[0], routes

  logits, routes = jax.jit(step)(params, cache, jnp.asarray(tokens[:, split:]))
  return first, logits, routes


def _assert_same_routes(got, want):
  assert len(got) == len(want) > 0
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_fold_replaces_the_norm_gains_and_their_dots():
  """With the flag, the packed layer's qkv_a_t and q_b_t become their folded forms (columns
  times the gains), attn_norm and q_a_norm are gone; the dense layer's gate_up_t likewise with
  mlp_norm; a MoE layer keeps its mlp_norm and router | shared dot; nothing else changes;
  without it (the default) the packed layout is as before."""
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
    assert set(fp["attn"]) == set(pl["attn"]) - {"qkv_a_t", "q_b_t", "q_a_norm"} | {
        "qkv_a_t_folded", "q_b_t_folded"}
    if "mlp" in pl:  # the dense layer
      np.testing.assert_allclose(fp["mlp"]["gate_up_t_folded"],
                                 pl["mlp"]["gate_up_t"] * lp["mlp_norm"][None, :], rtol=1e-7)
      assert set(fp["mlp"]) == set(pl["mlp"]) - {"gate_up_t"} | {"gate_up_t_folded"}
      assert set(fp) == set(pl) - {"attn_norm", "mlp_norm"}
    else:
      assert set(fp["moe"]) == set(pl["moe"]) and "router_gate_up_t" in fp["moe"]
      np.testing.assert_array_equal(fp["mlp_norm"], lp["mlp_norm"])
      assert set(fp) == set(pl) - {"attn_norm"}
  assert "mlp" in plain["layers"][0] and "moe" in plain["layers"][1]
  assert pack.fold_norm_gains(cfg, plain) is plain


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_folded_f32_matches_unfolded(name):
  """f32: prefill and one-token / 5-token decode logits of the folded packed layout within f32
  rounding of the unfolded one, the same greedy tokens and the same experts chosen."""
  cfg, params = _model(name)
  plain = pack.pack_for_decode(cfg, params)
  fcfg = cfg.replace(fold_norm_weights=True)
  folded = pack.pack_for_decode(fcfg, params)
  assert "qkv_a_t_folded" in folded["layers"][1]["attn"]
  assert "gate_up_t_folded" in folded["layers"][0]["mlp"]
  tokens = _tokens(cfg)
  for n in (1, 5):
    *got, got_routes = _run_with_routes(fcfg, folded, tokens, n)
    *want, want_routes = _run_with_routes(cfg, plain, tokens, n)
    for g, w in zip(got, want):
      assert rel(g, w) <= F32_REL, (name, n)
      np.testing.assert_array_equal(np.argmax(g, -1), np.argmax(w, -1))
    _assert_same_routes(got_routes, want_routes)


# The routing kernel's one-token path (interpret mode on a CPU): one routing group.
KERNEL_ROUTING = dict(n_group=1, topk_group=1, router_impl="pallas")


def _kernel_routed_model(std=0.1):
  cfg = C.tiny(**CONFIGS["k2_ratio"], **KERNEL_ROUTING)
  return cfg, _random_gains(P.init_params(jax.random.key(5), cfg, jnp.float32, std=std), 5)


def _barriers(cfg, params, tokens):
  """How many optimization barriers one one-token decode step's program has."""
  cache = LatentCache.zeros(cfg, 1, tokens.shape[1] + 1, jnp.float32)
  pos = jnp.zeros((1, 1), jnp.int32)
  mask = jnp.ones((1, 1, 1), bool)
  jaxpr = jax.make_jaxpr(lambda p: T.decode(cfg, p, cache, tokens[:1, :1], pos, mask)[0])(params)
  return str(jaxpr).count("optimization_barrier")


def test_one_token_moe_f32_routes_as_xla_routing_unfolded():
  """f32, one token (batch 1: the MoE's one-token path, T = 1): one_token_rows_first's MoE
  (the experts' rows broadcast first, the router | shared dot reading row 0) through the routing
  kernel on the unfolded layout against the same layout routed by XLA without it (an
  independent routing): logits within f32 rounding, the same argmax and the same expert ids in
  every MoE layer. The router logits are the same f32 dot of the same normalised row; only
  where the row comes from changes. fold_norm_weights alone does not take the path."""
  cfg, params = _kernel_routed_model()
  cfg = cfg.replace(one_token_rows_first=False)  # the default since s29: both sides explicit
  plain_cfg = cfg.replace(router_impl="xla")
  plain = pack.pack_for_decode(plain_cfg, params)
  rcfg = cfg.replace(one_token_rows_first=True)
  tokens = _tokens(cfg)[:1]
  moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
  assert _barriers(rcfg, plain, tokens) == moe_layers  # the rows-first path runs
  assert _barriers(cfg, plain, tokens) == 0
  fold_cfg = cfg.replace(fold_norm_weights=True)
  assert _barriers(fold_cfg, pack.pack_for_decode(fold_cfg, params), tokens) == 0
  *got, got_routes = _run_with_routes(rcfg, plain, tokens, 1)
  *want, want_routes = _run_with_routes(plain_cfg, plain, tokens, 1)
  for g, w in zip(got, want):
    assert rel(g, w) <= F32_REL
    np.testing.assert_array_equal(np.argmax(g, -1), np.argmax(w, -1))
  _assert_same_routes(got_routes, want_routes)
  assert len(got_routes) == moe_layers and got_routes[0].shape == (1, cfg.num_experts_per_tok)


def test_one_token_moe_bf16_within_bf16_of_the_f32_reference():
  """bf16, one token through the routing kernel with both flags (fold and rows-first): within
  bf16 rounding of the f32 per-layer forward of the same bf16-valued weights (XLA's routing)."""
  cfg, params = _kernel_routed_model(std=0.05)
  tokens = _tokens(cfg)[:1]
  bf16 = _bf16(params)
  reference = jax.tree.map(lambda w: w.astype(jnp.float32), bf16)
  ref = _run(cfg.replace(router_impl="xla"), reference, tokens, 1)
  fcfg = cfg.replace(fold_norm_weights=True, one_token_rows_first=True)
  packed = pack.pack_for_decode(fcfg, bf16)
  got = _run(fcfg, packed, tokens, 1, jnp.bfloat16)
  for g, w in zip(got, ref):
    assert rel(g, w) < BF16_REL, rel(g, w)
  row = jnp.ones((1, cfg.hidden_size), jnp.bfloat16)  # the router logits stay f32 sums
  assert moe.router_and_shared(packed["layers"][1]["moe"], row, wide=True)[0].dtype == jnp.float32


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
  fcfg = cfg.replace(fold_norm_weights=True)
  folded = pack.pack_for_decode(fcfg, params)
  assert all("attn_norm" not in lp for lp in folded["layers"])
  assert rel(kdtree_jax.forward(fcfg, folded, tokens), hf_logits) < HF_REL, name


@pytest.mark.parametrize("name", FIXTURES)
def test_hf_fixture_one_token_routes_unchanged_f32(name):
  """On each HF fixture in f32: a one-token decode step (batch 1) of the folded layout (the
  routing kernel and the rows-first MoE where the fixture has one routing group) against the
  unfolded layout routed by XLA: logits within f32 rounding, the same argmax, the same expert
  ids in every MoE layer."""
  cfg, params = kdtree_jax.load_hf_checkpoint(os.path.join(FIXTURE_ROOT, name), dtype=jnp.float32)
  with np.load(os.path.join(FIXTURE_ROOT, name, "reference.npz")) as z:
    tokens = z["tokens"][:1, :16]
  plain_cfg = cfg.replace(router_impl="xla")
  fcfg = cfg.replace(fold_norm_weights=True, one_token_rows_first=True,
                     router_impl="pallas" if cfg.n_group == 1 else "xla")
  *got, got_routes = _run_with_routes(fcfg, pack.pack_for_decode(fcfg, params), tokens, 1)
  *want, want_routes = _run_with_routes(plain_cfg, pack.pack_for_decode(plain_cfg, params),
                                        tokens, 1)
  for g, w in zip(got, want):
    assert rel(g, w) <= F32_REL, name
    np.testing.assert_array_equal(np.argmax(g, -1), np.argmax(w, -1))
  _assert_same_routes(got_routes, want_routes)
