"""The split merge inside the tree-verify kernel (Tuning(merge="kernel"); stream-K "fixup").

Letters: B batch, S splits, M rows, R value width, K ring slots.

Every CTA (row tile, split, batch) but the last split's writes its normalised partial O and base-2
LSE to GMEM (the kernel's partial outputs) and then each compute warpgroup signals a per (batch,
row tile) GMEM counter (`red.release.gpu` after its TMA store has completed: the partial is
visible before the count). The CTA of the HIGHEST split index merges: after its own split it
waits until the counter reaches 2 (S - 1), then its TMA warpgroup streams the other splits'
partials through a K-slot SMEM ring (the union's KV space: `ring_slots`) and each compute
warpgroup folds them into its own O half, online-softmax style (weights 2^(lse_s - max)), then
writes the final output (q dtype) and the natural LSE. CTAs launch roughly in grid order, so the
one waiting CTA of a (batch, row tile) only waits for CTAs that started before it, and none of
them waits: no deadlock whatever the grid size.

The counters: `pl.get_global(SemaphoreType.REGULAR((B * tiles,)))`, a GMEM scratch that Pallas
zero-fills before every call; the waiter decrements it back to 0 (`semaphore_wait`). The GPU
interpreter has no GMEM semaphores (get_global cannot be interpreted in jax 0.11.2) but runs the
grid one CTA after the other in grid order, so there the signal and the wait are left out: the
merging CTA runs after every other split of its row tile. The handshake itself is checked only
by the CUDA lowering and the GPU tests.

Orientation: kernel.py holds a row tile as [64, R/2] (rows along axis 0, statistics as [64] row
vectors); kernel_swap.py as O^T [R/2, M] (statistics along axis 1). `Orientation` carries the
statistics' layout, their broadcast and the load of a ring tile.
"""

import dataclasses
from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

MAX_RING_SLOTS = 16  # partial tiles in flight to the merging CTA (8 KB each at M = 8); 2 x 16
                     # half barriers: Mosaic's limit of 32 barriers a group


@dataclasses.dataclass(frozen=True)
class Orientation:
  """How a kernel holds a [rows, R/2] output half in registers (see the module docstring)."""
  stat_layout: object                       # layout of a [rows] statistic
  bcast: Callable                           # ([rows] statistic, tile shape) -> tile
  load_tile: Callable                       # SMEM half [64 or M, R/2] -> register tile (f32)


def enabled(t) -> bool:
  """Whether the kernel merges its splits itself."""
  return t.merge == "kernel" and t.num_splits > 1


def check_supported(t, dtype):
  """Trace-time: the ring holds bf16 partials and doubles as the final output's staging."""
  if enabled(t) and (not t.bf16_partials or jnp.dtype(dtype) != jnp.bfloat16):
    raise ValueError(f"merge='kernel' needs bf16 q and bf16 partials; got {dtype}, {t}")


def ring_slots(num_splits, slot_bytes, space_bytes):
  """Ring slots for the other S - 1 splits' partials in `space_bytes` of SMEM (the union's
  Q / KV / P space); at least 1 (slot 0 is also the final output's staging)."""
  return max(1, min(num_splits - 1, space_bytes // slot_bytes, MAX_RING_SLOTS))


def counters(t, tiles, b, interpret):
  """The per (batch, row tile) GMEM counters (None in the interpreter); call once per kernel."""
  if not enabled(t) or interpret:
    return None
  return pl.get_global(plgpu.SemaphoreType.REGULAR((b * tiles,)))


def _counter(c):
  return c.sem.at[c.b * c.tiles + c.m_idx]


def is_merger(c):
  return c.s_idx == c.t.num_splits - 1


def signal_written(c):
  """A compute warpgroup's partial half (and wg0's LSE) is in GMEM: count it (the TMA store
  was awaited first, and the signal is a release)."""
  if not c.interpret:
    plgpu.semaphore_signal(_counter(c), 1, memory_scope="gpu")


def memory_wg(c):
  """Merging CTA's TMA warpgroup, after its KV stream: once both compute warpgroups are past the
  union's Q / KV / P (merge_go) and every other split has signalled, load split j's LSE and O
  halves into ring slot j % K."""
  k, others = c.ring.shape[0], c.t.num_splits - 1
  plgpu.barrier_wait(c.merge_go)
  if not c.interpret:
    plgpu.semaphore_wait(_counter(c), 2 * others, memory_scope="gpu")
  rows = pl.ds(pl.multiple_of(c.m_idx * c.window, c.window), c.window)
  r2 = c.r // 2

  @pl.loop(0, others)
  def _load(j):
    slot = lax.rem(j, k)

    @pl.when(j >= k)
    def _():
      plgpu.barrier_wait(c.ring_free.at[slot])

    plgpu.copy_gmem_to_smem(c.part_lse_ref.at[c.b, j, rows], c.lse_ring.at[slot, pl.ds(0, c.window)],
                            c.lse_bar.at[slot])
    for w in range(2):
      dst = c.ring.at[slot, w]
      dst = dst if dst.shape[0] == c.window else dst.at[pl.ds(0, c.window)]
      plgpu.copy_gmem_to_smem(c.part_o_ref.at[c.b, j, rows, pl.ds(w * r2, r2)], dst,
                              c.half_bar.at[2 * slot + w])

  @pl.loop(jnp.maximum(others - k, 0), others)
  def _drain(j):
    plgpu.barrier_wait(c.ring_free.at[lax.rem(j, k)])


def merge_wg(c, w, o, lse2, orient: Orientation):
  """Compute warpgroup w of the merging CTA: its normalised O half `o` (f32) and the split's
  base-2 LSE, folded with the other splits' partials from the ring; returns (out, lse2) merged
  (rows that saw no key: O 0, LSE -inf)."""
  k = c.ring.shape[0]
  plgpu.barrier_arrive(c.merge_go)
  den = jnp.where(lse2 == -jnp.inf, 0.0, 1.0)

  def step(j, carry):
    o, m, den = carry
    slot = lax.rem(j, k)
    plgpu.barrier_wait(c.lse_bar.at[slot])
    plgpu.barrier_wait(c.half_bar.at[2 * slot + w])
    lse_s = plgpu.load(c.lse_ring.at[slot], layout=orient.stat_layout, optimized=False)
    o_s = orient.load_tile(c.ring.at[slot, w])
    plgpu.barrier_arrive(c.ring_free.at[slot])
    m_new = jnp.maximum(m, lse_s)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: weights 0, not NaN
    alpha, beta = jnp.exp2(m - m_use), jnp.exp2(lse_s - m_use)
    o = o * orient.bcast(alpha, o.shape) + o_s * orient.bcast(beta, o.shape)
    return o, m_new, den * alpha + beta

  o, m, den = lax.fori_loop(0, c.t.num_splits - 1, step, (o, lse2, den))
  nonempty = den > 0.0
  safe = jnp.where(nonempty, den, 1.0)
  return (o * orient.bcast(1.0 / safe, o.shape),
          jnp.where(nonempty, m + jnp.log2(safe), -jnp.inf))
