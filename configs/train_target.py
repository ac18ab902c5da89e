"""Train the small K2.6-architecture byte-level target (`k2tiny`) on the stdlib corpus.

GPU (one H200, ~4.5 min wall; stops at `steps` (6000) or `max_seconds` (250 s, compile
included), whichever comes first; the lr schedule follows whichever is further along):
  python scripts/train_target.py --config configs/train_target.py
CPU reduced run (same model, 30 steps of 8 x 128 tokens; ~1 min on 2 cores):
  python scripts/train_target.py --config configs/train_target.py:cpu
  (writes runs/k2tiny_cpu/target; the shipped checkpoints/k2tiny is left alone)
Any field can be overridden, e.g. --config.steps=50 --config.batch=4 --config.seq_len=128.
Output (paths relative to the repo root, run from there): HF checkpoint (bf16) in out_dir
(runs/k2tiny/hf/target; the shipped checkpoints/k2tiny is only written with
--write_checkpoints and --config.out_dir=checkpoints/k2tiny/target); orbax train state +
log.jsonl in work_dir (a rerun with the same work_dir resumes).
"""

import ml_collections

from kdtree_jax import data


def model_fields():
  """ModelConfig fields (YaRN given by yarn_factor / yarn_original_max_position_embeddings).

  max_position_embeddings (2048 = YaRN x4 over 512) is what config.json will claim; training
  only sees seq_len (512) positions, so decode configs of the result set trained_positions
  (configs/k2tiny.py: 512) and decode.py warns past it.
  """
  return ml_collections.ConfigDict(dict(
      vocab_size=264, hidden_size=256, intermediate_size=512, moe_intermediate_size=160,
      num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64,
      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
      num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
      routed_scaling_factor=2.5, first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=10000.0,
      yarn_factor=4.0, yarn_original_max_position_embeddings=512, max_position_embeddings=2048,
      bos_token_id=256, eos_token_id=257, pad_token_id=258))


def get_config(size: str = "full"):
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
  elif size != "full":
    raise ValueError(f"size {size!r} must be 'full' or 'cpu'")
  return c
