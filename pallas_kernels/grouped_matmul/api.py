"""Public entry points of the grouped expert matmul: the Mosaic GPU kernel, interpret mode, or XLA.

Each call returns or combines per-value K-partials [S, M, N] (S = Tuning.splits, 1 for XLA).
`expert_mlp` runs a routed-expert FFN's two calls (gated gate/up, then down) on ONE work list
and leaves the down partials to the caller, whose weighted combine sums them in one fusion.
k_packed (INT4): the stacks' K columns are in `kpack.pack_int4_k`'s order (packed once where
decode weights are laid out); the kernel's tuning follows (`Tuning.int4_k_packed`), the XLA
reference undoes the permutation. k_interleaved (with k_packed): in
`kpairs.pack_int4_k_pairs`' order instead (`Tuning.int4_k_interleaved`, the PRMT-free
dequantise). None: as an explicit tuning says, else unpacked. An explicit tuning whose
int4_k_interleaved disagrees with a given k_interleaved is refused (it would read the stacks
in the wrong order); a default tuning follows the stacks.
"""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import kpack, kpairs, reference, work
from pallas_kernels import pdl
from pallas_kernels.grouped_matmul.tuning import Tuning, default_tuning

BACKENDS = ("auto", "pallas", "interpret", "xla")


def _check(x_mk, weights, group_sizes):
  if x_mk.ndim != 2 or any(w.ndim != 3 for w in weights):
    raise ValueError(f"expected x [M, K] and 3-d weights; got {x_mk.shape=} "
                     f"{[w.shape for w in weights]}")
  if len(weights) == 2:
    q, s = weights
    g, n, k = q.shape
    if q.dtype != jnp.int4:
      raise ValueError(f"INT4 weights must be int4 [G, N, K], got {q.dtype}")
    if s.shape[0] != g or s.shape[2] != n or k % s.shape[1]:
      raise ValueError(f"scale {s.shape} does not group q {q.shape} (want [G, K/S, N])")
  else:
    g, k, n = weights[0].shape
  if x_mk.shape[1] != k:
    raise ValueError(f"x {x_mk.shape} and weights {weights[0].shape} disagree on K={k}")
  if group_sizes.shape != (g,):
    raise ValueError(f"{group_sizes.shape=} must be ({g},)")
  return k, n


def _reference(x_mk, weights, group_sizes, out_dtype=None, k_packed=False, interleaved=False):
  if len(weights) == 2:
    q = weights[0]
    if k_packed:  # pack_int4_k is its own inverse; pack_int4_k_pairs is not
      q = kpairs.unpack_int4_k_pairs(q) if interleaved else kpack.pack_int4_k(q)
    return reference.int4_grouped_matmul_reference(x_mk, q, weights[1], group_sizes, out_dtype)
  return reference.grouped_matmul_reference(x_mk, weights[0], group_sizes, out_dtype)


def _layout(tuning, k_packed, k_interleaved):
  """(int4_k_packed, int4_k_interleaved) of a call: as given (None: an explicit tuning's, else
  False); a given k_interleaved that an explicit tuning contradicts is a ValueError."""
  if k_packed is None:
    k_packed = bool(tuning and tuning.int4_k_packed)
  if k_interleaved is None:
    k_interleaved = bool(tuning and tuning.int4_k_interleaved)
  elif tuning is not None and tuning.int4_k_interleaved != k_interleaved:
    raise ValueError(
        f"the stacks are {'' if k_interleaved else 'not '}pair-interleaved (k_interleaved="
        f"{k_interleaved}) but the explicit tuning has int4_k_interleaved="
        f"{tuning.int4_k_interleaved}: it would read them in the wrong K order")
  if k_interleaved and not k_packed:
    raise ValueError("k_interleaved is a K-packed layout (kpairs.pack_int4_k_pairs): pass "
                     "k_packed=True with it")
  return k_packed, k_interleaved


def _plan(x_mk, stacks, group_sizes, backend, tuning, k_packed=None, k_interleaved=None,
          pairs=None):
  """Checks the operands; returns (backend, tuning) with "auto" and the default tuning resolved
  (for `pairs` rows, default x's), its int4_k_packed / int4_k_interleaved the stacks' layout
  (`_layout`)."""
  shapes = [_check(x_mk, st, group_sizes) for st in stacks]
  if len(set(shapes)) != 1 or len({len(st) for st in stacks}) != 1:
    raise ValueError(f"gate and up stacks differ: {[[w.shape for w in st] for st in stacks]}")
  k, n = shapes[0]
  if backend not in BACKENDS:
    raise ValueError(f"{backend=} must be one of {BACKENDS}")
  from pallas_kernels.grouped_matmul import kernel  # pylint: disable=import-outside-toplevel
  int4 = len(stacks[0]) == 2
  k_packed, k_interleaved = _layout(tuning, k_packed, k_interleaved)
  if k_packed and not int4:
    raise ValueError("k_packed is for INT4 stacks")
  tuning = tuning or pdl.with_model_default(default_tuning(
      pairs or x_mk.shape[0], stacks[0][0].shape[0], k, n, int4, interpret=backend == "interpret",
      gated=len(stacks) == 2))  # TargetConfig.mosaic_pdl (pallas_kernels/pdl.py)
  tuning = dataclasses.replace(tuning, int4_k_packed=k_packed, int4_k_interleaved=k_interleaved)
  group = k // stacks[0][1].shape[1] if int4 else None
  if backend == "auto":
    ok = jax.default_backend() == "gpu" and kernel.supports(x_mk, k, n, group, tuning)
    backend = "pallas" if ok else "xla"
  return backend, tuning


def _values(x_mk, stacks, group_sizes, backend, tuning, items=None):
  """Per value [S, M, N] K-partials: the kernel's, or the XLA reference's f32 products (S = 1;
  a gated call's reference gives the gate and up products apart)."""
  if backend == "xla":
    return tuple(_reference(x_mk, st, group_sizes, jnp.float32, tuning.int4_k_packed,
                            tuning.int4_k_interleaved)[None] for st in stacks)
  from pallas_kernels.grouped_matmul import kernel  # pylint: disable=import-outside-toplevel
  if items is None:
    items = work.work_list(group_sizes, x_mk.shape[0], tuning.rows)
  return kernel.grouped_matmul_mgpu(x_mk, tuple(stacks), items, tuning=tuning,
                                    interpret=backend == "interpret")


def _sum_partials(v_smn):
  """[S, M, N] -> [M, N] f32 as S - 1 element-wise adds, fused into the consumer (the reduce over
  the major axis was a loop fusion with an inner reduce: 4.1 us per MoE layer at T=16 on an
  H200 for <= 8.4 MB, results/h200/2026-12-01/s5_k26_core_run2.log)."""
  total = v_smn[0].astype(jnp.float32)
  for s in range(1, v_smn.shape[0]):
    total = total + v_smn[s].astype(jnp.float32)
  return total


def _gated_value(vals, dtype, rows=None):
  """silu(gate) * up from a gated call's values (fused already, or gate and up partials).
  rows [M]: output row r from value row rows[r] where this is a pass anyway (partials to sum)."""
  if rows is not None and (len(vals) == 2 or vals[0].shape[0] > 1):
    vals = tuple(v[:, rows] for v in vals)
  if len(vals) == 1:
    return _sum_partials(vals[0]).astype(dtype)
  g, u = (_sum_partials(v) for v in vals)
  return (jax.nn.silu(g) * u).astype(dtype)


def grouped_matmul(x_mk, weights, group_sizes, *, backend="auto", tuning: Tuning | None = None,
                   k_packed: bool | None = None, k_interleaved: bool | None = None):
  """out[rows of expert g] = x[rows of g] @ W[g]; rows of x sorted by expert.

  weights: (w [G, K, N],) bf16 / f16, or (q int4 [G, N, K], scale [G, K/S, N]) for INT4 experts.
  group_sizes [G] int32 (sum <= M; rows past the sum are 0 in the reference, unwritten by the
  kernel). backend: "pallas" (GPU), "interpret" (the kernel on CPU), "xla", or "auto" (the kernel
  on a GPU when the shapes suit it). An expert with no rows costs the kernel no weight bytes.
  """
  weights = tuple(weights)
  backend, tuning = _plan(x_mk, [weights], group_sizes, backend, tuning, k_packed, k_interleaved)
  (val,) = _values(x_mk, [weights], group_sizes, backend, tuning)
  return val.astype(jnp.float32).sum(axis=0).astype(x_mk.dtype) if val.shape[0] > 1 else \
      val[0].astype(x_mk.dtype)


def gated_grouped_matmul(x_mk, gate, up, group_sizes, *, backend="auto",
                         tuning: Tuning | None = None, k_packed: bool | None = None,
                         k_interleaved: bool | None = None):
  """silu(x @ gate[g]) * (x @ up[g]) per expert, one kernel call (two accumulators).

  gate, up: weight tuples as in `grouped_matmul`. Both paths apply the SiLU-multiply to the f32
  products and round once (rounding g and u to bf16 first put the XLA path up to 2.4% off the
  kernel on an H200). Split-K (few live experts) returns the gate and up partials from the same
  call; their sums and the SiLU-multiply are one XLA fusion.
  """
  stacks = [tuple(gate), tuple(up)]
  backend, tuning = _plan(x_mk, stacks, group_sizes, backend, tuning, k_packed, k_interleaved)
  return _gated_value(_values(x_mk, stacks, group_sizes, backend, tuning), x_mk.dtype)


def _plan_mlp(x_mk, stacks, down, group_sizes, backend, tunings, k_packed=None,
              k_interleaved=None, pairs=None):
  """(gated call's backend and tuning, down call's backend and tuning) of `expert_mlp`."""
  t_gate, t_down = tunings or (None, None)
  b_gate, t_gate = _plan(x_mk, stacks, group_sizes, backend, t_gate, k_packed, k_interleaved,
                         pairs)
  h_shape = jax.ShapeDtypeStruct((x_mk.shape[0], down[0].shape[2 if len(down) == 2 else 1]),
                                 x_mk.dtype)
  b_down, t_down = _plan(h_shape, [down], group_sizes, backend, t_down, k_packed,
                         k_interleaved, pairs)
  if t_gate.rows != t_down.rows:
    raise ValueError(f"gate and down tunings must share rows: {t_gate.rows} vs {t_down.rows}")
  return b_gate, t_gate, b_down, t_down


def work_rows(x_mk, gate, up, down, group_sizes, *, backend="auto",
              tunings: tuple[Tuning, Tuning] | None = None,
              k_packed: bool | None = None, k_interleaved: bool | None = None) -> int | None:
  """R of the work list `expert_mlp` builds for these operands (x_mk: an array or a
  ShapeDtypeStruct), or None where XLA runs both calls (no work list)."""
  b_gate, t_gate, b_down, _ = _plan_mlp(x_mk, [tuple(gate), tuple(up)], tuple(down),
                                        group_sizes, backend, tunings, k_packed,
                                        k_interleaved)
  return None if "xla" == b_gate == b_down else t_gate.rows


def expert_mlp(x_mk, gate, up, down, group_sizes, *, backend="auto",
               tunings: tuple[Tuning, Tuning] | None = None, group_ends=None, items=None,
               row_groups=None, h_rows=None, k_packed: bool | None = None,
               k_interleaved: bool | None = None, pairs: int | None = None):
  """down[g] applied to silu(x @ gate[g]) * (x @ up[g]) per expert -> [S, M, N] f32 K-partials.

  One work list for both calls (their tunings share R). The caller sums over S, ideally inside
  the fusion that weights and combines the rows (S = 1 on XLA). Rows past sum(group_sizes) are
  undefined on the kernel backends. group_ends: cumsum(group_sizes) if the caller has it.
  items: R -> a work list the caller built (as work.work_list would for R). row_groups [M]:
  each row's expert (G: none) when the rows are not sorted by expert, which the kernel allows
  where every item's window holds one expert's rows (`items` given); XLA then sorts them.
  h_rows [M] int32: the gated value's row each row of the down call's input takes, where a pass
  sums the gated call's split partials anyway: r for the rows items store, one shared row for
  the others (undefined rows nobody reads), so that pass reads the live rows only.
  pairs: the (token, expert) pairs the rows hold where rows also hold gaps between experts (an
  8-aligned layout, group_ends given): the default tunings are chosen for that many rows
  (tuning.DEFAULT_VARIANTS' classes are by pairs), not for x's.
  """
  stacks = [tuple(gate), tuple(up)]
  down = tuple(down)
  b_gate, t_gate, b_down, t_down = _plan_mlp(x_mk, stacks, down, group_sizes, backend, tunings,
                                             k_packed, k_interleaved, pairs)
  m = x_mk.shape[0]
  if row_groups is not None and "xla" in (b_gate, b_down):
    if b_gate != b_down:
      raise ValueError(f"row_groups needs one backend for both calls: {b_gate}, {b_down}")
    order = jnp.argsort(row_groups, stable=True)  # the reference wants rows sorted by expert
    y = expert_mlp(x_mk[order], gate, up, down, group_sizes, backend="xla",
                   tunings=(t_gate, t_down), k_packed=t_gate.int4_k_packed,
                   k_interleaved=t_gate.int4_k_interleaved)
    return y[:, jnp.argsort(order)]
  if row_groups is not None and items is None:
    raise ValueError("row_groups (rows not sorted by expert) needs the caller's items")
  if "xla" == b_gate == b_down:
    items = None
  elif items is not None:
    items = items(t_gate.rows)
  else:
    items = work.work_list(group_sizes, m, t_gate.rows, group_ends)
  h = _gated_value(_values(x_mk, stacks, group_sizes, b_gate, t_gate, items), x_mk.dtype,
                   h_rows)
  (y,) = _values(h, [down], group_sizes, b_down, t_down, items)
  return y.astype(jnp.float32)
