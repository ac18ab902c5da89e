"""Static settings of one decoding run (hashable: part of the jit cache key)."""

import dataclasses

from kdtree_jax.decoding.sampling import SamplingConfig

MODES = ("ar", "chain", "ddtree")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """mode: 'ar' (no draft), 'chain' (DFlash greedy block), 'ddtree' (best-first tree of `budget`)."""

  mode: str = "ddtree"
  budget: int = 32
  block_size: int = 16
  max_new_tokens: int = 128
  sampling: SamplingConfig = SamplingConfig()
  attn_backend: str = "auto"
  # Benchmarks with random weights only: the target "agrees" with the draft along the first-child
  # spine for `forced_accept` nodes (a fixed acceptance pattern). -1 = real acceptance.
  forced_accept: int = -1

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode {self.mode!r} must be one of {MODES}")
    if self.mode == "ddtree" and self.budget < 1:
      raise ValueError(f"{self.budget=} must be >= 1 for ddtree")
    if self.mode != "ar" and self.block_size < 2:
      raise ValueError(f"{self.block_size=} must be >= 2 to draft anything")
    if self.max_new_tokens < 1:
      raise ValueError(f"{self.max_new_tokens=} must be >= 1")

  @property
  def depth(self) -> int:
    """Deepest draft node (block positions 1 .. block_size - 1); 0 for ar."""
    return 0 if self.mode == "ar" else self.block_size - 1

  @property
  def verify_width(self) -> int:
    """N: tree nodes verified per step, root (the bonus token) included."""
    return {"ar": 1, "chain": self.block_size, "ddtree": self.budget + 1}[self.mode]

  @property
  def commit_width(self) -> int:
    """Most tokens one step can commit (accepted nodes + the root)."""
    return self.depth + 1
