"""TargetConfig.o_proj_k_splits (mla.out_proj over the packed "o_t", pack.split_k_dot_t): the
attention's output projection as S partial dots over K / S columns, f32 partials summed and
rounded once. Checked against an independent f64 numpy x @ W^T (f32 and bf16), the whole
decode of a 2-layer tiny model with S = 4 against S = 1 (f32), the one-row path and S = 1
being the single dot (S = 1 is today's program), and the refusal of an S that does not split K
into parts of a multiple of 16 columns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.config_overrides import with_overrides
from kdtree_jax.target import config as C
from kdtree_jax.target import mla
from kdtree_jax.target import pack
from kdtree_jax.target import params as P
from kdtree_jax.target import transformer as T
from kdtree_jax.target.cache import LatentCache

F32_REL = 1e-6   # one dot's f32 rounding (K <= 1024 terms), split or not
BF16_REL = 1e-2  # the output rounded to bf16 once (2^-9 relative per element)
DECODE_F32_REL = 1e-5  # two layers of f32 rounding, the o sums in another order


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _x_w(dtype, rows=16, k=1024, n=768, seed=0):
  """x [1, rows, K] and an out-major weight [N, K] (K2.6's share: K = 8 heads x 128)."""
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (1, rows, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)).astype(dtype)
  return x, w


def _numpy_reference(x, w):
  """x @ w^T in f64 numpy from the (rounded) input values."""
  return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


@pytest.mark.parametrize("splits", [1, 2, 4, 8, 16])
def test_split_dot_equals_f64_reference_f32(splits):
  x, w = _x_w(jnp.float32)
  got = jax.jit(pack.split_k_dot_t, static_argnums=2)(x, w, splits)
  assert got.shape == (1, 16, 768) and got.dtype == jnp.float32
  assert rel(got, _numpy_reference(x, w)) < F32_REL


@pytest.mark.parametrize("splits", [1, 4, 8])
def test_split_dot_equals_f64_reference_bf16(splits):
  """bf16 in, bf16 out: within bf16's one rounding of the f64 product of the same values,
  as the single dot is."""
  x, w = _x_w(jnp.bfloat16)
  got = jax.jit(pack.split_k_dot_t, static_argnums=2)(x, w, splits)
  assert got.dtype == jnp.bfloat16
  assert rel(got, _numpy_reference(x, w)) < BF16_REL


def test_split_dot_is_one_batched_dot_of_f32_partials():
  """S > 1 lowers to ONE dot_general batched over S (f32 [S, ..., N]) and a sum over S;
  S = 1 is dot_t's own jaxpr (the default program unchanged)."""
  x, w = _x_w(jnp.bfloat16)
  text = str(jax.make_jaxpr(lambda a, b: pack.split_k_dot_t(a, b, 4))(x, w))
  assert text.count("dot_general") == 1
  assert "f32[4,1,16,768]" in text  # the partials: S leading, f32
  assert "reduce_sum" in text
  plain = str(jax.make_jaxpr(pack.dot_t)(x, w))
  assert str(jax.make_jaxpr(lambda a, b: pack.split_k_dot_t(a, b, 1))(x, w)) == plain


def _packed_attn(cfg, seed=3):
  params = P.init_params(jax.random.key(seed), cfg, jnp.float32, std=0.1)
  return pack.pack_for_decode(cfg, params)["layers"][0]["attn"]


@pytest.mark.parametrize("rows", [1, 5])
def test_out_proj_split_equals_f64_reference(rows):
  """mla.out_proj on the packed o_t [D, H * Dv] with S = 4 (tiny: K = 64, 16 columns a part):
  the heads flattened, against numpy's f64 o @ o_t^T; at one row the single dot (the same
  jaxpr as S = 1)."""
  cfg = C.tiny(num_hidden_layers=2)
  attn = _packed_attn(cfg)
  o = jax.random.normal(jax.random.key(4), (1, rows, cfg.num_attention_heads, cfg.v_head_dim))
  split_cfg = cfg.replace(o_proj_k_splits=4)
  got = mla.out_proj(attn, split_cfg, o)
  want = _numpy_reference(np.asarray(o).reshape(1, rows, -1), attn["o_t"])
  assert rel(got, want) < F32_REL
  split_text = str(jax.make_jaxpr(lambda a: mla.out_proj(attn, split_cfg, a))(o))
  plain_text = str(jax.make_jaxpr(lambda a: mla.out_proj(attn, cfg, a))(o))
  assert (split_text == plain_text) == (rows == 1)


def _decode_logits(cfg, params, tokens, n):
  """(prefill logits of tokens[:, :-n], logits of one causal decode step of the last n)."""
  b, s = tokens.shape
  cache = LatentCache.zeros(cfg, b, s + 4, jnp.float32)
  first, cache = jax.jit(lambda p, c, t: T.prefill(cfg, p, c, t)[:2])(
      params, cache, jnp.asarray(tokens[:, :s - n]))
  cache = cache.replace(lengths=jnp.full((b,), s - n, jnp.int32))
  pos = jnp.broadcast_to(s - n + jnp.arange(n, dtype=jnp.int32), (b, n))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
  step = jax.jit(lambda p, c, t: T.decode(cfg, p, c, t, pos, mask)[0])
  return first, step(params, cache, jnp.asarray(tokens[:, s - n:]))


@pytest.mark.parametrize("n", [1, 5])
def test_decode_with_four_splits_equals_one_f32(n):
  """The 2-layer tiny model, packed, f32: prefill and a decode step of n tokens (batch 2, so
  the split runs at n = 1 too) with o_proj_k_splits = 4 against 1, within f32 rounding."""
  cfg = C.tiny(num_hidden_layers=2)
  params = pack.pack_for_decode(cfg, P.init_params(jax.random.key(5), cfg, jnp.float32,
                                                   std=0.1))
  tokens = np.asarray(jax.random.randint(jax.random.key(6), (2, 12), 0, cfg.vocab_size))
  want = _decode_logits(cfg, params, tokens, n)
  got = _decode_logits(cfg.replace(o_proj_k_splits=4), params, tokens, n)
  for g, w in zip(got, want):
    assert rel(g, w) < DECODE_F32_REL, rel(g, w)


@pytest.mark.parametrize("bad", [0, -1, 3, 8, 64])
def test_invalid_splits_are_refused_with_the_choices(bad):
  """tiny's K = 4 heads x 16 = 64: 3 does not divide it, 8 and 64 leave parts under 16
  columns, 0 and -1 are no split count."""
  with pytest.raises(ValueError, match=r"o_proj_k_splits=.*K = num_attention_heads \* "
                     r"v_head_dim = 64.*allowed: 1, 2, 4 \(1 = no split\)"):
    C.tiny(o_proj_k_splits=bad)


def test_the_layout_syntax_parses_and_refuses():
  """probe_xla_options' 'packed+o_proj_k_splits=4' (config_overrides): parsed as an int on the
  K2.6 share (K = 1024: 1 .. 64); a refused value names the layout."""
  cfg = C.bench_k26(layers=2)
  assert cfg.o_proj_k_splits == 1
  assert with_overrides(cfg, ["o_proj_k_splits=8"], "--layouts").o_proj_k_splits == 8
  assert cfg.o_proj_split_choices == (1, 2, 4, 8, 16, 32, 64)
  with pytest.raises(ValueError, match=r"--layouts 'packed\+o_proj_k_splits=128'.*allowed"):
    with_overrides(cfg, ["o_proj_k_splits=128"], "--layouts 'packed+o_proj_k_splits=128'")
