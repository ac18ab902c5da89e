"""The run config (ml_collections) that every configs/*.py builds on: one place for its fields.

Sections: the decode fields below (every config has them), `target` / `draft` (`model_ref`),
`bench` + `block_size` / `forced_accept` in benchmark configs (`bench_config`), `train.target` /
`train.draft` in configs/k2tiny.py (the training runs of the shipped pair).

Fields a newcomer sets most (`--config.<field>=value` on scripts/decode.py):
  max_len              cache rows: prompt + generated tokens must fit (default 1024; k2tiny 512)
  target.checkpoint    HF or orbax directory of the target ('' = random preset target.preset)
  draft.checkpoint     DFlash directory of the draft ('' = random preset draft.preset, or none)
  tokenizer            auto | bytes | tiktoken | none
  trained_positions    positions the target was trained on (0 = unknown): a warning beyond them
  memory_limit_gb      per-device memory bound checked before compiling (0 = what the device has)
  auto_tables          budget=auto: tables AUTO.step_cost.json / AUTO.accept.json (step_cost.py)
"""

import ml_collections
from ml_collections import config_dict

from kdtree_jax.cli import UsageError

MODES = ("ar", "chain", "ddtree")
DTYPES = ("float32", "bfloat16")
TOKENIZERS = ("auto", "bytes", "tiktoken", "none")
ATTN_BACKENDS = ("auto", "pallas", "interpret", "xla")


def model_ref(checkpoint="", preset="", seed=0, **extra):
  """A target or draft: a checkpoint directory (HF or orbax), or a random-init preset."""
  return ml_collections.ConfigDict(dict(checkpoint=checkpoint, preset=preset, seed=seed, **extra))


def decode_config(target, draft, **overrides):
  """Every field scripts/decode.py reads, with defaults; `overrides` replace any of them."""
  c = ml_collections.ConfigDict(dict(
      target=target, draft=draft,
      tokenizer="auto",  # auto (what the target checkpoint has) | bytes | tiktoken
      mode="ddtree", budget=config_dict.FieldReference(32, field_type=object),  # int | 'auto'
      max_new_tokens=128, max_len=1024,
      temperature=0.0, top_k=0, top_p=1.0, seed=0,
      dtype="float32", attn_backend="auto", prompt="def fibonacci(n):\n", mesh="",
      trained_positions=0, memory_limit_gb=0.0,
      auto_tables=""))  # budget auto: stem of X.step_cost.json / X.accept.json ('' = the config's)
  unknown = set(overrides) - set(c.keys())
  if unknown:
    raise ValueError(f"unknown decode config fields {sorted(unknown)}; known: {sorted(c.keys())}")
  c.update(overrides)
  return c


def bench_config(target, draft, *, block_size, forced_accept, bench=None, **overrides):
  """A benchmark run: every decode field, plus the block size of a random-preset draft, the fixed
  acceptance pattern (`forced_accept` tokens per step: random weights accept nothing) and, when
  given, the `bench` section the bench scripts read (modes, contexts, repetitions, time boxes)."""
  c = decode_config(target, draft, **overrides)
  c.block_size = block_size
  c.forced_accept = forced_accept
  if bench is not None:
    c.bench = ml_collections.ConfigDict(bench)
  return c


# The k2tiny target was trained on 512-token sequences (configs/k2tiny.py train.target.seq_len); its
# config.json claims 2048 positions (YaRN factor 4 over 512), which it never saw in training.
K2TINY_TRAINED_POSITIONS = 512


def trained_pair(**overrides):
  """The shipped k2tiny target + DFlash draft (checkpoints/k2tiny, HF formats). budget='auto' by
  default: its tables exist (configs/k2tiny.step_cost.json, measured on the H200, and
  configs/k2tiny.accept.json), so decode runs the program of most modelled tokens per second."""
  kw = dict(max_len=K2TINY_TRAINED_POSITIONS, trained_positions=K2TINY_TRAINED_POSITIONS,
            auto_tables="configs/k2tiny", budget="auto")
  kw.update(overrides)
  return decode_config(model_ref("checkpoints/k2tiny/target"),
                       model_ref("checkpoints/k2tiny/draft", seed=1), **kw)


def _one_of(c, field, allowed):
  if c[field] not in allowed:
    raise UsageError(field, f"{c[field]!r} is not allowed; choose one of {', '.join(allowed)}")


def _at_least(c, field, low, why=""):
  if c[field] < low:
    raise UsageError(field, f"{c[field]} is too small; it must be >= {low}{why}")


def validate(c):
  """Checks every plain field of a decode config; UsageError names the field and what is allowed."""
  _one_of(c, "mode", MODES)
  _one_of(c, "dtype", DTYPES)
  _one_of(c, "tokenizer", TOKENIZERS)
  _one_of(c, "attn_backend", ATTN_BACKENDS)
  if c.mode == "ddtree" and c.budget != "auto":  # 'auto': decoding.budget picks widths
    if not isinstance(c.budget, int):
      raise UsageError("budget", f"{c.budget!r} is neither a whole number nor 'auto' (tree nodes "
                       "verified per step, e.g. 32)")
    _at_least(c, "budget", 1, " (tree nodes verified per step; e.g. 32)")
  _at_least(c, "max_new_tokens", 1)
  _at_least(c, "max_len", 2, " (cache rows for prompt + generated tokens)")
  _at_least(c, "temperature", 0.0, " (0 = greedy)")
  _at_least(c, "top_k", 0, " (0 = off)")
  _at_least(c, "trained_positions", 0, " (0 = unknown)")
  _at_least(c, "memory_limit_gb", 0.0, " (0 = what the device reports)")
  if not 0.0 < c.top_p <= 1.0:
    raise UsageError("top_p", f"{c.top_p} is outside (0, 1] (1.0 = off)")
  if not c.prompt:
    raise UsageError("prompt", "is empty; give at least one character")
  if not c.target.checkpoint and not c.target.preset:
    raise UsageError("target.checkpoint", "is empty and so is --config.target.preset; give a "
                     "checkpoint directory or a preset (tiny, kimi_k2_6)")
  return c
