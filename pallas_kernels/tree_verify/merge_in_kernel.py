"""The split merge inside the tree-verify kernel (Tuning(merge="kernel"); stream-K "fixup").

Letters: B batch, S splits, M rows, R value width, K ring slots, G chunk (Tuning.merge_chunk).

Every CTA (row tile, split, batch) that is not a leader writes its normalised partial O and
base-2 LSE to GMEM (the kernel's partial outputs), then each of its compute warpgroups signals a
GMEM counter of its (batch, row tile) (after its TMA store has completed: a
`fence.proxy.async.global`, then `red.release.gpu`; the partial is visible before the count).
One level (merge_chunk 0): the CTA of the HIGHEST split index is the one leader; after its own
split it waits until the counter reaches 2 (S - 1) (acquire, then a proxy fence before its TMA
loads), then its TMA warpgroup streams the other splits' partials through a K-slot SMEM ring (the
union's KV space: `ring_slots`) and each compute warpgroup folds them into its own O half,
online-softmax style (weights 2^(lse_s - max)), then writes the final output (q dtype) and the
natural LSE. Two levels (merge_chunk G): splits [qG, (q + 1)G) form chunk q with its own counter;
each chunk's last split merges the chunk into its own partial slot and signals a leaders'
counter; the last split (its chunk's leader) then also folds the other chunks' results: ~G + S / G
partials on the longest path instead of S - 1 (the merge is one SM's reads). CTAs launch roughly
in grid order and a CTA waits only for lower splits of its (batch, row tile), which started
before it and never wait for a higher one: no deadlock whatever the grid size.

History: built 2026-12-01 (c4a8613 .. 86fd892), removed in f6e3aa5 after its first H200 call
faulted with CUDA_ERROR_MISALIGNED_ADDRESS; rebuilt 2026-12-05 with the LSE ring's slots padded
to 128 bytes (`lse_slot_floats`; notes/kernel.md "The split merge inside the kernel, rebuilt").
TMA alignment, every copy of the merge path (PTX: a tensor TMA's SMEM address 128-byte aligned,
and 1024 for the 128-byte swizzle's pattern; a 1-D `cp.async.bulk` 16-byte aligned, 16-byte
multiple; Pallas starts every scratch buffer and every member of a RefUnion group at 1 KiB):
- ring LSE loads (tensor TMA: Pallas' default oob mode ZEROS): slot j at a multiple of 128 bytes
  from the LSE ring's 1 KiB-aligned start (the fault's likeliest cause was 32-byte slots at M = 8).
- ring O-half loads (tensor TMA, 128-byte swizzle): slot j half w at (2j + w) * rows * R bytes
  from the ring's 1 KiB-aligned start: rows * R = 8 * 512 = 4 KiB at M = 8, 32 KiB at 64 rows.
- the output staging (slot 0, the kernels' `_store`, tensor TMA store): the ring's start.
- the LSE store (contiguous, Pallas' store default UNDEFINED: a 1-D bulk copy): the start of its
  own 1 KiB-aligned buffer (kernel.py lse_smem, kernel_swap stats row 0); 4 * window bytes at
  GMEM byte offset 4 ((b S + split) M + row tile * window): M and window are multiples of 8, so
  32-byte sizes and offsets (the ring's LSE loads read the same windows).

The counters: `pl.get_global(SemaphoreType.REGULAR(...))`, a GMEM scratch that Pallas
zero-fills before every call; each waiter decrements its count back to 0 (`semaphore_wait`). The
GPU interpreter has no GMEM semaphores (get_global cannot be interpreted in jax 0.11.2) but runs
the grid one CTA after the other in grid order, so there the signals, waits and fences are left
out: a leader runs after the splits it merges. The handshake itself is checked only by the CUDA
lowering and the GPU probe / test.

Orientation: kernel.py holds a row tile as [64, R/2] (rows along axis 0, statistics as [64] row
vectors); kernel_swap.py as O^T [R/2, M] (statistics along axis 1). `Orientation` carries the
statistics' layout, their broadcast and the load of a ring tile.
"""

import dataclasses
from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

MAX_RING_SLOTS = 16  # partial tiles in flight to the merging CTA (8 KB each at M = 8); 2 x 16
                     # half barriers: Mosaic's limit of 32 barriers a group
TMA_SMEM_ALIGN = 128  # bytes: a tensor TMA's SMEM address (PTX cp.async.bulk.tensor)
OUT_NAMES = {"final": ("o_ref", "lse_ref"), "partial": ("part_o_ref", "part_lse_ref"),
             "merge": ("o_ref", "lse_ref", "part_o_ref", "part_lse_ref")}
SCRATCH_NAMES = ("lse_bar", "half_bar", "ring_free", "merge_go")


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
  if enabled(t) and jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError(f"merge='kernel' needs bf16 q (its ring doubles as the output's staging); "
                     f"got {dtype}, {t}")


def output_kind(t) -> str:
  """'final' (one split), 'partial' (several, merged after the kernel) or 'merge' (several,
  merged by the kernel: final outputs, then the partials it reads back)."""
  if t.num_splits == 1:
    return "final"
  return "merge" if enabled(t) else "partial"


def named_refs(t, refs, scratch_names):
  """The kernel body's output and scratch refs by name: OUT_NAMES[output_kind(t)], then the
  kernel's `scratch_names` and (merge='kernel') SCRATCH_NAMES."""
  out_names = OUT_NAMES[output_kind(t)]
  names = tuple(scratch_names) + (SCRATCH_NAMES if enabled(t) else ())
  outs, scratch = refs[:len(out_names)], refs[len(out_names):]
  if len(scratch) != len(names):
    raise ValueError(f"{len(scratch)} scratch refs for {names}")
  return dict(zip(out_names, outs)), dict(zip(names, scratch))


def lse_slot_floats(rows):
  """f32 entries of one LSE ring slot: `rows` rounded up to a multiple of 128 bytes, so every
  slot of the ring is a legal tensor-TMA destination (M = 8's 32-byte slots were not: the
  2026-12-01 H200 fault; M = 40's 160-byte ones would not be either)."""
  per = TMA_SMEM_ALIGN // 4
  return -(-rows // per) * per


def _kib(x):
  return -(-x // 1024) * 1024


def ring_slots(t, rows, r, space_bytes):
  """Ring slots for the other S - 1 splits' partials ([2, rows, R/2] bf16 each) beside their
  LSEs in `space_bytes` of SMEM (the union's Q / KV / P member); at least 1 (slot 0 is also the
  final output's staging)."""
  lse_bytes = _kib(MAX_RING_SLOTS * lse_slot_floats(rows) * 4)
  slot_bytes = 2 * rows * (r // 2) * 2
  return max(1, min(t.num_splits - 1, (space_bytes - lse_bytes) // slot_bytes, MAX_RING_SLOTS))


def scratch(t, rows, r, space_bytes, transforms):
  """merge='kernel': the union's second member, the ring of the other splits' partials
  ([K, 2, rows, R/2] bf16 with the kernel's output `transforms`; slot 0 also the output staging)
  and their LSEs [K, lse_slot_floats(rows)] f32, and the ring's barriers (SCRATCH_NAMES' order)."""
  k = ring_slots(t, rows, r, space_bytes)
  ring = plgpu.SMEM((k, 2, rows, r // 2), jnp.bfloat16, transforms=transforms)
  lse_ring = plgpu.SMEM((k, lse_slot_floats(rows)), jnp.float32)
  return (ring, lse_ring), [
      plgpu.Barrier(num_barriers=k), plgpu.Barrier(num_barriers=2 * k),
      plgpu.Barrier(num_arrivals=2, num_barriers=k), plgpu.Barrier(num_arrivals=2)]


def barrier_bytes(t, rows, r, space_bytes):
  """SMEM of `scratch`'s barriers (8 bytes each)."""
  return 8 * (4 * ring_slots(t, rows, r, space_bytes) + 1)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static merge plan: splits in chunks of `chunk` consecutive ones (the last one shorter); one
  chunk (chunk = S, the default) is the one-level merge."""
  splits: int
  chunk: int

  @property
  def chunks(self):
    return -(-self.splits // self.chunk)


def plan(t) -> Plan:
  """Tuning.merge_chunk: 0 (or >= S) one level, else two levels of that chunk size."""
  g = t.merge_chunk
  return Plan(t.num_splits, g if 0 < g < t.num_splits else t.num_splits)


def counters(t, tiles, b, interpret):
  """The GMEM counters (None in the interpreter): per (batch, row tile) one per chunk and one for
  the chunks' leaders. Call once per kernel."""
  if not enabled(t) or interpret:
    return None
  return pl.get_global(plgpu.SemaphoreType.REGULAR((b * tiles * (plan(t).chunks + 1),)))


def _counter(c, i):
  """Counter i of this CTA's (batch, row tile): chunk i's, or (i = chunks) the leaders'."""
  return c.sem.at[(c.b * c.tiles + c.m_idx) * (plan(c.t).chunks + 1) + i]


def _roles(c):
  """(chunk, leader, final, members): this split's chunk; whether it is the chunk's last split
  (which merges the chunk) and the last split (which also merges the other chunks' results);
  the splits of its chunk before it."""
  p = plan(c.t)
  chunk = lax.div(c.s_idx, p.chunk)
  start = chunk * p.chunk
  leader = c.s_idx == jnp.minimum(start + p.chunk, p.splits) - 1
  return chunk, leader, c.s_idx == p.splits - 1, c.s_idx - start


def _sources(c):
  """Partials a leader folds: its chunk's other splits, and (the last split) the other chunks'
  leaders."""
  _, _, final, members = _roles(c)
  return members + jnp.where(final, plan(c.t).chunks - 1, 0)


def _source_split(c, j):
  """Split index of source j (_sources' order)."""
  chunk, _, _, members = _roles(c)
  g = plan(c.t).chunk
  return jnp.where(j < members, chunk * g + j, (j - members + 1) * g - 1)


def _proxy_fence():
  """fence.proxy.async.global: orders the TMA's (async proxy) global accesses with the counter's
  generic-proxy release / acquire (PTX: accesses to one location through two proxies need a
  cross-proxy fence). Every thread of the warpgroup runs it (Lane semantics)."""
  @plgpu.inline_mgpu()
  def fence(_):
    mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)
  fence()


def _signal(c, i):
  """A compute warpgroup's O half (wg0: and the LSE) is in GMEM: count it on counter i (the TMA
  store was awaited first, then a proxy fence; the signal is a release)."""
  if not c.interpret:
    _proxy_fence()
    plgpu.semaphore_signal(_counter(c, i), 1, memory_scope="gpu")


def _wait(c, i, count):
  """Wait (acquire) until counter i reaches count, then a proxy fence before the TMA loads."""
  if not c.interpret:
    plgpu.semaphore_wait(_counter(c, i), count, memory_scope="gpu")
    _proxy_fence()


def finish(c, w, o, lse2, store, orient):
  """The end of compute warpgroup w (o: its normalised O half, f32; lse2: the split's base-2
  LSE). A chunk's leader merges (merge_wg): the last split stores the final output, another
  leader its chunk's merged partial (in its own slot) and signals the leaders' counter; every
  other split stores its partial and signals its chunk's counter. store(c, w, o, lse2, final)."""
  chunk, leader, final, _ = _roles(c)

  @pl.when(leader)
  def _():
    merged = merge_wg(c, w, o, lse2, orient)

    @pl.when(final)
    def _():
      store(c, w, *merged, True)

    @pl.when(jnp.logical_not(final))
    def _():
      store(c, w, *merged, False)
      _signal(c, plan(c.t).chunks)

  @pl.when(jnp.logical_not(leader))
  def _():
    store(c, w, o, lse2, False)
    _signal(c, chunk)


def is_leader(c):
  return _roles(c)[1]


def memory_wg(c):
  """A leader's TMA warpgroup, after its KV stream: once both compute warpgroups are past the
  union's Q / KV / P (merge_go) and its chunk (then, the last split, the other leaders) have
  signalled, load source j's LSE and O halves into ring slot j % K (alignment: module docstring)."""
  k = c.ring.shape[0]
  chunk, _, _, members = _roles(c)
  n = _sources(c)
  plgpu.barrier_wait(c.merge_go)
  _wait(c, chunk, 2 * members)
  rows = pl.ds(pl.multiple_of(c.m_idx * c.window, c.window), c.window)
  r2 = c.r // 2

  @pl.loop(0, n)
  def _load(j):
    slot = lax.rem(j, k)
    split = _source_split(c, j)

    @pl.when(j == members)  # only the last split gets here: the other chunks' results next
    def _():
      _wait(c, plan(c.t).chunks, 2 * (plan(c.t).chunks - 1))

    @pl.when(j >= k)
    def _():
      plgpu.barrier_wait(c.ring_free.at[slot])

    # slot * a multiple of 128 bytes (lse_slot_floats): a legal tensor-TMA destination
    plgpu.copy_gmem_to_smem(c.part_lse_ref.at[c.b, split, rows],
                            c.lse_ring.at[slot, pl.ds(0, c.window)], c.lse_bar.at[slot])
    for w in range(2):
      dst = c.ring.at[slot, w]  # (2 slot + w) * rows * R bytes: 1 KiB multiples
      dst = dst if dst.shape[0] == c.window else dst.at[pl.ds(0, c.window)]
      plgpu.copy_gmem_to_smem(c.part_o_ref.at[c.b, split, rows, pl.ds(w * r2, r2)], dst,
                              c.half_bar.at[2 * slot + w])

  @pl.loop(jnp.maximum(n - k, 0), n)
  def _drain(j):
    plgpu.barrier_wait(c.ring_free.at[lax.rem(j, k)])


def merge_wg(c, w, o, lse2, orient: Orientation):
  """Compute warpgroup w of a leader: its normalised O half `o` (f32) and the split's base-2
  LSE, folded with its sources' partials from the ring; returns (out, lse2) merged (rows that saw
  no key: O 0, LSE -inf)."""
  k = c.ring.shape[0]
  stat_rows = pl.ds(0, lse2.shape[0])  # a slot holds lse_slot_floats >= the statistic's rows
  plgpu.barrier_arrive(c.merge_go)
  den = jnp.where(lse2 == -jnp.inf, 0.0, 1.0)

  def step(j, carry):
    o, m, den = carry
    slot = lax.rem(j, k)
    plgpu.barrier_wait(c.lse_bar.at[slot])
    plgpu.barrier_wait(c.half_bar.at[2 * slot + w])
    lse_s = plgpu.load(c.lse_ring.at[slot, stat_rows], layout=orient.stat_layout,
                       optimized=False)
    o_s = orient.load_tile(c.ring.at[slot, w])
    plgpu.barrier_arrive(c.ring_free.at[slot])
    m_new = jnp.maximum(m, lse_s)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: weights 0, not NaN
    alpha, beta = jnp.exp2(m - m_use), jnp.exp2(lse_s - m_use)
    o = o * orient.bcast(alpha, o.shape) + o_s * orient.bcast(beta, o.shape)
    return o, m_new, den * alpha + beta

  o, m, den = lax.fori_loop(0, _sources(c), step, (o, lse2, den))
  nonempty = den > 0.0
  safe = jnp.where(nonempty, den, 1.0)
  return (o * orient.bcast(1.0 / safe, o.shape),
          jnp.where(nonempty, m + jnp.log2(safe), -jnp.inf))
