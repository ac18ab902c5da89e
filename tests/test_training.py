"""Training: held-out split; both drivers cut the loss on one batch, write loadable checkpoints."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax
from kdtree_jax import cli, data, train_draft, train_target, training
from kdtree_jax.draft import model as draft_model
from kdtree_jax.target import transformer
from kdtree_jax.tokenizer import ByteTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                  yarn_original_max_position_embeddings=32, max_position_embeddings=128)
TINY_DRAFT = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, intermediate_size=96, block_size=4,
                  target_layer_ids=(0, 1), num_target_layers=2)
STEPS = 10
LOOP = dict(seq_len=32, batch=4, steps=STEPS, max_seconds=0.0, lr=1e-2, warmup_frac=0.0,
            min_lr_frac=1.0, weight_decay=0.0, eval_batches=1, eval_batch=2, log_every=1,
            eval_every=STEPS, ckpt_every=STEPS, overfit_one_batch=True, compute_dtype="float32")
BIAS_RATE = 1e-2


def read_log(work_dir):
  with open(os.path.join(work_dir, "log.jsonl")) as f:
    return [json.loads(line) for line in f]


def train_losses(work_dir):
  return [r["loss"] for r in read_log(work_dir) if "loss" in r]


@pytest.fixture(scope="module")
def corpus():
  return data.build_corpus()


def test_heldout_files_never_trained(corpus):
  held = data.heldout_names()
  assert set(corpus.eval_names) == held  # every listed document exists here
  assert not held & set(corpus.train_names)
  assert not any(set(n[len("file:"):].split("/")) & data.SKIP_DIRS for n in corpus.train_names)
  heads = [d.text.encode()[:300] for d in data.load_docs() if d.name in held]
  train = corpus.train.astype(np.uint8).tobytes()  # specials wrap to junk bytes: harmless here
  assert not any(h in train for h in heads)
  np.testing.assert_array_equal(corpus.batch(0, 7, 2, 16), corpus.batch(0, 7, 2, 16))
  assert corpus.train[0] == ByteTokenizer.bos_id and corpus.train[-1] == ByteTokenizer.eos_id
  anchors = training.sample_anchors(np.random.default_rng(0), 3, 32, 6, 4)
  assert np.all(np.diff(anchors, axis=1) > 0) and anchors.min() >= 1 and anchors.max() + 4 <= 32


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
  """Both training drivers on one fixed batch at a tiny size; returns configs and trained params."""
  tmp = tmp_path_factory.mktemp("k2tiny")
  train_cpu = cli.load_config_file(os.path.join(ROOT, "configs", "k2tiny.py:cpu")).train
  tc = train_cpu.target
  tc.model.update(TINY_MODEL)
  tc.update(LOOP, bias_update_rate=BIAS_RATE, out_dir=str(tmp / "target"),
            work_dir=str(tmp / "runs/target"))
  tcfg, tparams = train_target.train(tc, corpus)
  dc = train_cpu.draft
  dc.draft.update(TINY_DRAFT)
  dc.update(LOOP, anchors=6, gamma=2.0, target_checkpoint=tc.out_dir, out_dir=str(tmp / "draft"),
            work_dir=str(tmp / "runs/draft"))
  dcfg, dparams = train_draft.train(dc, corpus)
  return tc, tcfg, tparams, dc, dcfg, dparams


@pytest.mark.slow
def test_target_loss_goes_down_and_bias_balances(trained):
  tc, _, tparams, *_ = trained
  losses = train_losses(tc.work_dir)
  assert len(losses) == STEPS and losses[-1] < 0.7 * losses[0], losses
  bias = np.asarray(tparams["layers"][1]["moe"]["bias"])  # starts at 0; only sign steps move it
  assert np.any(bias) and np.allclose(bias / BIAS_RATE, np.round(bias / BIAS_RATE), atol=1e-3)


@pytest.mark.slow
def test_draft_loss_goes_down(trained):
  dc = trained[3]
  log = read_log(dc.work_dir)
  losses = train_losses(dc.work_dir)
  assert len(losses) == STEPS and losses[-1] < 0.7 * losses[0], losses
  assert log[-1]["step"] == STEPS and "eval_prefix_len" in log[-1]


@pytest.mark.slow
def test_checkpoints_load_back_with_identical_outputs(trained, corpus):
  tc, tcfg, tparams, dc, dcfg, dparams = trained
  to_bf16 = lambda t: training.cast_params(training.cast_params(t, jnp.bfloat16), jnp.float32)
  tokens = jnp.asarray(corpus.batch(1, 0, 2, 16)[:, :-1])
  lcfg, lparams = kdtree_jax.load_hf_checkpoint(tc.out_dir)
  assert lcfg == tcfg
  prefill = jax.jit(lambda p: transformer.prefill(tcfg, p, None, tokens, dcfg.target_layer_ids))
  (logits, _, taps), (want, _, want_taps) = prefill(lparams), prefill(to_bf16(tparams))
  np.testing.assert_array_equal(logits, want)
  np.testing.assert_array_equal(taps, want_taps)
  ldcfg, ldparams = kdtree_jax.load_dflash_checkpoint(dc.out_dir)
  assert ldcfg == dcfg
  anchors = jnp.asarray([[2, 7], [1, 9]], jnp.int32)
  block = jnp.full((2, 2, 4), dcfg.mask_token_id, jnp.int32).at[..., 0].set(tokens[:, :2])
  run = jax.jit(lambda p: draft_model.draft_train_forward(p, dcfg, taps, anchors, block,
                                                          lparams["embed"], lparams["lm_head"]))
  rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), dparams)
  np.testing.assert_array_equal(run(ldparams), run(rounded))
