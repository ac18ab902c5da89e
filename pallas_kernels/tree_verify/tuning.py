"""Tuning knobs for the Mosaic GPU tree-verify kernel and a shape heuristic."""

import dataclasses

NUM_SMS = 132  # H200 SXM
BLOCK_M = 64   # rows = (node, head) pairs per tile; one wgmma M


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Static kernel configuration."""
  block_kv: int = 64      # cache rows per streamed tile
  num_splits: int = 1     # split-KV factor (grid axis); partials combined in XLA
  stages: int = 2         # KV tiles in flight (SMEM ring depth)
  shared_p: bool = True   # wg0 scores and shares P via SMEM (no redundant QK^T); else both wgs score

  def __post_init__(self):
    if self.block_kv % 64 or self.block_kv <= 0:
      raise ValueError(f"{self.block_kv=} must be a positive multiple of 64")
    if self.shared_p and self.block_kv != 64:
      raise ValueError("shared_p needs block_kv == 64 (SMEM budget)")
    if self.num_splits < 1 or self.stages < 2:
      raise ValueError(f"need num_splits >= 1 and stages >= 2, got {self}")


def num_row_tiles(n, h):
  """Number of 64-row tiles covering the N*H (node, head) rows."""
  return -(-(n * h) // BLOCK_M)


def default_tuning(b, n, h, l):
  """Heuristic: enough (row tile, split, batch) CTAs to fill the SMs, splits of >= 8 KV tiles."""
  ctas = num_row_tiles(n, h) * b
  tiles = max(1, -(-l // 64))
  splits = max(1, min(NUM_SMS // max(ctas, 1), tiles // 8, 64))
  return Tuning(num_splits=splits)
