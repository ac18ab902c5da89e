"""pack_token_qkv: layer 0's q|k|v rows looked up per block token instead of computed (issue 17).

Every check compares the table path against an independent reference: the torch port of
z-lab's draft (the fixtures, f32 1e-4 as test_matches_reference_fixture), the float64 numpy
draft (f32 1e-5, interpret-mode ctx kernel), and the same draft without the table (bf16 1e-2).
The compiled (GPU) check is in test_dflash_draft.test_packed_io_draft_block_compiled_matches_float64.
"""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import draft
from kdtree_jax.draft import model
from test_dflash_draft import (FIXTURES, check_against_numpy, close, decode_path_logits,
                               packed_kernel_block, rand_params, setup)

NAMES = sorted(os.listdir(FIXTURES)) if os.path.isdir(FIXTURES) else []


def with_table(params, cfg, embed_vd):
  """The decode layout with pack_token_qkv's table (as bench_setup builds it when asked)."""
  return model.pack_token_qkv(model.pack_for_decode(params), cfg, jnp.asarray(embed_vd))


def load_fixture(name, dtype=jnp.float32):
  path = os.path.join(FIXTURES, name)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # sliding_unused_b16 warns on purpose
    cfg, params = draft.load_dflash_checkpoint(path, dtype=dtype)
  return cfg, params, dict(np.load(os.path.join(path, "reference.npz")))


@pytest.mark.parametrize("name", NAMES)
def test_table_matches_reference_fixture(name):
  """With the table, the decode path's block logits equal the torch port of z-lab's draft
  (f32, rel 1e-4, the fixtures' own tolerance); full, sliding and mixed-window drafts."""
  cfg, params, ref = load_fixture(name)
  packed = with_table(params, cfg, ref["embed"])
  assert packed["token_qkv"].shape == (
      cfg.vocab_size, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim)
  got = decode_path_logits(cfg, packed, ref)
  close(got, ref["logits"].astype(np.float64), rel=1e-4)
  assert (got.argmax(-1) == ref["logits"].argmax(-1)).mean() > 0.99


@pytest.mark.parametrize("name", NAMES[:2])
def test_table_bf16_matches_no_table(name):
  """bf16 weights, cache and activations: the table path's logits are within rel L2 1e-2 of the
  same packed draft without the table (the table rounds the dot's output once, as the dot does;
  only the f32 summation order differs) and within the bf16 path's 2e-2 of the f64 reference."""
  cfg, params, ref = load_fixture(name, jnp.bfloat16)
  plain = model.pack_for_decode(params)
  table = model.pack_token_qkv(plain, cfg, jnp.asarray(ref["embed"], jnp.bfloat16))
  assert table["token_qkv"].dtype == jnp.bfloat16
  want = decode_path_logits(cfg, plain, ref, jnp.bfloat16).astype(np.float64)
  got = decode_path_logits(cfg, table, ref, jnp.bfloat16).astype(np.float64)
  assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
  f64 = ref["logits"].astype(np.float64)
  assert np.linalg.norm(got - f64) <= 2e-2 * np.linalg.norm(f64)


@pytest.mark.parametrize("qk_in_kernel", [True, False])
def test_table_packed_kernel_matches_numpy(tmp_path, qk_in_kernel):
  """The decode default's attention (packed kernel I/O, interpret mode, ctx rows over 3
  programs) fed layer 0's rows from the table: equals the float64 numpy draft (f32, 1e-5),
  with the q/k norm + rope in the kernel and in XLA."""
  cfg = draft.DraftConfig.tiny(block_size=16, num_attention_heads=8, num_key_value_heads=2)
  params, W, embed, head = setup(cfg, tmp_path)
  run = packed_kernel_block(cfg, with_table(params, cfg, embed), embed, head, seed=7,
                            qk_in_kernel=qk_in_kernel)
  check_against_numpy(run, W, cfg, embed, head)


def _dots(params, cfg, embed, head):
  """dot_generals in draft_block's jaxpr (XLA form) and whether layer 0's qkv_proj is read."""
  cache = model.init_draft_cache(cfg, 1, 16, jnp.float32)
  tokens = model.make_block(cfg, jnp.array([3]))
  jaxpr = jax.make_jaxpr(lambda p: model.draft_block(p, cfg, cache, tokens, cache.ctx_len,
                                                     embed, head, ctx_impl="xla"))(params)
  n = sum(e.primitive.name == "dot_general" for e in jaxpr.jaxpr.eqns)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  index = [i for i, (path, _) in enumerate(leaves)
           if jax.tree_util.keystr(path) == "['layers'][0]['qkv_proj']"][0]
  weight = jaxpr.jaxpr.invars[index]
  used = any(v is weight for e in jaxpr.jaxpr.eqns for v in e.invars)
  return n, used


def test_table_removes_layer0_dot():
  """With the table, draft_block runs one dot fewer and never reads layer 0's qkv_proj (the
  bytes not read); without it, it does."""
  cfg = draft.DraftConfig.tiny()
  params = model.pack_for_decode(rand_params(cfg))
  rng = np.random.default_rng(3)
  embed = jnp.asarray(rng.normal(size=(cfg.vocab_size, cfg.hidden_size)).astype(np.float32))
  head = jnp.asarray(rng.normal(size=(cfg.hidden_size, cfg.vocab_size)).astype(np.float32))
  n_plain, used_plain = _dots(params, cfg, embed, head)
  n_table, used_table = _dots(model.pack_token_qkv(params, cfg, embed), cfg, embed, head)
  assert used_plain and not used_table
  assert n_table == n_plain - 1


def test_table_rows_and_errors():
  """The table's rows are rms_norm(embed[v]) @ qkv_proj of layer 0 (f32, 1e-6; built in
  TOKEN_QKV_CHUNK pieces, here 3 of them); unpacked params are refused."""
  cfg = draft.DraftConfig.tiny(vocab_size=40)
  params = rand_params(cfg)
  embed = jnp.asarray(np.random.default_rng(4).normal(
      size=(cfg.vocab_size, cfg.hidden_size)).astype(np.float32))
  packed = model.pack_for_decode(params)
  old, model.TOKEN_QKV_CHUNK = model.TOKEN_QKV_CHUNK, 16
  try:
    table = model.pack_token_qkv(packed, cfg, embed)["token_qkv"]
  finally:
    model.TOKEN_QKV_CHUNK = old
  lp = params["layers"][0]
  h = np.asarray(model.rms_norm(embed, lp["input_layernorm"], cfg.rms_norm_eps), np.float64)
  w = np.concatenate([np.asarray(lp[n], np.float64) for n in ("q_proj", "k_proj", "v_proj")], 1)
  close(table, h @ w, rel=1e-6)
  tokens = jnp.array([[1, 39], [0, 7]])
  np.testing.assert_array_equal(model.token_qkv_rows({"token_qkv": table}, tokens),
                                np.asarray(table)[np.asarray(tokens)])
  assert model.token_qkv_rows(packed, tokens) is None
  with pytest.raises(ValueError, match="pack_for_decode"):
    model.pack_token_qkv(params, cfg, embed)
  with pytest.raises(ValueError, match="hidden_size"):
    model.pack_token_qkv(packed, cfg, embed[:, :16])


def test_fixture_meta_present():
  """The z-lab-port fixtures this file relies on are there (else the tests above run none)."""
  assert NAMES, FIXTURES
  with open(os.path.join(FIXTURES, NAMES[0], "meta.json")) as f:
    assert "windows" in json.load(f)


def test_bench_setup_builds_the_table_when_asked():
  """bench.draft_token_qkv=True (configs/bench_k26_full.py, default False) gives the bench's
  draft the table (abstract load at bench_k26_full's shapes: V/8 vocabulary x (8 + 2) heads of
  128); it needs the packed draft."""
  from kdtree_jax import bench_setup, cli  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(__file__), "..", "..")
  c = cli.load_config_file(os.path.join(root, "configs", "bench_k26_full.py"))
  c.target.layers = 2
  assert not c.bench.draft_token_qkv
  _, _, _, dp = bench_setup.load_bench_pair(c, jnp.bfloat16, abstract=True)
  assert "token_qkv" not in dp
  c.bench.draft_token_qkv = True
  tcfg, _, dcfg, dp = bench_setup.load_bench_pair(c, jnp.bfloat16, abstract=True)
  width = (dcfg.num_attention_heads + 2 * dcfg.num_key_value_heads) * dcfg.head_dim
  assert dp["token_qkv"].shape == (tcfg.vocab_size, width) == (20480, 1280)
  assert dp["token_qkv"].dtype == jnp.bfloat16
  c.bench.pack_draft = False
  with pytest.raises(ValueError, match="pack_draft"):
    bench_setup.load_bench_pair(c, jnp.bfloat16, abstract=True)
