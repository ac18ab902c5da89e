"""Static settings of one decoding run (hashable: part of the jit cache key)."""

import dataclasses
from typing import Any, Callable

from kdtree_jax.cli import UsageError
from kdtree_jax.decoding.sampling import SamplingConfig, target_choice as own_choice

MODES = ("ar", "chain", "ddtree")
TREE_IMPLS = ("auto", "xla", "pallas", "interpret")  # kdtree_jax.tree.TREE_IMPLS
# budget="auto": tree node counts compiled (8k - 1 nodes: with the root, x 8 heads = 64k rows).
AUTO_NODE_COUNTS = (7, 15, 31, 63)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """mode: 'ar' (no draft), 'chain' (DFlash greedy block), 'ddtree' (best-first tree of `budget`)."""

  mode: str = "ddtree"
  budget: int | str = 32  # or 'auto': per step, the width of most tokens per modelled second
  block_size: int = 16
  max_new_tokens: int = 128
  sampling: SamplingConfig = SamplingConfig()
  attn_backend: str = "auto"
  # (spec, tree, logits [B, N, V], key, room [B]) -> (choice [B, N], room): the token the target
  # picks at every node. Benchmarks with random weights pass forced_accept.ForcedAccept(n) (a
  # fixed acceptance pattern); decoding itself always uses the target's own choice.
  target_choice: Callable = own_choice
  # budget='auto' only: a decoding.budget.AutoBudget (node counts, cost table, acceptance
  # calibration); None = default node counts and the analytic cost of the run's own target.
  auto: Any = None
  # DDTree's builder after the top-k (kdtree_jax.tree.build_ddtree impl): 'auto' (the default:
  # 'pallas' where the step is lowered for a CUDA GPU at budgets up to 34 nodes, 'xla' elsewhere
  # and above: the kernel at budget 63 took 5.9 ms per step on an H100), 'xla' (sorts: 56
  # kernels per step at budget 15 / block 16, deviceless H200) or 'pallas' (one Pallas Triton
  # program + 2 pad fusions, the same tree node for node: tree phase 0.237 -> 0.104 ms, K2.6's
  # 61-layer DDTree 15 loop 9.857 -> 9.643 ms/step, H200 2026-12-05; GPU test 5 passed on the
  # H100); 'interpret' runs that kernel in Pallas interpret mode, for CPU tests.
  tree_impl: str = "auto"

  def __post_init__(self):
    if self.mode not in MODES:
      raise UsageError("mode", f"{self.mode!r} is not a mode; choose one of {', '.join(MODES)}")
    if isinstance(self.budget, str) and self.budget != "auto":
      raise UsageError("budget", f"{self.budget!r} is not a budget; give a node count (e.g. 32) "
                       "or 'auto'")
    if self.budget == "auto" and self.mode != "ddtree":
      raise UsageError("budget", f"'auto' chooses DDTree widths; it needs mode 'ddtree', not "
                       f"{self.mode!r}")
    if self.mode == "ddtree" and self.budget != "auto" and self.budget < 1:
      raise UsageError("budget", f"{self.budget} is too small; ddtree verifies budget >= 1 "
                       "tree nodes per step (e.g. 32)")
    if self.mode != "ar" and self.block_size < 2:
      raise UsageError("draft.block_size", f"{self.block_size} is too small; mode "
                       f"{self.mode!r} drafts block_size - 1 >= 1 tokens per step")
    if self.tree_impl not in TREE_IMPLS:
      raise UsageError("tree_impl", f"{self.tree_impl!r} is not a tree builder; choose one of "
                       f"{', '.join(TREE_IMPLS)}")
    if self.max_new_tokens < 1:
      raise UsageError("max_new_tokens", f"{self.max_new_tokens} is too small; it must be >= 1")

  @property
  def depth(self) -> int:
    """Deepest draft node (block positions 1 .. block_size - 1); 0 for ar."""
    return 0 if self.mode == "ar" else self.block_size - 1

  @property
  def verify_width(self) -> int:
    """N: tree nodes verified per step, root (the bonus token) included."""
    return {"ar": 1, "chain": self.block_size, "ddtree": self.max_budget + 1}[self.mode]

  @property
  def max_budget(self) -> int:
    """Tree nodes built per step: `budget`, or the largest compiled width of budget='auto'."""
    if self.budget != "auto":
      return self.budget
    return self.auto.max_nodes if self.auto is not None else AUTO_NODE_COUNTS[-1]

  @property
  def commit_width(self) -> int:
    """Most tokens one step can commit (accepted nodes + the root)."""
    return self.depth + 1
