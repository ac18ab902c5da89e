"""The shipped default = the trained pair: k2tiny target (K2.6 architecture, byte level) + its DFlash draft.

Trained here on the Python standard library (scripts/train_pair_gpu.sh); checkpoints in
checkpoints/k2tiny/{target,draft} (HF formats).
  python scripts/decode.py                      (this file is the default --config)
  python scripts/decode.py --mode chain --prompt "import os"
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.target = ml_collections.ConfigDict(dict(checkpoint="checkpoints/k2tiny/target", preset="",
                                            seed=0))
  c.draft = ml_collections.ConfigDict(dict(checkpoint="checkpoints/k2tiny/draft", preset="",
                                           seed=1))
  c.tokenizer = "auto"  # bytes | tiktoken | auto: what the target checkpoint has
  c.mode = "ddtree"
  c.budget = 32
  c.max_new_tokens = 128
  c.max_len = 1024
  c.temperature = 0.0
  c.top_k = 0
  c.top_p = 1.0
  c.seed = 0
  c.dtype = "float32"
  c.attn_backend = "auto"
  c.prompt = "def fibonacci(n):\n"
  c.mesh = ""
  return c
