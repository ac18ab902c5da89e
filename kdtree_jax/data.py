"""Training corpus every machine has: Python's standard library sources and pydoc topic texts.

Documents are byte-tokenised ([BOS] + UTF-8 bytes + [EOS]). A fixed list of module files and
topics is held out (never trained on); the rest is packed into one token stream from which
batches of random windows [B, S + 1] are drawn with a seeded numpy RNG (step-indexed, so a
resumed run sees the same batches).
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig

import numpy as np

from kdtree_jax.tokenizer import ByteTokenizer

# Held out (evaluation only). Files are relative to the stdlib root; topics are pydoc keys.
HELDOUT_FILES = ("textwrap.py", "fractions.py", "heapq.py", "bisect.py", "shlex.py",
                 "graphlib.py", "json/decoder.py", "email/quoprimime.py")
HELDOUT_TOPICS = ("assert", "lambda", "with", "try")
# Never read: tests, third-party packages, codec tables, the topics module (read as texts).
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                       "__pycache__", "encodings", "pydoc_data"})
MAX_FILE_BYTES = 256 * 1024  # larger files are generated tables / giant modules


@dataclasses.dataclass(frozen=True)
class Doc:
  """One document: a name ("file:json/decoder.py" or "topic:assert") and its text."""

  name: str
  text: str


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
  """Sorted relative paths (with '/') of the stdlib *.py files that pass the filters."""
  root = root or stdlib_root()
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
    for fn in filenames:
      path = os.path.join(dirpath, fn)
      if fn.endswith(".py") and os.path.getsize(path) <= MAX_FILE_BYTES:
        out.append(os.path.relpath(path, root).replace(os.sep, "/"))
  return sorted(out)


def _read(path: str) -> str:
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def load_docs(root: str | None = None) -> list[Doc]:
  """All documents, deterministic order: stdlib files, then pydoc topics."""
  from pydoc_data.topics import topics  # noqa: PLC0415 (stdlib; imported on use)
  root = root or stdlib_root()
  docs = [Doc("file:" + rel, _read(os.path.join(root, rel))) for rel in stdlib_files(root)]
  docs += [Doc("topic:" + k, topics[k]) for k in sorted(topics)]
  return docs


def heldout_names(files=HELDOUT_FILES, topics=HELDOUT_TOPICS) -> frozenset[str]:
  return frozenset(["file:" + f for f in files] + ["topic:" + t for t in topics])


def split_docs(docs: list[Doc], heldout: frozenset[str]) -> tuple[list[Doc], list[Doc]]:
  """(train, eval) by name; fails if none of the held-out documents exist here."""
  train = [d for d in docs if d.name not in heldout]
  evals = [d for d in docs if d.name in heldout]
  if not evals:
    raise ValueError(f"none of the held-out documents {sorted(heldout)} exist on this machine")
  return train, evals


def tokenize(docs: list[Doc], tok=ByteTokenizer()) -> np.ndarray:
  """Packed stream of [BOS] + bytes + [EOS] per document, int32."""
  parts = [np.asarray(tok.encode(d.text) + [tok.eos_id], np.int32) for d in docs]
  return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


@dataclasses.dataclass
class Corpus:
  """Train and held-out token streams plus the document names in each."""

  train: np.ndarray
  eval: np.ndarray
  train_names: tuple[str, ...]
  eval_names: tuple[str, ...]

  def batch(self, seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
    """Random training windows [batch, seq_len + 1]; a pure function of (seed, step)."""
    return windows(self.train, np.random.default_rng([seed, step]), batch, seq_len)

  def eval_batches(self, n: int, batch: int, seq_len: int) -> list[np.ndarray]:
    """n fixed held-out batches [batch, seq_len + 1] (evenly spaced windows, no RNG)."""
    span = len(self.eval) - seq_len - 1
    if span <= 0:
      raise ValueError(f"held-out stream ({len(self.eval)} tokens) shorter than seq_len {seq_len}")
    starts = np.linspace(0, span, n * batch).astype(np.int64)
    idx = starts[:, None] + np.arange(seq_len + 1)
    return list(self.eval[idx].reshape(n, batch, seq_len + 1))


def windows(stream: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> np.ndarray:
  """batch random windows of seq_len + 1 tokens from the packed stream."""
  starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
  return stream[starts[:, None] + np.arange(seq_len + 1)]


def build_corpus(heldout_files=HELDOUT_FILES, heldout_topics=HELDOUT_TOPICS, root=None) -> Corpus:
  """Reads the stdlib corpus and splits it by the held-out names."""
  train, evals = split_docs(load_docs(root), heldout_names(heldout_files, heldout_topics))
  return Corpus(tokenize(train), tokenize(evals), tuple(d.name for d in train),
                tuple(d.name for d in evals))
