"""configs/bench_k26_full.py builds one GPU's share of K2.6 (abstractly: nothing is allocated)."""

import jax
import jax.numpy as jnp
import pytest

from kdtree_jax import bench_models, loader
from kdtree_jax.checkpoint.int4 import Int4Weight

import configs.bench_k26_full as bench_k26_full


def _abstract(c):
  box = {}

  def build():
    box["tcfg"], tp = loader.load_target(c.target, jnp.bfloat16)
    box["dcfg"], dp = loader.load_draft(c.draft, box["tcfg"], jnp.bfloat16)
    return tp, dp

  tp, dp = jax.eval_shape(build)
  return box["tcfg"], tp, box["dcfg"], dp


def test_full_depth_share_shapes():
  tcfg, tp, dcfg, dp = _abstract(bench_k26_full.get_config())
  assert tcfg.num_hidden_layers == 61 and tcfg.num_moe_layers == 60
  assert (tcfg.num_attention_heads, tcfg.n_routed_experts, tcfg.num_local_experts) == (8, 384, 48)
  assert tp["embed"].shape == (163840 // 8, 7168) and tp["lm_head"].shape == (7168, 163840 // 8)
  assert tp["layers"][0]["mlp"]["gate"].shape == (7168, 18432 // 8)
  moe = tp["layers"][1]["moe"]
  assert moe["router"].shape == (7168, 384) and moe["bias"].shape == (384,)
  assert moe["shared"]["gate"].shape == (7168, 2048 // 8)
  is_int4 = lambda x: isinstance(x, Int4Weight)
  for name in ("gate", "up", "down"):
    w = moe[name]
    assert is_int4(w) and w.packed.dtype == jnp.int4 and w.shape[0] == 48, (name, w)
  assert tp["layers"][1]["attn"]["o"].shape == (8, 128, 7168)
  # The published K2.6 DFlash shape, sliced 1/8: 6 layers, 8 of 64 query heads, 1 of 8 KV heads.
  assert (dcfg.num_hidden_layers, dcfg.num_attention_heads, dcfg.num_key_value_heads,
          dcfg.head_dim, dcfg.intermediate_size, dcfg.block_size) == (6, 8, 1, 128, 2304, 16)
  assert dcfg.target_layer_ids == (1, 12, 24, 35, 47, 58)
  assert dp["fc"].shape == (6 * 7168, 7168)


def test_shard_count_must_divide():
  with pytest.raises(ValueError, match="split 3 ways"):
    bench_models.k26_share(layers=4, shards=3)


def test_no_mesh():
  c = bench_k26_full.get_config()
  with pytest.raises(ValueError, match="without --mesh"):
    bench_models.load_target(c.target, jnp.bfloat16, mesh=object())
