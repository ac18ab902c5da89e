"""The decode run config (ml_collections) that configs/*.py build on: one place for its fields."""

import ml_collections


def model_ref(checkpoint="", preset="", seed=0, **extra):
  """A target or draft: a checkpoint directory (HF or orbax), or a random-init preset."""
  return ml_collections.ConfigDict(dict(checkpoint=checkpoint, preset=preset, seed=seed, **extra))


def decode_config(target, draft, **overrides):
  """Every field scripts/decode.py reads, with defaults; `overrides` replace any of them."""
  c = ml_collections.ConfigDict(dict(
      target=target, draft=draft,
      tokenizer="auto",  # auto (what the target checkpoint has) | bytes | tiktoken
      mode="ddtree", budget=32, max_new_tokens=128, max_len=1024,
      temperature=0.0, top_k=0, top_p=1.0, seed=0,
      dtype="float32", attn_backend="auto", prompt="def fibonacci(n):\n", mesh=""))
  unknown = set(overrides) - set(c.keys())
  if unknown:
    raise ValueError(f"unknown decode config fields {sorted(unknown)}")
  c.update(overrides)
  return c


def trained_pair(**overrides):
  """The shipped k2tiny target + DFlash draft (checkpoints/k2tiny, HF formats)."""
  return decode_config(model_ref("checkpoints/k2tiny/target"),
                       model_ref("checkpoints/k2tiny/draft", seed=1), **overrides)
