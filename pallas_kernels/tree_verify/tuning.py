"""Tuning knobs for the Mosaic GPU tree-verify kernel and a shape heuristic."""

import dataclasses

import jax.numpy as jnp

NUM_SMS = 132  # H200 SXM
BLOCK_M = 64   # rows = (node, head) pairs per tile; one wgmma M
BLOCK_KV = 64  # cache rows per streamed KV tile (a tile reads 3 mask words: 64 keys at most)
PARTIALS_DTYPE = jnp.bfloat16  # split partials O (half f32's write + merge read; rel err ~2^-9)
SMEM_BYTES = 232448  # sm90 dynamic shared memory per CTA (227 KiB)
MIN_TILES_PER_SPLIT = 2  # a split below this pays its Q load and epilogue for too little streaming
SWAP_AB_MAX_ROWS = 8  # default_tuning's swap-AB bound on N*H (the measured shape; see there)
SWAP_AB_MAX_SPLITS = 128  # default_tuning's split cap at those rows (measured; see there)
MERGES = ("xla", "triton")  # the split merge: combine.py (XLA, ~3 kernels) or merge_triton.py (1)
CLUSTER_ROWS = (1, 2, 4)  # Tuning.cluster_rows: off, or row tiles per cluster (multicast KV)
MERGE_COLS = (32, 64, 128, 256, 512)  # Tuning.merge_cols


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Static kernel configuration. Tried on an H200 / H100 and removed (notes/kernel.md "Tried and
  removed"): the v1 kernel, 32-key tiles, an L2 prefetch ahead of the ring, both warpgroups
  scoring (shared_p=False), f32 split partials, the split merge inside the kernel
  (merge='kernel', merge_chunk)."""
  num_splits: int = 1     # split-KV factor (grid axis); 1: the kernel writes the final output
  stages: int = 2         # KV tiles in flight (SMEM ring depth; kernel.smem_bytes <= SMEM_BYTES)
  swap_ab: bool = False    # M = N*H < 64 rows: keys as the wgmma M side, q rows its N
                           # (kernel_swap.py: no 64-row Q tile for 8 real rows)
  merge: str = "xla"      # the split merge (MERGES)
  cluster_rows: int = 1   # N*H >= 128: CTAs of one split's row tiles in a cluster of this size
                          # (1 = off); each streamed KV tile is TMA-multicast to all of them, so
                          # a split's tile leaves L2 once instead of once per row tile
  merge_cols: int = 64    # merge="triton": value columns per merge program (a power of 2)
  balanced_splits: bool = False  # split s gets floor or ceil(tiles / S) KV tiles (every split
                          # streams) instead of ceil(tiles / S) each with the last splits empty
                          # (N=1, L=46k: 59 x 6 + 73 x 5 tiles on 132 SMs, not 119 x 6 + 5 on 120)
  merge_loads_first: bool = False  # merge="triton": each program issues its partial block's loads
                          # before the LSE loads and reductions (two GMEM round trips in flight
                          # at once instead of one after the other)
  pdl: bool = False       # kernel.py, kernel_swap.py: programmatic dependent launch
                          # (pallas_kernels.pdl): griddepcontrol.wait before the first read of
                          # lengths / Q / cache / mask words (all of them: the step writes this
                          # step's cache rows), launch_dependents once a warpgroup's last load is
                          # issued (memory wg: last KV tile; compute wgs: after the tile loop,
                          # before the epilogue). No-op in interpret mode

  def __post_init__(self):
    if self.num_splits < 1 or self.stages < 2:
      raise ValueError(f"need num_splits >= 1 and stages >= 2, got {self}")
    if self.cluster_rows not in CLUSTER_ROWS or self.merge_cols not in MERGE_COLS:
      raise ValueError(f"{self.cluster_rows=} must be in {CLUSTER_ROWS}, "
                       f"{self.merge_cols=} in {MERGE_COLS}")
    if self.merge not in MERGES:
      raise ValueError(f"{self.merge=} must be in {MERGES}")


def num_row_tiles(n, h):
  """Number of 64-row tiles covering the N*H (node, head) rows."""
  return -(-(n * h) // BLOCK_M)


def default_splits(b, n, h, l, num_sms=NUM_SMS):
  """Splits so that (row tiles x batch x splits) CTAs fill the SMs in one wave, each split
  streaming at least MIN_TILES_PER_SPLIT KV tiles of the L cache rows."""
  ctas = num_row_tiles(n, h) * b
  kv_tiles = max(1, -(-l // 64))
  return max(1, min(num_sms // ctas, kv_tiles // MIN_TILES_PER_SPLIT))


def default_tuning(b, n, h, l):
  """The default knobs for a shape."""
  splits = default_splits(b, n, h, l)
  # The Triton merge (one kernel) beats XLA's (~3) wherever there is a merge: H200, L=46000, H=8
  # (WORKSPACE.md, third session): N=1 23.7 vs 25.8 us, N=8 27.9 vs 32.1, N=16 34.2 vs 38.9, N=64
  # 99.5 vs 98.4 (within noise).
  # swap-AB (kernel_swap.py) where the 64-row Q tile would hold at most 8 real rows (ar at one
  # GPU's 8 heads): H200, L=46000, N=1, H=8 (WORKSPACE.md, fifth session): 21.4 vs 23.6 us (bool
  # mask), 20.3 vs 22.5 (packed mask), same rel err 1.2e-3; unmeasured at 9..63 rows.
  # At those rows (ar's one token), splits capped at 128 with every split streaming (balanced)
  # and the merge's partial loads issued first: H200, L=46000, N=1, H=8, packed mask, one run
  # (2026-12-05, results/h200/2026-12-05/s11_verify_probes.log): 20.3 -> 19.3 us (each alone
  # 19.6 / 20.1 / 19.7), rel err 1.18e-3 vs 1.22e-3; unmeasured elsewhere, so only there.
  swap = n * h <= SWAP_AB_MAX_ROWS
  if swap:
    splits = min(splits, SWAP_AB_MAX_SPLITS)
  return Tuning(num_splits=splits, merge="triton" if splits > 1 else "xla", swap_ab=swap,
                balanced_splits=swap and splits > 1, merge_loads_first=swap and splits > 1)
