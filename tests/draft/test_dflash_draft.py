"""DFlash draft: numpy reference on HF-layout weights, cache/train agreement, checkpoints, errors."""

import dataclasses
import functools
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kdtree_jax import draft
from kdtree_jax.draft import checkpoint, ctx_attention, model
from gpu_grid import full_grid  # tests/gpu_grid.py

SLIDING_CFG = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=3)


def rand_params(cfg, seed=0):
  """Init params, then perturb every tensor so norms and projections are non-trivial."""
  p = model.init_draft_params(jax.random.PRNGKey(seed), cfg, cfg.hidden_size, cfg.n_taps)
  leaves, tree_def = jax.tree.flatten(p)
  rng = np.random.default_rng(seed)
  new = [jnp.asarray(x + rng.normal(size=x.shape).astype(np.float32) * 0.3) for x in leaves]
  return jax.tree.unflatten(tree_def, new)


def np_rms(x, w, eps):
  return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def np_rope(x_the, pos_t, theta):
  """Pairs (i, i + E/2) rotated by pos * theta^(-2i/E), written element-wise."""
  out = x_the.copy()
  half = x_the.shape[-1] // 2
  for i in range(half):
    ang = pos_t[:, None] * theta ** (-2.0 * i / x_the.shape[-1])
    a, b = x_the[..., i], x_the[..., i + half]
    out[..., i] = a * np.cos(ang) - b * np.sin(ang)
    out[..., i + half] = b * np.cos(ang) + a * np.sin(ang)
  return out


def np_draft(W, cfg, taps_tf, ctx_pos, tokens_s, start, embed, head):
  """One row, keys = [ctx ; block], f64, per-head loops: a dense restatement of the rule (the
  independent check is test_matches_reference_fixture, against a torch port of z-lab's code)."""
  eps, E = cfg.rms_norm_eps, cfg.head_dim
  H, G = cfg.num_attention_heads, cfg.num_key_value_heads
  c = np_rms(taps_tf @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
  x = embed[tokens_s]
  S = len(tokens_s)
  qpos = start + np.arange(S)
  kpos = np.concatenate([ctx_pos, qpos])
  for i in range(cfg.num_hidden_layers):
    w = lambda n: W[f"layers.{i}.{n}.weight"]
    h = np_rms(x, w("input_layernorm"), eps)
    q = np_rope(np_rms((h @ w("self_attn.q_proj").T).reshape(S, H, E), w("self_attn.q_norm"), eps), qpos, cfg.rope_theta)
    src = np.concatenate([c, h])
    k = (src @ w("self_attn.k_proj").T).reshape(len(src), G, E)
    k = np_rope(np_rms(k, w("self_attn.k_norm"), eps), kpos, cfg.rope_theta)
    v = (src @ w("self_attn.v_proj").T).reshape(len(src), G, E)
    o = np.zeros((S, H, E))
    for s in range(S):
      vis = np.ones(len(src), bool)
      blk = np.arange(len(src)) >= len(c)
      if cfg.causal(i):
        vis &= ~blk | (kpos <= qpos[s])
      if cfg.window(i):
        vis &= np.abs(qpos[s] - kpos) < cfg.window(i)
      for hh in range(H):
        g = hh // (H // G)
        sc = k[:, g] @ q[s, hh] / np.sqrt(E)
        sc = np.where(vis, sc, -np.inf)
        p = np.exp(sc - sc.max())
        o[s, hh] = (p / p.sum()) @ v[:, g]
    x = x + o.reshape(S, H * E) @ w("self_attn.o_proj").T
    h = np_rms(x, w("post_attention_layernorm"), eps)
    gate = h @ w("mlp.gate_proj").T
    x = x + ((gate / (1 + np.exp(-gate))) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
  return np_rms(x, W["norm.weight"], eps) @ head


def setup(cfg, tmp_path, seed=0):
  """Random params saved to disk; HF weights (f64), embed [V, D], head [D, V]."""
  params = rand_params(cfg, seed)
  checkpoint.save_dflash_checkpoint(str(tmp_path), cfg, params)
  W = {k: v.astype(np.float64) for k, v in load_file(os.path.join(tmp_path, "model.safetensors")).items()}
  rng = np.random.default_rng(seed + 1)
  embed = rng.normal(size=(cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
  head = rng.normal(size=(cfg.hidden_size, cfg.vocab_size)).astype(np.float32) * 0.3
  return params, W, embed, head


def close(got, ref, rel=1e-5):
  """max |got - ref| <= rel * max |ref|."""
  err = np.abs(np.asarray(got, np.float64) - ref).max()
  assert err <= rel * np.abs(ref).max(), (err, np.abs(ref).max())


@pytest.mark.parametrize("ctx_chunk,ctx_impl", [(model.CTX_CHUNK, "xla"), (4, "xla"),
                                                (model.CTX_CHUNK, "interpret")])
@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, SLIDING_CFG])
def test_block_matches_numpy(tmp_path, overrides, ctx_chunk, ctx_impl):
  """ctx_chunk 4: the 64 cache rows as 16 chunks (most wholly past ctx_len); interpret:
  the fused ctx kernel in interpret mode (full-attention layers; sliding ones stay on XLA)."""
  cfg = draft.DraftConfig.tiny(**overrides)
  params, W, embed, head = setup(cfg, tmp_path)
  rng = np.random.default_rng(2)
  B, T, S = 2, 4, cfg.block_size
  taps = rng.normal(size=(B, 3 * T, cfg.n_taps * cfg.hidden_size)).astype(np.float32)
  cache = model.init_draft_cache(cfg, B, 4 * T, jnp.float32)
  valid = np.array([[4, 2], [3, 4], [0, 1]])  # committed per step, per row
  done = np.zeros(B, int)
  for step in range(3):  # chunks of T rows; rows past num_valid are garbage
    chunk = np.stack([taps[b, done[b]:done[b] + T] if done[b] + T <= 3 * T else
                      np.zeros_like(taps[b, :T]) for b in range(B)])
    pos = done[:, None] + np.arange(T)
    cache = jax.jit(model.materialize_context, static_argnums=1)(
        params, cfg, cache, jnp.asarray(chunk), jnp.asarray(pos), jnp.asarray(valid[step]))
    done += valid[step]
  np.testing.assert_array_equal(np.asarray(cache.ctx_len), done)
  tokens = np.asarray(model.make_block(cfg, jnp.array([5, 9])))
  np.testing.assert_array_equal(tokens, [[5, 63, 63, 63], [9, 63, 63, 63]])
  block = jax.jit(functools.partial(model.draft_block, ctx_chunk=ctx_chunk, ctx_impl=ctx_impl),
                  static_argnums=1)
  logits = block(params, cfg, cache, jnp.asarray(tokens), jnp.asarray(done), jnp.asarray(embed),
                 jnp.asarray(head))
  assert logits.shape == (B, S, cfg.vocab_size) and logits.dtype == jnp.float32
  for b in range(B):
    n = done[b]
    ref = np_draft(W, cfg, taps[b, :n].astype(np.float64), np.arange(n), tokens[b], n,
                   embed.astype(np.float64), head.astype(np.float64))
    close(logits[b], ref)


@pytest.mark.parametrize("overrides", [{}, SLIDING_CFG])
def test_train_forward_matches_inference(tmp_path, overrides):
  cfg = draft.DraftConfig.tiny(**overrides)
  params, _, embed, head = setup(cfg, tmp_path, seed=3)
  rng = np.random.default_rng(4)
  B, Sc, K = 2, 10, cfg.block_size
  taps = rng.normal(size=(B, Sc, cfg.n_taps * cfg.hidden_size)).astype(np.float32)
  anchors = np.array([[1, 4, 8], [0, 5, 9]], np.int32)
  blocks = rng.integers(0, cfg.vocab_size, size=(B, 3, K)).astype(np.int32)
  train = jax.jit(model.draft_train_forward, static_argnums=1)(
      params, cfg, jnp.asarray(taps), jnp.asarray(anchors), jnp.asarray(blocks),
      jnp.asarray(embed), jnp.asarray(head))
  assert train.shape == (B, 3, K, cfg.vocab_size)
  mat = jax.jit(model.materialize_context, static_argnums=1)
  blk = jax.jit(model.draft_block, static_argnums=1)
  for a in range(3):
    cache = model.init_draft_cache(cfg, B, Sc + K, jnp.float32)
    pos = np.broadcast_to(np.arange(Sc), (B, Sc))
    cache = mat(params, cfg, cache, jnp.asarray(taps), jnp.asarray(pos), jnp.asarray(anchors[:, a]))
    inf = blk(params, cfg, cache, jnp.asarray(blocks[:, a]), jnp.asarray(anchors[:, a]),
              jnp.asarray(embed), jnp.asarray(head))
    close(train[:, a], np.asarray(inf, np.float64), rel=1e-5)


def _one_layer_run(cfg, tmp_path, taps, tokens, start):
  """Block logits of a one-layer draft over ctx rows 0..start-1."""
  params, _, embed, head = setup(cfg, tmp_path, seed=5)
  Sc = taps.shape[1]
  cache = model.init_draft_cache(cfg, 1, Sc + cfg.block_size, jnp.float32)
  cache = model.materialize_context(params, cfg, cache, jnp.asarray(taps), jnp.arange(Sc)[None],
                                    jnp.array([start]))
  return np.asarray(model.draft_block(params, cfg, cache, jnp.asarray(tokens), jnp.array([start]),
                                      jnp.asarray(embed), jnp.asarray(head)))


@pytest.mark.slow
@pytest.mark.parametrize("is_causal", [None, True])
def test_sliding_window_both_sides_and_block_rule(tmp_path, is_causal):
  """z-lab reference rule: |q - k| < window on ctx and block keys; non-causal unless is_causal."""
  cfg = draft.DraftConfig.tiny(num_hidden_layers=1, layer_types=("sliding_attention",),
                               sliding_window=3, is_causal=is_causal)
  rng = np.random.default_rng(6)
  Sc, start, W = 10, 8, 3
  taps = rng.normal(size=(1, Sc, cfg.n_taps * cfg.hidden_size)).astype(np.float32)
  tokens = np.array([[3, 63, 63, 63]], np.int32)
  run = lambda taps, tokens: _one_layer_run(cfg, tmp_path, taps, tokens, start)
  base = run(taps, tokens)
  far, near = taps.copy(), taps.copy()
  far[0, start - W] += 1.0  # |start - (start - W)| = W: outside the window of query 0
  near[0, start - W + 1] += 1.0
  np.testing.assert_array_equal(run(far, tokens)[0, 0], base[0, 0])
  assert np.abs(run(near, tokens)[0, 0] - base[0, 0]).max() > 1e-4
  later = tokens.copy()
  later[0, 3] = 7  # block key 3: |0 - 3| = W, outside query 0's window; inside query 1's
  out = run(taps, later)
  np.testing.assert_array_equal(out[0, 0], base[0, 0])
  moved = np.abs(out[0, 1] - base[0, 1]).max()
  if is_causal:
    assert moved == 0.0
  else:
    assert moved > 1e-4
  past = taps.copy()
  past[0, start] += 5.0  # rows >= ctx_len are invisible
  np.testing.assert_array_equal(run(past, tokens), base)


def test_checkpoint_round_trip_and_sharded(tmp_path):
  cfg = draft.DraftConfig.tiny(**SLIDING_CFG, is_causal=False)
  params = rand_params(cfg, 7)
  checkpoint.save_dflash_checkpoint(str(tmp_path / "a"), cfg, params)
  cfg2, params2 = draft.load_dflash_checkpoint(str(tmp_path / "a"))
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params2, params)
  # SpecForge-style: sharded with an index, `model.` prefix, extra embed/lm_head tensors.
  tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
  names = sorted(tensors)
  shard = tmp_path / "b"
  shard.mkdir()
  parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
  weight_map = {}
  for fn, part in parts.items():
    save_file({"model." + n: tensors[n] for n in part}, str(shard / fn))
    weight_map.update({"model." + n: fn for n in part})
  save_file({"embed_tokens.weight": np.zeros((cfg.vocab_size, cfg.hidden_size), np.float32)},
            str(shard / "extra.safetensors"))
  weight_map["embed_tokens.weight"] = "extra.safetensors"
  (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  (shard / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
  _, params3 = draft.load_dflash_checkpoint(str(shard), dtype=jnp.bfloat16)
  assert params3["layers"][0]["q_proj"].dtype == jnp.bfloat16
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x, np.float32), y, rtol=1e-2),
               params3, params)


def test_checkpoint_errors(tmp_path):
  cfg = draft.DraftConfig.tiny()
  checkpoint.save_dflash_checkpoint(str(tmp_path), cfg, rand_params(cfg))
  path = str(tmp_path / "model.safetensors")
  tensors = load_file(path)
  bad = dict(tensors)
  bad.pop("layers.1.mlp.up_proj.weight")
  save_file(bad, path)
  with pytest.raises(KeyError, match="layers.1.mlp.up_proj.weight"):
    draft.load_dflash_checkpoint(str(tmp_path))
  bad = dict(tensors)
  bad["layers.0.mlp.down_proj.weight"] = bad["layers.0.mlp.down_proj.weight"].T.copy()
  save_file(bad, path)
  with pytest.raises(ValueError, match=r"layers.0.mlp.down_proj.weight: expected shape \(32, 48\)"):
    draft.load_dflash_checkpoint(str(tmp_path))


def test_config_formats_and_errors():
  zlab = {
      "architectures": ["DFlashDraftModel"], "hidden_size": 4096, "num_hidden_layers": 5,
      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
      "intermediate_size": 12288, "rms_norm_eps": 1e-6, "vocab_size": 151936,
      "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "num_target_layers": 36,
      "dflash_config": {"block_size": 16, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
  }
  c = draft.DraftConfig.from_hf_dict(zlab)
  assert (c.block_size, c.mask_token_id, c.rope_theta, c.n_taps) == (16, 151669, 1e6, 5)
  assert c.layer_types == ("full_attention",) * 5 and not c.causal(0)
  specforge = dict(zlab, rope_theta=1e7, block_size=8, dflash_config={"mask_token_id": 5},
                   layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048,
                   use_sliding_window=True)
  specforge.pop("rope_parameters")
  c = draft.DraftConfig.from_hf_dict(specforge)
  assert c.target_layer_ids == draft.build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
  assert (c.block_size, c.rope_theta, c.window(0), c.window(4), c.causal(0)) == (8, 1e7, 2048, None, False)
  assert draft.DraftConfig.from_hf_dict(c.to_hf_dict()) == c
  assert draft.DraftConfig.from_hf_dict(dict(specforge, is_causal=True)).causal(4)
  # transformers' Qwen3Config: no window unless use_sliding_window; layer_types from max_window_layers
  with pytest.warns(UserWarning, match="use_sliding_window is false"):
    c = draft.DraftConfig.from_hf_dict(dict(specforge, use_sliding_window=False))
  assert c.layer_types[0] == "sliding_attention" and c.window(0) is None
  assert draft.DraftConfig.from_hf_dict(c.to_hf_dict()) == c
  c = draft.DraftConfig.from_hf_dict(dict(zlab, use_sliding_window=True, max_window_layers=3))
  assert c.layer_types == ("full_attention",) * 3 + ("sliding_attention",) * 2
  assert (c.window(2), c.window(3)) == (None, 4096)
  with pytest.raises(ValueError, match="chunked_attention"):
    draft.DraftConfig.from_hf_dict(dict(specforge, layer_types=["chunked_attention"] * 5))
  with pytest.raises(ValueError, match="yarn"):
    draft.DraftConfig.from_hf_dict(dict(zlab, rope_scaling={"rope_type": "yarn", "factor": 4}))
  with pytest.raises(ValueError, match="DFlash2"):
    draft.DraftConfig.from_hf_dict(dict(zlab, architectures=["DFlash2DraftModel"]))


def test_cache_rows_whole_chunks():
  """Capacities above one chunk round up to whole CTX_CHUNKs (no chunk of the ctx attention is
  ever padded); smaller ones to whole 64-row tiles."""
  n = model.CTX_CHUNK
  assert [model.cache_rows(r) for r in (8, 64, 65, n, n + 1, 46016)] == [
      64, 64, 128, n, 2 * n, -(-46016 // n) * n]
  shape = jax.eval_shape(lambda: model.init_draft_cache(draft.DraftConfig.tiny(), 1, n + 1)).k[0].shape
  assert shape[2] == 2 * n


def test_ctx_kernel_partials_match_numpy():
  """The fused ctx kernel (interpret mode, f32): per chunk, o equals a float64 numpy softmax
  over the chunk's rows below ctx_len and lse its log-sum-exp; a chunk wholly past ctx_len gives
  lse = -inf and o = 0; rows past ctx_len never matter (filled with huge values here)."""
  B, G, M, E, C = 2, 2, 16, 32, 96
  rng = np.random.default_rng(7)
  q, k, v = (rng.normal(size=s).astype(np.float32) for s in
             [(B, G, M, E), (B, G, C, E), (B, G, C, E)])
  lens = np.array([45, 0])
  for b, n in enumerate(lens):
    k[b, :, n:], v[b, :, n:] = 1e4, 1e4
  tuning = ctx_attention.Tuning(chunk=32, block_k=16)
  o, lse = ctx_attention.ctx_partials(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                      jnp.asarray(lens), scale=0.3, tuning=tuning, interpret=True)
  assert o.shape == (B, G, 3, M, E) and lse.shape == (B, G, 3, M) and o.dtype == jnp.float32
  for b, g, j in np.ndindex(B, G, 3):
    rows = slice(32 * j, min(32 * (j + 1), lens[b]))
    s = 0.3 * q[b, g].astype(np.float64) @ k[b, g, rows].T
    if s.shape[1] == 0:
      assert np.all(np.isneginf(lse[b, g, j])) and not np.any(o[b, g, j])
      continue
    mx = s.max(1)
    p = np.exp(s - mx[:, None])
    np.testing.assert_allclose(lse[b, g, j], mx + np.log(p.sum(1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o[b, g, j], (p / p.sum(1, keepdims=True)) @ v[b, g, rows],
                               rtol=1e-4, atol=1e-4)


def test_ctx_kernel_lowers_for_h200():
  """The fused ctx kernel lowers to Triton for an H200 (abstract device, no GPU needed) at
  bench_k26_full's draft shape: 128 query rows, one kv head, 46080 cache rows."""
  from jax._src import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  M, E, C = 128, 128, 46080
  tuning = ctx_attention.default_tuning(1, 1, M, C, chunk=512)
  assert tuning.programs is None and C % tuning.chunk == 0
  # the decode default: one wave of 131 ctx programs (+ the block's) on the 132 SMs
  assert ctx_attention.default_tuning(1, 1, M, C).programs == 131
  assert ctx_attention.default_tuning(1, 8, M, C).programs == 15
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  assert ctx_attention.supports(spec(1, 1, M, E), spec(1, 1, C, E), tuning)
  f32 = jax.ShapeDtypeStruct((1, 1, C, E), jnp.float32)
  assert not ctx_attention.supports(spec(1, 1, M, E), f32, tuning)  # bf16 cache only
  odd = ctx_attention.Tuning(chunk=192, block_k=64)  # not a power-of-two Triton block
  assert not ctx_attention.supports(spec(1, 1, M, E), spec(1, 1, 192, E), odd)
  assert not ctx_attention.supports(spec(1, 1, 8, E), spec(1, 1, C, E), tuning)  # M < 16
  fn = jax.jit(functools.partial(ctx_attention.ctx_partials, scale=E ** -0.5, tuning=tuning))
  dev = mesh_lib.AbstractDevice("NVIDIA H200", 132, "gpu")
  assert ctx_attention.supports_block(spec(1, 1, 16, E))
  assert not ctx_attention.supports_block(spec(1, 1, 8, E))  # below a Triton dot tile
  split = dataclasses.replace(tuning, programs=131)
  assert ctx_attention.supports(spec(1, 1, M, E), spec(1, 1, C, E), split)
  fn_split = jax.jit(functools.partial(ctx_attention.ctx_partials, scale=E ** -0.5, tuning=split))
  for fn, blk in ((fn, ()), (fn, (spec(1, 1, 16, E),) * 2), (fn_split, (spec(1, 1, 16, E),) * 2)):
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
      text = fn.trace(spec(1, 1, M, E), spec(1, 1, C, E), spec(1, 1, C, E),
                      jax.ShapeDtypeStruct((1,), jnp.int32), *blk).lower(
                          lowering_platforms=("cuda",)).as_text()
    assert "draft_ctx_attention" in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Triton kernel: GPU only")
@pytest.mark.parametrize("kv_heads,q_heads,ctx", [(1, 8, 46000), full_grid(8, 32, 3000),
                                                   full_grid(1, 8, 5)])
def test_ctx_kernel_compiled_matches_float64(kv_heads, q_heads, ctx):
  """The compiled kernel (default tuning, bf16 cache) on bench_k26_full's / bench_k26's draft
  head shapes: the merged attention over rows < ctx_len equals a float64 softmax of the same
  bf16 inputs (rel L2 <= 1e-2: p is rounded to bf16 for the PV dot, as in the XLA path).
  Default GPU set: bench_k26_full's 8 / 1 heads at 46000 (the same program at the other shapes
  with --gpu-full-grid)."""
  B, M, E = 2, q_heads // kv_heads * 16, 128
  C = model.cache_rows(ctx + 16)
  ks = jax.random.split(jax.random.key(8), 3)
  q = jax.random.normal(ks[0], (B, kv_heads, M, E), jnp.float32).astype(jnp.bfloat16)
  k, v = (jax.random.normal(kk, (B, kv_heads, C, E), jnp.float32).astype(jnp.bfloat16)
          for kk in ks[1:])
  lens = jnp.array([ctx, max(1, ctx // 3)], jnp.int32)
  tuning = ctx_attention.default_tuning(B, kv_heads, M, C)
  assert ctx_attention.supports(q, k, tuning)
  parts = model.kernel_part(k, v, lens, tuning, False)(q.reshape(B, kv_heads, 1, M, E), E ** -0.5)
  o, _, l = parts
  got = np.asarray(o / l[..., None], np.float64).reshape(B, kv_heads, M, E)
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  for b, n in enumerate(np.asarray(lens)):
    s = np.einsum("gme,gke->gmk", q64[b], k64[b, :, :n]) * E ** -0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("gmk,gke->gme", p / p.sum(-1, keepdims=True), v64[b, :, :n])
    assert np.linalg.norm(got[b] - want) <= 1e-2 * np.linalg.norm(want)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Triton kernel: GPU only")
@pytest.mark.parametrize("programs", [None, full_grid(131)])
def test_ctx_kernel_with_block_compiled_matches_float64(programs):
  """The compiled kernel with the block's own 16 K/V rows as its extra program (bench_k26_full's
  draft heads: 1 kv head, 128 query rows): attention over rows < ctx_len plus every block row
  equals a float64 softmax of the same bf16 inputs (rel L2 <= 1e-2). Default GPU set: the
  default tuning's programs (131: the same program, --gpu-full-grid)."""
  B, G, M, E, S = 2, 1, 128, 128, 16
  C = model.cache_rows(3000 + S)
  ks = jax.random.split(jax.random.key(9), 5)
  rnd = lambda kk, *s: jax.random.normal(kk, s, jnp.float32).astype(jnp.bfloat16)
  q, k, v, kb, vb = (rnd(ks[0], B, G, M, E), rnd(ks[1], B, G, C, E), rnd(ks[2], B, G, C, E),
                     rnd(ks[3], B, G, S, E), rnd(ks[4], B, G, S, E))
  lens = jnp.array([3000, 0], jnp.int32)  # row 1: block keys only
  tuning = dataclasses.replace(ctx_attention.default_tuning(B, G, M, C), programs=programs)
  o, _, l = model.kernel_part(k, v, lens, tuning, False, kb, vb)(q.reshape(B, G, 1, M, E),
                                                                 E ** -0.5)
  got = np.asarray(o / l[..., None], np.float64).reshape(B, G, M, E)
  q64, k64, v64, kb64, vb64 = (np.asarray(x, np.float64) for x in (q, k, v, kb, vb))
  for b, n in enumerate(np.asarray(lens)):
    keys = np.concatenate([k64[b, :, :n], kb64[b]], axis=1)
    vals = np.concatenate([v64[b, :, :n], vb64[b]], axis=1)
    s = np.einsum("gme,gke->gmk", q64[b], keys) * E ** -0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("gmk,gke->gme", p / p.sum(-1, keepdims=True), vals)
    assert np.linalg.norm(got[b] - want) <= 1e-2 * np.linalg.norm(want)


def test_hidden_size_mismatch():
  cfg = draft.DraftConfig.tiny()
  with pytest.raises(ValueError, match="target hidden size 48"):
    model.init_draft_params(jax.random.PRNGKey(0), cfg, 48, cfg.n_taps)
  params = rand_params(cfg)
  cache = model.init_draft_cache(cfg, 1, 8, jnp.float32)
  with pytest.raises(ValueError, match="target hidden size 16"):
    model.draft_block(params, cfg, cache, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,), jnp.int32),
                      jnp.zeros((64, 16)), jnp.zeros((16, 64)))
  with pytest.raises(ValueError, match="taps last dim"):
    model.materialize_context(params, cfg, cache, jnp.zeros((1, 4, 33)), jnp.zeros((1, 4), jnp.int32),
                              jnp.ones((1,), jnp.int32))


FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "dflash")


def decode_path_logits(cfg, params, ref, dtype=jnp.float32):
  """Block logits [K, B, S, V] through the decode path's own calls: the prompt materialised
  as generate's prefill does, then per step draft_phase's materialize_context (pending width W,
  positions ctx_len + 0..W-1, count valid) and draft_block at start = committed length."""
  counts, taps = ref["counts"], ref["taps"]
  K, B = counts.shape
  W = cfg.block_size
  P = int(counts[0].max())
  mat = jax.jit(model.materialize_context, static_argnums=1)
  blk = jax.jit(model.draft_block, static_argnums=1)
  cache = model.init_draft_cache(cfg, B, taps.shape[1] + W, dtype)
  noise = np.random.default_rng(0).normal(size=(B, W + P, taps.shape[-1])).astype(np.float32)
  offset = np.zeros(B, int)
  out = []
  for k in range(K):
    width = P if k == 0 else W
    chunk = noise[:, :width].copy()  # rows past the valid count hold garbage
    for b in range(B):
      chunk[b, :counts[k, b]] = taps[b, offset[b]:offset[b] + counts[k, b]]
    positions = np.asarray(cache.ctx_len)[:, None] + np.arange(width)
    cache = mat(params, cfg, cache, jnp.asarray(chunk), jnp.asarray(positions),
                jnp.asarray(counts[k]))
    offset += counts[k]
    block = model.make_block(cfg, jnp.asarray(ref["bonus"][k]))
    out.append(blk(params, cfg, cache, block, cache.ctx_len, jnp.asarray(ref["embed"], dtype),
                   jnp.asarray(ref["lm_head"], dtype).T))
  return np.stack([np.asarray(o) for o in out])


@pytest.mark.parametrize("name", sorted(os.listdir(FIXTURES)) if os.path.isdir(FIXTURES) else [])
def test_matches_reference_fixture(name):
  """Logits equal a torch port of z-lab's dflash/model.py + dflash_generate (f32, rel 1e-4);
  fixtures and port: scripts/make_dflash_fixtures.py, rules: notes/dflash_reference.md."""
  path = os.path.join(FIXTURES, name)
  with open(os.path.join(path, "meta.json")) as f:
    meta = json.load(f)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # sliding_unused_b16 warns on purpose
    cfg, params = draft.load_dflash_checkpoint(path)
  assert [cfg.window(i) for i in range(cfg.num_hidden_layers)] == meta["windows"]
  ref = dict(np.load(os.path.join(path, "reference.npz")))
  got = decode_path_logits(cfg, params, ref)
  assert got.shape == ref["logits"].shape
  close(got, ref["logits"].astype(np.float64), rel=1e-4)
  assert (got.argmax(-1) == ref["logits"].argmax(-1)).mean() > 0.99


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(os.listdir(FIXTURES)) if os.path.isdir(FIXTURES) else [])
def test_matches_reference_fixture_bf16(name):
  """The bf16 path (bf16 weights, cache and activations; f32 attention statistics) against the
  f64 reference: relative L2 <= 2e-2. Measured 0.7-1.1e-2; rounding only the inputs to bf16
  (weights, taps, embed, head) and computing in f32 already gives 0.5-0.7e-2."""
  path = os.path.join(FIXTURES, name)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    cfg, params = draft.load_dflash_checkpoint(path, dtype=jnp.bfloat16)
  ref = dict(np.load(os.path.join(path, "reference.npz")))
  got = decode_path_logits(cfg, params, ref, jnp.bfloat16).astype(np.float64)
  want = ref["logits"].astype(np.float64)
  assert np.linalg.norm(got - want) <= 2e-2 * np.linalg.norm(want)
  assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.95


@pytest.mark.slow
def test_bench_draft_script_cpu(tmp_path):
  """scripts/bench_draft.py --small runs on the CPU: both phases, floors from its cost model."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  cmd = [sys.executable, os.path.join(root, "scripts", "bench_draft.py"), "--small", "--ctx", "256",
         "--reps", "3", "--loop_steps", "4", "--out_dir", str(tmp_path),
         "--cache_dir", str(tmp_path / "cc")]
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = [json.loads(line) for line in (tmp_path / "bench_draft.jsonl").read_text().splitlines()]
  assert [(r["phase"], r.get("ctx_kv")) for r in rows] == [
      ("draft_ctx", "xla"), ("draft_ctx", "nomerge"), ("draft_ctx", "packed"),
      ("draft_block", None)]
  for r in rows:
    floor = max(r["bytes"] / (r["copy_tbps"] * 1e12), r["flops"] / (r["mm_tflops"] * 1e12)) * 1e6
    assert r["bytes"] > 0 and r["flops"] > 0 and np.isclose(r["floor_us"], floor)
    assert r["timer"] == "wall" and np.isfinite(r["us"])
  assert isinstance(rows[-1]["cache_sized_outputs"], list)


def test_ctx_kv_packed_matches():
  """materialize_context's K/V projections: pack_ctx_kv'd params (one dot for every layer) write
  the same cache as the per-layer dots (f32: summation order only)."""
  cfg = draft.DraftConfig.tiny(num_hidden_layers=3, layer_types=("full_attention",) * 3)
  params = rand_params(cfg)
  packed = model.pack_ctx_kv(params)
  G, Y = cfg.num_key_value_heads, cfg.head_dim
  assert packed["ctx_kv"].shape == (cfg.hidden_size, 3 * 2 * G * Y)
  kv = packed["ctx_kv"]
  np.testing.assert_array_equal(kv[:, 2 * G * Y:3 * G * Y], params["layers"][1]["k_proj"])
  np.testing.assert_array_equal(kv[:, 5 * G * Y:], params["layers"][2]["v_proj"])
  rng = np.random.default_rng(3)
  taps = jnp.asarray(rng.normal(size=(2, 4, cfg.n_taps * cfg.hidden_size)).astype(np.float32))
  cache = model.init_draft_cache(cfg, 2, 16, jnp.float32)
  cache = cache.replace(ctx_len=jnp.array([3, 5], jnp.int32))
  pos = cache.ctx_len[:, None] + jnp.arange(4)
  count = jnp.array([4, 2], jnp.int32)
  mat = jax.jit(model.materialize_context, static_argnums=(1,))
  want = mat(params, cfg, cache, taps, pos, count)
  assert np.abs(np.asarray(want.k[2])).max() > 0.1
  got = mat(packed, cfg, cache, taps, pos, count)
  for a, b in zip(got.k + got.v, want.k + want.v):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got.ctx_len, want.ctx_len)


def test_ctx_impl_auto_and_tuning_overrides():
  """ctx_impl 'auto' is the XLA form off the GPU (the Triton kernel has no CPU lowering); the
  kernel with tuning overrides (interpret mode, block_k 16, chunk 32) equals the XLA form."""
  if jax.default_backend() != "gpu":
    assert model.resolve_ctx_impl("auto") == "xla"
  with pytest.raises(ValueError, match="ctx_impl"):
    model.resolve_ctx_impl("triton")
  cfg = draft.DraftConfig.tiny(block_size=16, num_attention_heads=2, num_key_value_heads=1)
  params = rand_params(cfg)
  rng = np.random.default_rng(4)
  cache = model.init_draft_cache(cfg, 1, 64, jnp.float32)
  taps = jnp.asarray(rng.normal(size=(1, 40, cfg.n_taps * cfg.hidden_size)).astype(np.float32))
  cache = model.materialize_context(params, cfg, cache, taps, jnp.arange(40)[None],
                                    jnp.array([37]))
  embed = jnp.asarray(rng.normal(size=(cfg.vocab_size, cfg.hidden_size)).astype(np.float32))
  head = jnp.asarray(rng.normal(size=(cfg.hidden_size, cfg.vocab_size)).astype(np.float32))
  block = model.make_block(cfg, jnp.array([5]))
  run = lambda **kw: model.draft_block(params, cfg, cache, block, cache.ctx_len, embed, head, **kw)
  want = run(ctx_impl="xla")
  got = run(ctx_impl="interpret", kernel_chunk=32, kernel_tuning=(("block_k", 16),))
  close(got, np.asarray(want, np.float64), rel=1e-5)
  fused = run(ctx_impl="interpret", kernel_chunk=32, block_in_kernel=True)  # block keys in-kernel
  close(fused, np.asarray(want, np.float64), rel=1e-5)
  for programs in (1, 2, 5):  # 37 rows = 3 tiles of 16 shared by P programs (P=5: 2 get none)
    split = run(ctx_impl="interpret", kernel_tuning=(("programs", programs), ("block_k", 16)),
                block_in_kernel=programs == 2)
    close(split, np.asarray(want, np.float64), rel=1e-5)
  np.testing.assert_array_equal(run(), want)  # auto = xla here


# draft_block A/B options (bench_draft.py's +qkjoin, +exp2, +msplitN, +hgN rows)
OPTIONS = dict(join_exp2_msplit=dict(kernel_tuning=(("join_halves", True), ("exp2", True),
                                                    ("merge_pieces", 2))),
               join=dict(kernel_tuning=(("join_halves", True),)),
               head_groups=dict(kernel_tuning=(("head_groups", 2),)))


@pytest.mark.parametrize("heads,kv_heads,qk_in_kernel,options", [
    (2, 1, False, None), (8, 2, False, None), (2, 1, True, None), (8, 2, True, None),
    (2, 1, True, "join_exp2_msplit"), (8, 2, True, "join_exp2_msplit"),
    (8, 2, False, "join"), (8, 2, True, "head_groups"), (8, 2, False, "head_groups")])
def test_packed_io_matches_numpy(tmp_path, heads, kv_heads, qk_in_kernel, options):
  """draft_block's default kernel I/O (packed_io: the ctx kernel, interpret mode, reads q and the
  block's K/V from the q|k|v dot's packed output; merge_to_heads merges its partials into the
  o_proj input; qk_in_kernel: the kernel norms and ropes the raw q / k heads itself), also
  without qk_in_kernel and with the A/B options (OPTIONS: roped halves joined, base-2 softmax,
  merge in column pieces, each kv head's query heads in 2 program rows; join without in-kernel
  rope is a no-op), on
  pack_for_decode'd params equals the float64 numpy draft (f32, 1e-5), with one or two kv
  heads (U = 2 or 4 query heads each) and ctx rows split over 3 programs."""
  cfg = draft.DraftConfig.tiny(block_size=16, num_attention_heads=heads,
                               num_key_value_heads=kv_heads)
  params, W, embed, head = setup(cfg, tmp_path)
  option = OPTIONS.get(options, {})
  run = packed_kernel_block(
      cfg, model.pack_for_decode(params), embed, head, seed=6, qk_in_kernel=qk_in_kernel,
      kernel_tuning=option.get("kernel_tuning", ()),
      **{k: v for k, v in option.items() if k != "kernel_tuning"})
  assert "draft_ctx_merge" not in str(jax.make_jaxpr(functools.partial(run, packed_io=False))())
  check_against_numpy(run, W, cfg, embed, head)


def packed_kernel_block(cfg, packed, embed, head, seed, qk_in_kernel, kernel_tuning=(), **kw):
  """draft_block on `packed` params through the packed kernel I/O (interpret mode, ctx rows over
  3 programs) after a 2-row context write of random taps (ctx lengths 37 and 5): a partial to
  call, its inputs on `.ctx` (taps, ctx lengths, block tokens) for check_against_numpy."""
  rng = np.random.default_rng(seed)
  B, T = 2, 40
  taps = rng.normal(size=(B, T, cfg.n_taps * cfg.hidden_size)).astype(np.float32)
  cache = model.init_draft_cache(cfg, B, 64, jnp.float32)
  cache = model.materialize_context(packed, cfg, cache, jnp.asarray(taps),
                                    jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.array([37, 5]))
  tokens = model.make_block(cfg, jnp.array([5, 9]))
  run = functools.partial(model.draft_block, packed, cfg, cache, tokens, cache.ctx_len,
                          jnp.asarray(embed), jnp.asarray(head), ctx_impl="interpret",
                          qk_in_kernel=qk_in_kernel,
                          kernel_tuning=(("programs", 3), ("block_k", 16), *kernel_tuning), **kw)
  assert "draft_ctx_merge" in str(jax.make_jaxpr(run)())  # the packed path is the one taken
  run.ctx = (taps, np.asarray(cache.ctx_len), np.asarray(tokens))
  return run


def check_against_numpy(run, W, cfg, embed, head):
  """run()'s block logits equal the float64 numpy draft's per row (f32, 1e-5)."""
  taps, lengths, tokens = run.ctx
  logits = run()
  for b, n in enumerate(lengths):
    ref = np_draft(W, cfg, taps[b, :n].astype(np.float64), np.arange(n), tokens[b], n,
                   embed.astype(np.float64), head.astype(np.float64))
    close(logits[b], ref)


@pytest.mark.parametrize("pieces", [1, 4])
def test_merge_to_heads_matches_numpy(pieces):
  """merge_to_heads (interpret mode, programs of Y / pieces columns): P normalised partials per
  query row (a program that saw no key: lse = -inf, o = 0) merged through their log-sum-exps
  equal a float64 numpy merge, and row s*U + u of kv head g lands at head g*U + u of token s of
  the [B, S, H*Y] output."""
  B, G, U, S, Y, P = 2, 2, 4, 4, 32, 7
  rng = np.random.default_rng(11)
  o = rng.normal(size=(B, G, P, S * U, Y)).astype(np.float32)
  lse = (3 * rng.normal(size=(B, G, P, S * U))).astype(np.float32)
  lse[:, :, 2] = -np.inf  # one program past ctx_len
  o[:, :, 2] = 0
  got = ctx_attention.merge_to_heads(jnp.asarray(o), jnp.asarray(lse), heads=G * U,
                                     dtype=jnp.float32, interpret=True, pieces=pieces)
  assert got.shape == (B, S, G * U * Y) and got.dtype == jnp.float32
  w = np.exp(lse.astype(np.float64) - lse.max(axis=2, keepdims=True))
  want = (o * w[..., None]).sum(2) / w.sum(2)[..., None]  # [B, G, S*U, Y]
  want = want.reshape(B, G, S, U, Y).transpose(0, 2, 1, 3, 4).reshape(B, S, G * U * Y)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_packed_io_lowers_for_h200():
  """At bench_k26_full's draft shape (8 q heads / 1 kv head of 128, block 16, 46080 cache rows,
  bf16) draft_block takes the packed kernel I/O by default and lowers to Triton for an abstract
  H200: the ctx kernel and the merge kernel, no XLA merge (with and without qk_in_kernel, and
  with the A/B OPTIONS)."""
  from jax._src import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  cfg = draft.DraftConfig.tiny(hidden_size=256, num_hidden_layers=1, num_attention_heads=8,
                               num_key_value_heads=1, head_dim=128, intermediate_size=256,
                               vocab_size=512, mask_token_id=511, block_size=16,
                               layer_types=("full_attention",))
  sd = jax.ShapeDtypeStruct
  assert ctx_attention.supports_packed_block(sd((1, 16, 9, 128), jnp.bfloat16), 1)
  assert not ctx_attention.supports_packed_block(sd((1, 16, 9, 128), jnp.float32), 1)
  assert not ctx_attention.supports_packed_block(sd((1, 12, 9, 128), jnp.bfloat16), 1)  # S=12
  assert not ctx_attention.supports_packed_block(sd((1, 16, 16, 128), jnp.bfloat16), 4)  # U=3
  params = jax.eval_shape(lambda: model.pack_for_decode(model.init_draft_params(
      jax.random.key(0), cfg, cfg.hidden_size, cfg.n_taps, jnp.bfloat16)))
  cache = jax.eval_shape(lambda: model.init_draft_cache(cfg, 1, 46016, jnp.bfloat16))
  args = (params, cache, sd((1, 16), jnp.int32), sd((1,), jnp.int32),
          sd((512, 256), jnp.bfloat16), sd((256, 512), jnp.bfloat16))
  dev = mesh_lib.AbstractDevice("NVIDIA H200", 132, "gpu")
  forms = [dict(packed_io=True, qk_in_kernel=False), dict(packed_io=True),
           dict(packed_io=False, qk_in_kernel=False), *OPTIONS.values()]
  for form in forms:
    packed_io = form.get("packed_io", True)
    f = functools.partial(model.draft_block, cfg=cfg, ctx_impl="pallas", **form)
    f = lambda p, c, t, s, e, h, f=f: f(p, cache=c, block_tokens_bs=t, start_b=s, embed_vd=e,
                                        head_dv=h)
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
      text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "draft_ctx_attention" in text
    assert ("draft_ctx_merge" in text) == packed_io


@pytest.mark.parametrize("tuning", [
    (("join_halves", True), ("exp2", True), ("merge_pieces", 2)),
    (("head_groups", 2), ("programs", 65))])
def test_ab_forms_lower_at_k26_share(tuning):
  """One layer of bench_k26_full's draft (k26_dflash_share: hidden 7168, 8 q / 1 kv heads of
  128, FFN 2304, block 16, 46016 cache rows, bf16) with the A/B options of gpu_measure's
  draft_gap rows lowers to Triton for an abstract H200 (the ctx kernel and its merge) at the
  shapes the GPU run uses."""
  from jax._src import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from kdtree_jax import bench_models  # pylint: disable=import-outside-toplevel
  tcfg = bench_models.k26_share(layers=4)
  cfg = dataclasses.replace(bench_models.k26_dflash_share(tcfg), num_hidden_layers=1,
                            layer_types=("full_attention",))
  params = jax.eval_shape(lambda: model.pack_for_decode(model.init_draft_params(
      jax.random.key(0), cfg, cfg.hidden_size, cfg.n_taps, jnp.bfloat16)))
  cache = jax.eval_shape(lambda: model.init_draft_cache(cfg, 1, 46016, jnp.bfloat16))
  sd, V, D = jax.ShapeDtypeStruct, tcfg.vocab_size, cfg.hidden_size
  f = lambda p, c, t, s, e, h: model.draft_block(p, cfg, c, t, s, e, h, ctx_impl="pallas",
                                                 kernel_tuning=tuning)
  dev = mesh_lib.AbstractDevice("NVIDIA H200", 132, "gpu")
  with jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
    text = jax.jit(f).trace(params, cache, sd((1, 16), jnp.int32), sd((1,), jnp.int32),
                            sd((V, D), jnp.bfloat16), sd((D, V), jnp.bfloat16)).lower(
                                lowering_platforms=("cuda",)).as_text()
  assert "draft_ctx_attention" in text and "draft_ctx_merge" in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Triton kernel: GPU only")
@pytest.mark.parametrize("ctx", [46000, full_grid(3000), full_grid(0)])
def test_packed_io_compiled_matches_float64(ctx):
  """The compiled packed kernel I/O at bench_k26_full's draft heads (8 q / 1 kv head of 128,
  block 16, bf16, default tuning: 131 ctx programs + the block's): q and the block's K/V read
  from a packed [B, S, H+2G, Y] array, merged by merge_to_heads into [B, S, H*Y], equal a
  float64 softmax over ctx rows < ctx_len plus every block row (rel L2 <= 1e-2, bf16 inputs).
  Default GPU set: ctx 46000 (the same programs at 3000 and 0, --gpu-full-grid)."""
  B, G, H, S, E = 2, 1, 8, 16, 128
  C = model.cache_rows(max(ctx, 1) + S)
  ks = jax.random.split(jax.random.key(12), 3)
  rnd = lambda kk, *s: jax.random.normal(kk, s, jnp.float32).astype(jnp.bfloat16)
  qkv, k, v = rnd(ks[0], B, S, H + 2 * G, E), rnd(ks[1], B, G, C, E), rnd(ks[2], B, G, C, E)
  lens = jnp.array([ctx, ctx // 3], jnp.int32)
  tuning = ctx_attention.default_tuning(B, G, H // G * S, C)
  assert ctx_attention.supports_packed_block(qkv[:, :, :H + G], G)
  o, lse = ctx_attention.packed_block_partials(qkv[:, :, :H + G], qkv, k, v, lens, kv_heads=G,
                                               scale=E ** -0.5, tuning=tuning)
  got = np.asarray(ctx_attention.merge_to_heads(o, lse, heads=H, dtype=jnp.float32),
                   np.float64).reshape(B, S, H, E)
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (qkv, k, v))
  for b, n in enumerate(np.asarray(lens)):
    keys = np.concatenate([k64[b, 0, :n], q64[b, :, H]], axis=0)  # [n + S, E]
    vals = np.concatenate([v64[b, 0, :n], q64[b, :, H + G]], axis=0)
    s = np.einsum("she,ke->shk", q64[b, :, :H], keys) * E ** -0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("shk,ke->she", p / p.sum(-1, keepdims=True), vals)
    assert np.linalg.norm(got[b] - want) <= 1e-2 * np.linalg.norm(want)


# draft_block's compiled forms: the default (packed_io + qk_in_kernel) in the default GPU set;
# packed_io with XLA's q/k norm + rope and the older split I/O (their kernels in the default set:
# test_packed_io_compiled_matches_float64, test_ctx_kernel_with_block_compiled_matches_float64),
# the A/B OPTIONS and pack_token_qkv's table (opt-in) with --gpu-full-grid.
DRAFT_BLOCK_FORMS = {"default": (dict(),),
                     "other_forms_and_table": (dict(qk_in_kernel=False), dict(packed_io=False),
                                               *OPTIONS.values())}


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Triton kernels: GPU only")
@pytest.mark.parametrize("forms", ["default", full_grid("other_forms_and_table")])
def test_packed_io_draft_block_compiled_matches_float64(tmp_path, forms):
  """Compiled draft_block (bf16 params and cache, 8 q / 1 kv head of 128, block 16, 3000 ctx
  rows) in its kernel forms (packed_io + qk_in_kernel = the default, packed_io with XLA's q/k
  norm + rope, the older split I/O, the A/B OPTIONS, the default with pack_token_qkv's table)
  against the float64 numpy draft of the same bf16 weights: rel L2 <= 3e-2 each (bf16
  activations through 2 layers); the table's form within 1e-2 of the default's. One draft_block
  compile per form: the default GPU set runs `default` (DRAFT_BLOCK_FORMS)."""
  cfg = draft.DraftConfig.tiny(hidden_size=256, num_attention_heads=8, num_key_value_heads=1,
                               head_dim=128, intermediate_size=256, vocab_size=512,
                               mask_token_id=511, block_size=16)
  params, W, embed, head = setup(cfg, tmp_path)
  bf = lambda t: jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.bfloat16), t)
  to64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  W = {k: to64(v) for k, v in W.items()}
  packed = model.pack_for_decode(bf(params))
  n = 3000
  rng = np.random.default_rng(13)
  taps = rng.normal(size=(1, n, cfg.n_taps * cfg.hidden_size)).astype(np.float32)
  cache = model.init_draft_cache(cfg, 1, n + 16, jnp.bfloat16)
  cache = jax.jit(model.materialize_context, static_argnums=1)(
      packed, cfg, cache, bf(taps), jnp.arange(n)[None], jnp.array([n]))
  tokens = model.make_block(cfg, jnp.array([5]))
  ref = np_draft(W, cfg, to64(taps[0]), np.arange(n), np.asarray(tokens[0]), n, to64(embed),
                 to64(head))
  run = lambda p, kw: np.asarray(jax.jit(functools.partial(
      model.draft_block, cfg=cfg, ctx_impl="pallas", **kw))(
          p, cache=cache, block_tokens_bs=tokens, start_b=cache.ctx_len, embed_vd=bf(embed),
          head_dv=bf(head))[0], np.float64)
  for kw in DRAFT_BLOCK_FORMS[forms]:
    got = run(packed, kw)
    assert np.linalg.norm(got - ref) <= 3e-2 * np.linalg.norm(ref), kw
  if forms == "default":
    return
  # pack_token_qkv's table (issue 17's A/B): the same bound, and <= 1e-2 of the default form
  table = run(model.pack_token_qkv(packed, cfg, bf(embed)), dict())
  assert np.linalg.norm(table - ref) <= 3e-2 * np.linalg.norm(ref)
  assert np.linalg.norm(table - run(packed, dict())) <= 1e-2 * np.linalg.norm(ref)


def test_pack_for_decode_matches():
  """pack_for_decode'd params (q|k|v and gate|up in one dot each, ctx K/V in one dot) give the
  same context write and block logits as the per-layer weights (f32), on full and sliding
  layers; the packed layers hold no separate q/k/v/gate/up weights."""
  for overrides in ({}, SLIDING_CFG):
    cfg = draft.DraftConfig.tiny(**overrides)
    params = rand_params(cfg)
    packed = model.pack_for_decode(params)
    assert set(packed["layers"][0]) == {"qkv_proj", "gate_up_proj", "o_proj", "down_proj",
                                        "q_norm", "k_norm", "input_layernorm",
                                        "post_attention_layernorm"}
    rng = np.random.default_rng(5)
    taps = jnp.asarray(rng.normal(size=(2, 6, cfg.n_taps * cfg.hidden_size)).astype(np.float32))
    embed = jnp.asarray(rng.normal(size=(cfg.vocab_size, cfg.hidden_size)).astype(np.float32))
    head = jnp.asarray(rng.normal(size=(cfg.hidden_size, cfg.vocab_size)).astype(np.float32))
    block = model.make_block(cfg, jnp.array([5, 7]))

    def logits(p):
      cache = model.init_draft_cache(cfg, 2, 16, jnp.float32)
      pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
      cache = model.materialize_context(p, cfg, cache, taps, pos, jnp.array([6, 4]))
      return model.draft_block(p, cfg, cache, block, cache.ctx_len, embed, head)

    want = np.asarray(logits(params), np.float64)
    close(logits(packed), want, rel=1e-5)


def test_load_pair_packs_the_draft_on_one_device():
  """load_pair without a mesh hands the decode pack_for_decode's layout (no run-time weight
  concatenation); its draft logits equal the per-layer params' (covered above)."""
  from kdtree_jax import cli, loader  # pylint: disable=import-outside-toplevel
  root = os.path.join(os.path.dirname(__file__), "..", "..")
  pair, _ = loader.load_pair(cli.load_config_file(os.path.join(root, "configs", "tiny.py")))
  assert "ctx_kv" in pair.dparams and "qkv_proj" in pair.dparams["layers"][0]
  assert "q_proj" not in pair.dparams["layers"][0]
