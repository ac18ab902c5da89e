"""Train the DFlash draft of the `k2tiny` target (frozen; read from its HF checkpoint).

GPU (one H200, ~2.5 min wall: stops at `steps` (4000) or `max_seconds` (140 s), whichever
comes first; run after scripts/train_target.py, whose output (runs/k2tiny/hf/target) it reads;
--config.target_checkpoint=checkpoints/k2tiny/target trains against the shipped target):
  python scripts/train_draft.py --config configs/train_draft.py
CPU reduced run (30 steps of 4 x 128 tokens, 8 blocks each; ~30 s; after the reduced target):
  python scripts/train_draft.py --config configs/train_draft.py:cpu
  (reads runs/k2tiny_cpu/target, writes runs/k2tiny_cpu/draft)
Any field can be overridden, e.g. --config.steps=50 --config.batch=4 --config.anchors=8.
Output: DFlash checkpoint (z-lab layout) in out_dir (runs/k2tiny/hf/draft; checkpoints/ only
with --write_checkpoints); orbax state + log.jsonl in work_dir.
"""

import ml_collections

from kdtree_jax import data
from kdtree_jax.tokenizer import ByteTokenizer


def draft_fields():
  """DraftConfig fields (hidden_size and vocab_size must equal the target's)."""
  return ml_collections.ConfigDict(dict(
      hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
      head_dim=64, intermediate_size=512, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=264,
      block_size=16, target_layer_ids=(0, 1, 2, 3), mask_token_id=ByteTokenizer.mask_id,
      num_target_layers=4))


def get_config(size: str = "full"):
  c = ml_collections.ConfigDict()
  c.draft = draft_fields()
  c.target_checkpoint = "runs/k2tiny/hf/target"  # the target scripts/train_target.py wrote
  c.heldout_files = data.HELDOUT_FILES
  c.heldout_topics = data.HELDOUT_TOPICS
  c.overfit_one_batch = False  # debug / test: train on batch 0 every step
  c.seed = 1
  c.seq_len = 512
  c.batch = 32
  c.anchors = 32  # blocks per sequence (DFlash: 512 for 3k-token samples)
  c.gamma = 7.0  # loss weight exp(-(k - 1) / gamma), gamma 7 for block 16
  c.steps = 4000
  c.max_seconds = 140.0  # 0 = no time limit
  c.lr = 2e-3
  c.min_lr_frac = 0.05
  c.warmup_frac = 0.04
  c.b1, c.b2 = 0.9, 0.95
  c.weight_decay = 0.01
  c.grad_clip = 1.0
  c.compute_dtype = "bfloat16"
  c.log_every = 50
  c.eval_every = 500
  c.eval_batches = 4
  c.eval_batch = 16
  c.ckpt_every = 1000
  c.out_dir = "runs/k2tiny/hf/draft"
  c.work_dir = "runs/k2tiny/draft"
  c.save_dtype = "bfloat16"
  if size == "cpu":
    c.update(dict(seq_len=128, batch=4, anchors=8, steps=30, max_seconds=0.0,
                  compute_dtype="float32", log_every=5, eval_every=15, eval_batches=2,
                  eval_batch=4, ckpt_every=15, target_checkpoint="runs/k2tiny_cpu/target",
                  out_dir="runs/k2tiny_cpu/draft", work_dir="runs/k2tiny_cpu/state/draft"))
  elif size != "full":
    raise ValueError(f"size {size!r} must be 'full' or 'cpu'")
  return c
