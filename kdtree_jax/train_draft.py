"""Trains a DFlash draft against a frozen target checkpoint; writes it in the z-lab layout.

`train(c)` takes the `train.draft` section of configs/k2tiny.py (CLI: scripts/train_draft.py).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import data, training
from kdtree_jax.target.checkpoint import load_hf_checkpoint
from kdtree_jax.decoding.loop import check_draft_fits_target
from kdtree_jax.draft.checkpoint import save_dflash_checkpoint
from kdtree_jax.draft.config import FULL, DraftConfig
from kdtree_jax.draft.model import init_draft_params

EVAL_ANCHOR_SEED = 12345


def draft_config(d) -> DraftConfig:
  """DraftConfig from the config's `draft` fields (full attention layers)."""
  fields = dict(d, target_layer_ids=tuple(d.target_layer_ids))
  return DraftConfig(**fields, layer_types=(FULL,) * d.num_hidden_layers, sliding_window=None)


def batches(c, corpus, dcfg):
  """(step -> (tokens [B, S], anchors [B, A])) for training, and fixed eval batches."""
  def train_batch(step):
    step = 0 if c.overfit_one_batch else step
    tokens = corpus.batch(c.seed, step, c.batch, c.seq_len)[:, :-1]
    rng = np.random.default_rng([c.seed, step, 1])
    return tokens, training.sample_anchors(rng, c.batch, c.seq_len, c.anchors, dcfg.block_size)

  rng = np.random.default_rng(EVAL_ANCHOR_SEED)
  evals = [(t[:, :-1], training.sample_anchors(rng, len(t), c.seq_len, c.anchors, dcfg.block_size))
           for t in corpus.eval_batches(c.eval_batches, c.eval_batch, c.seq_len)]
  return train_batch, evals


def train(c, corpus=None):
  """Trains, writes the DFlash checkpoint to c.out_dir; returns (dcfg, params)."""
  t0 = time.time()
  corpus = corpus or data.build_corpus(tuple(c.heldout_files), tuple(c.heldout_topics))
  tcfg, tparams = load_hf_checkpoint(c.target_checkpoint, dtype=jnp.float32)
  dcfg = draft_config(c.draft)
  check_draft_fits_target(dcfg, tcfg)
  opt = training.make_optimizer(c)
  params = init_draft_params(jax.random.key(c.seed), dcfg, tcfg.hidden_size, dcfg.n_taps)
  n = sum(x.size for x in jax.tree.leaves(params))
  print(f"target {c.target_checkpoint}; draft params {n:,}; corpus {len(corpus.train):,} train "
        f"tokens; devices {jax.devices()}", flush=True)
  state = {"params": params, "opt_state": opt.init(params)}
  train_batch, evals = batches(c, corpus, dcfg)
  step_fn = training.make_draft_step(dcfg, tcfg, opt, c)
  state, step = training.fit(
      c, state, lambda s, b, lr: step_fn(s, tparams, b, lr), train_batch,
      training.make_draft_eval(dcfg, tcfg, tparams, evals, c),
      tokens_per_step=c.batch * c.seq_len, work_dir=c.work_dir)
  out = jax.tree.map(lambda x: x.astype(training.DTYPES[c.save_dtype]), state["params"])
  save_dflash_checkpoint(c.out_dir, dcfg, out)
  print(f"wrote {c.out_dir} ({c.save_dtype}) after {step} steps, {time.time() - t0:.0f} s total",
        flush=True)
  return dcfg, state["params"]

