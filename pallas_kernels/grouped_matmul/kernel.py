"""Mosaic GPU (sm90) grouped expert matmul, bf16 or INT4 weights, driven by a work list.

Letters: M rows of x ((token, expert) pairs sorted by expert), K input width, N output width,
G experts, R rows per work item, S scale group (32 in K2.5/K2.6).

Swap-AB: each CTA computes out^T [BN, R] = W^T [BN, K] @ x^T [K, R] for one work item (one
expert's chunk of <= R rows, work.py) and one BN-column tile, so the wgmma N dimension is the
item's few rows (8..64) instead of a 64-row block of mostly other experts' rows, and an expert
with no rows does no work. A TMA pipeline streams the item's x rows [R, BK] (a row window
starting at any multiple of 8: `pl.Element`) and the expert's weight tile:
- bf16 weights [G, K, N]: the tile [BK, BN] is the wgmma A operand from SMEM, transposed;
- INT4 weights [G, N, K] (output-major, HF's order): the tile [BN, BK] is loaded 64 columns at
  a time into registers, converted i4 -> bf16, scaled, and fed to wgmma as the register A
  operand (no SMEM round trip; `Tuning.a_operand="smem"` stages it through SMEM instead, which
  GPU interpret mode needs); the dequantisation of chunk j+1 overlaps the MMA of chunk j.
The accumulator is stored transposed into SMEM [R, BN] and the item's `size` rows go to HBM with
a ladder of power-of-two TMA stores. Two stacks (gate, up) run as one call: two accumulators over
the same x tiles and silu(gate) * up in the epilogue. `Tuning.splits` > 1 splits K over a third
grid axis (few items cannot fill 132 SMs) into partials (f32 as bf16 hi + lo) that the caller
sums (a gated call then returns the gate and up partials: the SiLU-multiply needs the sums).
The work list (work.py) is an operand: one MoE layer builds it once for its gated and down calls.
The grid's first axis is one CTA column per item, or `Tuning.slots` columns looping over them
(`Tuning.items_smem`: the list is read from SMEM after one TMA). `Tuning.narrow_rows` compiles
a second item path with a narrower x tile and wgmma N, taken by items whose stored rows fit it
(one dequantise per expert of up to R rows, the MMA work of few rows where it has few).
`Tuning.store_once` fences and waits once for every epilogue part; `Tuning.dequant_batch`
dequantises several 64-column chunks per wgmma wait; `Tuning.int4_interleave_stacks`
dequantises gate and up chunk by chunk together (one wait per chunk pair and step);
`Tuning.int4_acc_chains` alternates a stack's chunks over independent accumulators;
`Tuning.int4_scale_concat` builds a chunk's scales without selects; `Tuning.int4_k_packed`
reads weight stacks stored by `kpack.pack_int4_k` with 32-bit loads (`Tuning.int4_k_interleaved`:
stored by `kpairs.pack_int4_k_pairs`, a PRMT-free dequantise).
(32-column pieces against a 64-byte-swizzled x tile, the removed `scale_halves`, passed
interpret mode, which runs only the SMEM-operand path and ignores swizzles, and were wrong
on the H200 with the register operand, 2-3x slower: WORKSPACE.md. Measured no gain or slower
and removed: 32-bit INT4 tile loads relaid out by shuffles, a K step ending without its wgmma
drain, slot columns dispatched in order: notes/int4_small_t.md.) `launch_shape` says what a
call launches (CTAs, K steps, SMEM per CTA).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import kpack, kpairs, work
from pallas_kernels.grouped_matmul.tuning import Tuning
from pallas_kernels import pdl

CHUNK = 64  # K columns per wgmma call (128-byte swizzle of bf16)
_SWIZZLED = (plgpu.TilingTransform((8, CHUNK)), plgpu.SwizzleTransform(128))
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA-layout array


def supports(x_mk, k: int, n: int, group: int | None, t: Tuning) -> bool:
  """bf16/f16 x (bf16 with int4_k_interleaved: its dequantise is bf16's); K a multiple of
  block_k x splits; N of block_n; INT4 group 32 or a multiple of 64."""
  dtypes = (jnp.bfloat16,) if group is not None and t.int4_k_interleaved else (
      jnp.bfloat16, jnp.float16)
  return (x_mk.dtype in dtypes and k % (t.block_k * t.splits) == 0
          and n % t.block_n == 0 and (group is None or group == 32 or group % CHUNK == 0))


def _chunk_scales(s_smem, j, shape, group, block_k, concat=False):
  """Scales of chunk j's [BN, 64] weights: one or two scale rows, broadcast along K.

  Group 32 (K2.6: 32 consecutive K columns share a scale, so every 64-column chunk spans exactly
  scale rows 2j and 2j + 1): a select per register pair on a column iota (16 selects per thread
  and chunk in the lowered module), or `concat`: each row broadcast to [BN, 32] and the two
  joined along K, which in the WGMMA layout (8-column register tiles) only lists registers."""
  def row(r, row_shape=shape):
    vec = plgpu.load(s_smem.at[r], layout=_ROW, optimized=False)
    return lax.broadcast_in_dim(vec, row_shape, [0])
  if group >= CHUNK:
    return row(0 if group >= block_k else (CHUNK * j) // group)
  if concat:
    half = (shape[0], group)
    return jnp.concatenate([row(2 * j, half), row(2 * j + 1, half)], axis=1)
  col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
  return jnp.where(col < group, row(2 * j), row(2 * j + 1))


def _load_int4(q_smem, j, k_packed=False, interpret=False, interleaved=False):
  """Chunk j's [BN, 64] int4 in the WGMMA layout: byte loads (2 values each) in that layout, or
  `k_packed` (a kpack.pack_int4_k stack): 32-bit loads relabelled as WGMMA registers, or with
  `interleaved` (a kpairs.pack_int4_k_pairs stack): the same loads, already bf16 (exact)."""
  chunk = q_smem.at[:, pl.ds(CHUNK * j, CHUNK)]
  if k_packed and interleaved:
    return kpairs.load_chunk(chunk, interpret)
  if k_packed:
    return kpack.load_chunk(chunk, interpret)
  return plgpu.load(chunk, layout=plgpu.Layout.WGMMA, optimized=False)


def _int4_step(accs, x_smem, tiles, w_stage, *, group, block_k, dtype, batch=1,
               scale_concat=False, k_packed=False, interpret=False, chains=1, interleaved=False):
  """One K step: per 64-column chunk, dequantise W^T in registers and issue wgmma.

  tiles: one (q_smem, s_smem) per stack: one stack, or gate and up interleaved
  (`Tuning.int4_interleave_stacks`: each chunk of both stacks dequantised before the wait, and
  one final wait per step instead of one per stack). accs: `chains` accumulators per stack
  (stack a's chunk j into accs[a * chains + j % chains]; `Tuning.int4_acc_chains`: independent
  wgmma chains, summed by the caller). A round of `batch` x chains chunks of every stack is
  dequantised before its wgmmas are issued (more independent loads and conversions in flight
  per wgmma wait); a round's wgmmas overlap the next round's dequantise. w_stage None: the
  registers are wgmma's A operand. Else 2 x (chunks per round) swizzled SMEM buffers [BN, 64]
  that the chunks cycle through (the A-from-SMEM variant; GPU interpret mode needs it).
  """
  n_chunks = block_k // CHUNK
  per_round = batch * chains
  for r, j0 in enumerate(range(0, n_chunks, per_round)):
    ws = []
    for j in range(j0, min(j0 + per_round, n_chunks)):
      for a, (q_smem, s_smem) in enumerate(tiles):
        q = _load_int4(q_smem, j, k_packed, interpret, interleaved)
        scales = _chunk_scales(s_smem, j, q.shape, group, block_k, scale_concat)
        w = q.astype(dtype) * scales.astype(dtype)  # interleaved: q is bf16 already
        if w_stage is not None:  # one stack, one chain: buffer j % (2 batch), as always
          buf = (r % 2) * per_round * len(tiles) + len(ws)
          w_stage[buf] = w
          w = w_stage.at[buf]
        ws.append((accs[a * chains + j % chains], j, w))
    if w_stage is not None:
      plgpu.commit_smem()
    for acc_ref, j, w in ws:
      plgpu.wgmma(acc_ref, w, x_smem.at[:, pl.ds(CHUNK * j, CHUNK)].transpose((1, 0)))
    plgpu.wgmma_wait(len(ws))  # the round before is done: its registers / buffers are free
  plgpu.wgmma_wait(0)  # the pipeline reuses x_smem's slot after this step


def _bf16_step(acc_ref, x_smem, w_smem):
  """One K step: W^T [BN, BK] and x^T [BK, R], both transposed views of SMEM tiles."""
  plgpu.wgmma(acc_ref, w_smem.transpose((1, 0)), x_smem.transpose((1, 0)))
  plgpu.wgmma_wait(0)


def _store_rows(o_smem, o_ref, win, lo, size, col0, t: Tuning, wait=True):
  """Rows [lo, lo + size) of the staged [R, BN] tile (R: o_smem's rows, t.rows or
  t.narrow_rows) -> out rows win + lo.. (power-of-two TMAs); `wait`: until the stores have read
  o_smem (else the caller waits once for several)."""
  start = lo
  rows = 1 << (o_smem.shape[0].bit_length() - 1)  # the largest power of two <= R
  while rows >= 1:
    @pl.when(size & rows != 0)
    def _(rows=rows, start=start):
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, rows)],
                              o_ref.at[pl.ds(win + start, rows), pl.ds(col0, t.block_n)])
    start = start + (size & rows)
    rows //= 2
  if wait:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _store_parts(parts, o_smems, o_refs, win, lo, size, col0, t: Tuning):
  """Each value part through its own SMEM tile to HBM: one at a time (SMEM store, fence, TMA
  stores, wait), or `t.store_once`: every SMEM store, one fence, every TMA store, one wait."""
  if not t.store_once:
    for part, o_smem, o_ref in zip(parts, o_smems, o_refs):
      o_smem.transpose((1, 0))[...] = part
      plgpu.commit_smem()
      _store_rows(o_smem, o_ref, win, lo, size, col0, t)
    return
  for part, o_smem in zip(parts, o_smems):
    o_smem.transpose((1, 0))[...] = part
  plgpu.commit_smem()
  for o_smem, o_ref in zip(o_smems, o_refs):
    _store_rows(o_smem, o_ref, win, lo, size, col0, t, wait=False)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _weight_specs(int4: bool, group: int, t: Tuning, k0):
  """BlockSpecs of one expert stack's tiles at K step k0 + kk (INT4: q tile + scale rows)."""
  if not int4:
    return [plgpu.BlockSpec((t.block_k, t.block_n), lambda kk, ni: (k0 + kk, ni),
                            transforms=_SWIZZLED)]
  n_s = max(t.block_k // group, 1)
  return [plgpu.BlockSpec((t.block_n, t.block_k), lambda kk, ni: (ni, k0 + kk)),
          plgpu.BlockSpec((n_s, t.block_n),
                          lambda kk, ni: (((k0 + kk) * t.block_k) // (n_s * group), ni))]


def _bf16_parts(val, n, dtype):
  """val as n 16-bit parts: (val,) rounded, or (hi, lo) with hi + lo = val to ~2^-17 relative.

  Split-K partials must stay f32-exact, and Mosaic (jax 0.11.2) stores only 16-bit values
  through the transposed SMEM view; hi/lo pairs carry the f32 partial instead.
  """
  hi = val.astype(dtype)
  if n == 1:
    return (hi,)
  return hi, (val - hi.astype(jnp.float32)).astype(dtype)


def _silu_mul(gate, up):
  """silu(gate) * up on f32 registers (the gated FFN's epilogue)."""
  return gate / (1.0 + jnp.exp(-gate)) * up


def _num_values(gated: bool, t: Tuning) -> int:
  """Values a call stores: silu(g) * u or the plain product (1), or split gate and up (2)."""
  return 2 if gated and t.splits > 1 else 1


def _staged_stacks(gated: bool, t: Tuning) -> int:
  """Stacks x chains whose chunks share one wgmma wait (SMEM-operand buffers are per chunk)."""
  return (2 if gated and t.int4_interleave_stacks else 1) * t.int4_acc_chains


def _slots(t: Tuning, n_items: int) -> int:
  """CTA columns over the work items: one per item, or t.slots that loop over items."""
  return min(t.slots or n_items, n_items)


def _items_in_smem(t: Tuning, n_items: int) -> bool:
  """t.items_smem where the padded list fits one TMA box (<= 256 items)."""
  return t.items_smem and _padded_items(n_items) <= 256


def _padded_items(n_items: int) -> int:
  """Items rounded up to a multiple of 4 (a TMA row of int32 is a multiple of 16 bytes)."""
  return -(-n_items // 4) * 4


def _window_rows(t: Tuning) -> tuple[int, ...]:
  """The row counts the body's item paths run with: R, and t.narrow_rows when set."""
  return (t.rows, t.narrow_rows) if t.narrow_rows else (t.rows,)


def _make_body(k, group, int4, gated, dtype, t: Tuning, n_items: int, interpret: bool):
  per_stack = 2 if int4 else 1
  n_stacks = 2 if gated else 1
  n_acc = n_stacks * (t.int4_acc_chains if int4 else 1)
  k_steps = k // t.block_k // t.splits
  n_out = _num_values(gated, t) * (2 if t.splits > 1 else 1)
  slots = _slots(t, n_items)

  def body(work_ref, x_ref, *refs):
    pdl.wait_for_producers(t.pdl, interpret)  # every input follows: the work list picks weights
    stacks = [refs[i * per_stack:(i + 1) * per_stack] for i in range(n_stacks)]
    rest = refs[n_stacks * per_stack:]
    o_refs, extra = rest[:n_out], list(rest[n_out:])
    o_smems = {r: [extra.pop(0) for _ in range(n_out)] for r in _window_rows(t)}
    w_stage = extra.pop(0) if int4 and t.a_operand == "smem" else None
    if _items_in_smem(t, n_items):  # one TMA of the whole list, then SMEM reads per item
      items_smem, items_bar = extra
      plgpu.copy_gmem_to_smem(work_ref, items_smem, items_bar)
      plgpu.barrier_wait(items_bar)
      work_ref = items_smem
    slot, ni, si = lax.axis_index("w"), lax.axis_index("n"), lax.axis_index("s")
    k0 = si * k_steps

    def run_item(grp, win, lo, size, rows):
      """One item with an x tile and wgmma N of `rows` (t.rows, or t.narrow_rows where the
      item's stored rows lie in its window's first narrow_rows rows)."""
      def acc_scope(*acc_refs):
        def step(_, x_smem, *w_smem):
          tiles = [w_smem[j * per_stack:(j + 1) * per_stack] for j in range(n_stacks)]
          if not int4:
            for acc_ref, tile in zip(acc_refs, tiles):
              _bf16_step(acc_ref, x_smem, *tile)
            return
          c = t.int4_acc_chains
          together = t.int4_interleave_stacks and n_stacks > 1
          for accs, tls in ([(acc_refs, tiles)] if together else
                            [(acc_refs[i * c:(i + 1) * c], (tl,)) for i, tl in enumerate(tiles)]):
            _int4_step(accs, x_smem, tls, w_stage, group=group, block_k=t.block_k, dtype=dtype,
                       batch=t.dequant_batch, scale_concat=t.int4_scale_concat,
                       k_packed=t.int4_k_packed, interpret=interpret, chains=c,
                       interleaved=t.int4_k_interleaved)

        x_spec = plgpu.BlockSpec((pl.Element(rows), t.block_k),
                                 lambda kk: (pl.multiple_of(win, work.ALIGN), k0 + kk),
                                 transforms=_SWIZZLED)
        w_specs = [plgpu.BlockSpec(s.block_shape, functools.partial(s.index_map, ni=ni),
                                   transforms=s.transforms)
                   for s in _weight_specs(int4, group, t, k0)] * n_stacks
        plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=[x_spec, *w_specs],
                            max_concurrent_steps=t.stages)(
                                x_ref, *(r.at[grp] for st in stacks for r in st))
        pdl.release_dependents(t.pdl, interpret)  # this item's loads are done: the epilogue's left
        return tuple(a[...] for a in acc_refs)

      accs = pl.run_scoped(acc_scope, *[plgpu.ACC((t.block_n, rows), jnp.float32)] * n_acc)
      if n_acc > n_stacks:  # int4_acc_chains: each stack's chains summed
        c = n_acc // n_stacks
        accs = tuple(functools.reduce(jnp.add, accs[i * c:(i + 1) * c]) for i in range(n_stacks))
      vals = (_silu_mul(*accs),) if gated and t.splits == 1 else accs
      n_parts = 2 if t.splits > 1 else 1
      parts = [p for v in vals for p in _bf16_parts(v, n_parts, o_smems[rows][0].dtype)]
      _store_parts(parts, o_smems[rows], [o.at[si] for o in o_refs], win, lo, size,
                   ni * t.block_n, t)

    def visit(item):
      grp, win, lo, size = (work_ref[i, item] for i in range(4))
      if not t.narrow_rows:
        pl.when(size > 0)(lambda: run_item(grp, win, lo, size, t.rows))
        return
      narrow = lo + size <= t.narrow_rows  # one compiled path each; the item picks at run time
      pl.when((size > 0) & narrow)(lambda: run_item(grp, win, lo, size, t.narrow_rows))
      pl.when((size > 0) & ~narrow)(lambda: run_item(grp, win, lo, size, t.rows))

    if slots == n_items:
      visit(slot)
    else:  # live items come first: slot s visits items s, s + slots, ...
      @pl.loop(0, -(-n_items // slots))
      def _(i):
        item = slot + i * slots
        pl.when(item < n_items)(lambda: visit(jnp.minimum(item, n_items - 1)))

  return body


def launch_shape(k: int, n: int, n_items: int, int4: bool, gated: bool, t: Tuning) -> dict:
  """What one call launches: CTAs (grid), K steps per CTA and item, SMEM bytes per CTA (the
  pipeline ring + output tiles; a CTA/SM bound of the 227 KB). For analyses and bench rows."""
  steps = k // t.block_k // t.splits
  stages = min(t.stages, steps)
  w_tile = t.block_n * t.block_k // 2 + max(t.block_k // 32, 1) * t.block_n * 2 if int4 else \
      t.block_n * t.block_k * 2
  ring = stages * (t.rows * t.block_k * 2 + (2 if gated else 1) * w_tile)
  out = (_num_values(gated, t) * (2 if t.splits > 1 else 1) * sum(_window_rows(t))
         * t.block_n * 2)
  stage = 2 * _staged_stacks(gated, t) * t.dequant_batch * t.block_n * CHUNK * 2 \
      if int4 and t.a_operand == "smem" else 0
  smem = ring + out + stage
  return dict(ctas=_slots(t, n_items) * (n // t.block_n) * t.splits, k_steps=steps,
              smem_kb=round(smem / 1024, 1), ctas_per_sm_smem=(227 * 1024) // smem)


def _grid(t: Tuning, n_items: int, n: int):
  """(grid, names): slot columns x N tiles x K splits, the slots fastest (CUDA x: dispatched
  first). The body finds its indices by name."""
  names = ("w", "n", "s")
  return (_slots(t, n_items), n // t.block_n, t.splits), names


def _pad_rows(x_mk):
  """Rows rounded up to a multiple of 8 (the tiled TMA of x needs it once M > 8)."""
  m = x_mk.shape[0]
  m_pad = m if m <= work.ALIGN else -(-m // work.ALIGN) * work.ALIGN
  return x_mk if m_pad == m else jnp.pad(x_mk, ((0, m_pad - m), (0, 0)))


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def grouped_matmul_mgpu(x_mk, stacks, items, *, tuning: Tuning, interpret=False):
  """Per value, [S, M, N]: S = tuning.splits K-partials in f32 (x.dtype when S = 1).

  stacks: one expert stack (value: x @ W) or two (gate, up: value silu(x @ gate) * (x @ up), or
  with S > 1 the two values x @ gate and x @ up, whose sums the caller combines); each is
  (w [G, K, N],) bf16 or (q int4 [G, N, K], scale [G, K/S, N]). items: work.work_list of the
  group sizes for R = tuning.rows. Rows no item stores are undefined.
  """
  m, k = x_mk.shape
  int4 = len(stacks[0]) == 2
  n = stacks[0][0].shape[1] if int4 else stacks[0][0].shape[2]
  group = k // stacks[0][1].shape[1] if int4 else None
  gated = len(stacks) == 2
  if int4 and tuning.int4_k_interleaved and x_mk.dtype != jnp.bfloat16:
    raise ValueError(f"int4_k_interleaved dequantises to bf16 (its magic): x is {x_mk.dtype}")
  if not supports(x_mk, k, n, group, tuning):
    raise ValueError(f"unsupported: {x_mk.dtype=} {k=} {n=} {group=} {gated=} {tuning=}")
  if int4:
    stacks = tuple((q, s.astype(x_mk.dtype)) for q, s in stacks)
  if interpret and int4 and tuning.a_operand == "registers":
    raise ValueError("GPU interpret mode's wgmma takes SMEM operands only (jax 0.11.2): "
                     "use Tuning(a_operand='smem') to interpret the INT4 kernel")
  x = _pad_rows(x_mk)
  split = tuning.splits > 1
  n_out = _num_values(gated, tuning) * (2 if split else 1)
  scratch = [plgpu.SMEM((r, tuning.block_n), x_mk.dtype)
             for r in _window_rows(tuning) for _ in range(n_out)]
  if int4 and tuning.a_operand == "smem":
    scratch.append(plgpu.SMEM((2 * _staged_stacks(gated, tuning) * tuning.dequant_batch,
                               tuning.block_n, CHUNK), x_mk.dtype, transforms=_SWIZZLED))
  n_items = items.shape[1]
  if _items_in_smem(tuning, n_items):
    pad = _padded_items(n_items) - n_items
    items = jnp.pad(items, ((0, 0), (0, pad))) if pad else items  # padding: size-0 items
    scratch += [plgpu.SMEM(items.shape, jnp.int32), plgpu.Barrier()]
  grid, names = _grid(tuning, items.shape[1], n)
  fn = plgpu.kernel(
      _make_body(k, group or 0, int4, gated, x_mk.dtype, tuning, n_items, interpret),
      out_type=(jax.ShapeDtypeStruct((tuning.splits, x.shape[0], n), x_mk.dtype),) * n_out,
      scratch_types=scratch,
      grid=grid,
      grid_names=names,
      kernel_name=f"gmm_{'int4' if int4 else 'bf16'}{'_gated' if gated else ''}",
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  outs = fn(items, x, *(a for st in stacks for a in st))
  if not split:
    return tuple(o[:, :m] for o in outs)
  # hi + lo per value (f32-exact partials); XLA fuses this into the caller's sum over S
  return tuple(outs[i][:, :m].astype(jnp.float32) + outs[i + 1][:, :m].astype(jnp.float32)
               for i in range(0, n_out, 2))
