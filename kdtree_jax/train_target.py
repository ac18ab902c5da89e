"""Trains the small K2.6-architecture target on the stdlib corpus; writes it in HF format.

`train(c)` takes the `train.target` section of configs/k2tiny.py (CLI: scripts/train_target.py).
"""

import time

import jax
import jax.numpy as jnp

from kdtree_jax import data, training
from kdtree_jax.target.hf_writer import save_hf_checkpoint
from kdtree_jax.target.config import TargetConfig, YarnScaling
from kdtree_jax.target.params import count_params, init_params


def model_config(m) -> TargetConfig:
  """TargetConfig from the config's `model` fields."""
  fields = dict(m)
  orig = fields.pop("yarn_original_max_position_embeddings")
  ys = YarnScaling(factor=fields.pop("yarn_factor"), original_max_position_embeddings=orig,
                   mscale=1.0, mscale_all_dim=1.0)
  return TargetConfig(**fields, rope_scaling=ys)


def init_model(c, cfg):
  """Random f32 params with the routing bias at zero (balancing moves it)."""
  params = init_params(jax.random.key(c.seed), cfg, jnp.float32, std=c.init_std)
  layers = [dict(lp, moe=dict(lp["moe"], bias=jnp.zeros_like(lp["moe"]["bias"])))
            if "moe" in lp else lp for lp in params["layers"]]
  return dict(params, layers=layers)


def train(c, corpus=None):
  """Trains, writes the HF checkpoint to c.out_dir; returns (cfg, params)."""
  t0 = time.time()
  corpus = corpus or data.build_corpus(tuple(c.heldout_files), tuple(c.heldout_topics))
  cfg = model_config(c.model)
  print(f"corpus: {len(corpus.train):,} train tokens ({len(corpus.train_names)} docs), "
        f"{len(corpus.eval):,} held-out ({len(corpus.eval_names)} docs); "
        f"params {count_params(cfg)['total']:,}; devices {jax.devices()}", flush=True)
  opt = training.make_optimizer(c)
  params = init_model(c, cfg)
  state = {"params": params, "opt_state": opt.init(params)}
  evaluate = training.make_target_eval(
      cfg, corpus.eval_batches(c.eval_batches, c.eval_batch, c.seq_len), c.compute_dtype)
  state, step = training.fit(
      c, state, training.make_target_step(cfg, opt, c),
      lambda s: (corpus.batch(c.seed, 0 if c.overfit_one_batch else s, c.batch, c.seq_len),),
      evaluate,
      tokens_per_step=c.batch * c.seq_len, work_dir=c.work_dir)
  save_hf_checkpoint(c.out_dir, cfg, state["params"], fmt=c.save_format)
  print(f"wrote {c.out_dir} ({c.save_format}) after {step} steps, {time.time() - t0:.0f} s total",
        flush=True)
  return cfg, state["params"]

