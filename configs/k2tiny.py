"""The trained pair: k2tiny target (K2.6 architecture, byte level) + its DFlash draft, and how
both were trained (the `train` section).

Decode (scripts/decode.py's default config; decode fields: kdtree_jax/run_config.py):
  python scripts/decode.py --config configs/k2tiny.py   # budget=auto: configs/k2tiny.step_cost.json
  python scripts/decode.py --config configs/k2tiny.py --config.budget=32   # a fixed DDTree
The target's config.json claims 2048 positions (YaRN x4 over 512), but it never saw a position
past 511: max_len is capped at 512 and trained_positions=512, so decode.py warns beyond.

Train (`train.target`, `train.draft`: kdtree_jax/train_{target,draft}.py). Full size on one H200
(~7 min for both: target stops at 6000 steps or 250 s, draft at 4000 steps or 140 s; the lr
schedule follows whichever is further along), HF output in runs/k2tiny/hf/{target,draft}; the
shipped checkpoints/k2tiny is written only with --write_checkpoints and an out_dir there:
  python scripts/train_target.py --config configs/k2tiny.py
  python scripts/train_draft.py --config configs/k2tiny.py   # reads train.draft.target_checkpoint
  (or both at once on the GPU machine: bash scripts/gpu_measure.sh OUT train_pair)
Reduced CPU run (same model, 30 steps of 128-token sequences, ~1 min each on 2 cores; writes
runs/k2tiny_cpu/): the `cpu` preset, e.g.
  python scripts/train_target.py --config configs/k2tiny.py:cpu --config.train.target.steps=50
orbax train state + log.jsonl go to work_dir (a rerun with the same work_dir resumes).
"""

import ml_collections

from kdtree_jax import data, run_config
from kdtree_jax.tokenizer import ByteTokenizer


def model_fields():
  """TargetConfig fields (YaRN given by yarn_factor / yarn_original_max_position_embeddings).

  max_position_embeddings (2048 = YaRN x4 over 512) is what config.json will claim; training
  only sees seq_len (512) positions, so decode configs of the result set trained_positions
  (512 here) and decode.py warns past it.
  """
  return ml_collections.ConfigDict(dict(
      vocab_size=264, hidden_size=256, intermediate_size=512, moe_intermediate_size=160,
      num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64,
      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
      num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
      routed_scaling_factor=2.5, first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=10000.0,
      yarn_factor=4.0, yarn_original_max_position_embeddings=512, max_position_embeddings=2048,
      bos_token_id=256, eos_token_id=257, pad_token_id=258))


def draft_fields():
  """DraftConfig fields (hidden_size and vocab_size must equal the target's)."""
  return ml_collections.ConfigDict(dict(
      hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
      head_dim=64, intermediate_size=512, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=264,
      block_size=16, target_layer_ids=(0, 1, 2, 3), mask_token_id=ByteTokenizer.mask_id,
      num_target_layers=4))


def _train_target(size: str):
  """The target training run (kdtree_jax/train_target.py): full = one H200, cpu = reduced."""
  c = ml_collections.ConfigDict()
  c.model = model_fields()
  c.heldout_files = data.HELDOUT_FILES
  c.heldout_topics = data.HELDOUT_TOPICS
  c.overfit_one_batch = False  # debug / test: train on batch 0 every step
  c.seed = 0
  c.init_std = 0.02
  c.seq_len = 512
  c.batch = 64
  c.steps = 6000
  c.max_seconds = 250.0  # 0 = no time limit
  c.lr = 3e-3
  c.min_lr_frac = 0.05
  c.warmup_frac = 0.03
  c.b1, c.b2 = 0.9, 0.95
  c.weight_decay = 0.1
  c.grad_clip = 1.0
  c.bias_update_rate = 1e-3  # aux-loss-free MoE balancing step (DeepSeek-V3 gamma)
  c.compute_dtype = "bfloat16"
  c.log_every = 50
  c.eval_every = 500
  c.eval_batches = 4
  c.eval_batch = 32
  c.ckpt_every = 1000
  c.out_dir = "runs/k2tiny/hf/target"
  c.work_dir = "runs/k2tiny/target"
  c.save_format = "bfloat16"
  if size == "cpu":
    c.update(dict(seq_len=128, batch=8, steps=30, max_seconds=0.0, compute_dtype="float32",
                  log_every=5, eval_every=15, eval_batches=2, eval_batch=8, ckpt_every=15,
                  out_dir="runs/k2tiny_cpu/target", work_dir="runs/k2tiny_cpu/state/target"))
  return c


def _train_draft(size: str):
  """The draft training run (kdtree_jax/train_draft.py): full = one H200, cpu = reduced."""
  c = ml_collections.ConfigDict()
  c.draft = draft_fields()
  c.target_checkpoint = "runs/k2tiny/hf/target"  # what train.target wrote (its out_dir)
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
  return c


def get_config(preset: str = ""):
  """The decode fields of the trained pair + `train` (preset '' = full-size training, 'cpu')."""
  if preset not in ("", "cpu"):
    raise ValueError(f"preset {preset!r} must be '' (full-size training) or 'cpu' (reduced)")
  size = preset or "full"
  c = run_config.trained_pair()
  c.train = ml_collections.ConfigDict(dict(target=_train_target(size), draft=_train_draft(size)))
  return c
