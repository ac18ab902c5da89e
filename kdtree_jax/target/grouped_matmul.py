"""Grouped (ragged) matmul for the routed experts: rows sorted by expert, one matrix per expert.

bf16 and INT4 expert stacks take the same path: on a GPU our Mosaic kernel
(`pallas_kernels.grouped_matmul`: a work list of (expert, row window) items drives the tiles, so
an expert with no routed rows costs no weight bytes; INT4 weights are dequantised in registers,
read at 4.5 bits). Elsewhere, and for shapes the kernel does not take, the XLA reference
(`jax.lax.ragged_dot`; INT4 dequantised in front of it). Measured before this design on an H200:
XLA's ragged_dot ran dense against every expert, and JAX's `ragged_dot_mgpu` streamed the weights
of empty experts too (WORKSPACE.md).
"""

from kdtree_jax.checkpoint.int4 import Int4Weight
from pallas_kernels.grouped_matmul import expert_mlp as kernel_expert_mlp
from pallas_kernels.grouped_matmul import gated_grouped_matmul as kernel_gated_matmul
from pallas_kernels.grouped_matmul import grouped_matmul as kernel_grouped_matmul
from pallas_kernels.grouped_matmul.api import work_rows as kernel_work_rows


def expert_operands(w) -> tuple:
  """The kernel's weight operands: (w [E, in, out],) for bf16, (packed, scale) for INT4."""
  return (w.packed, w.scale) if isinstance(w, Int4Weight) else (w,)


def k_layout(*ws) -> str:
  """The K layout (`int4.K_LAYOUTS`) these expert stacks share: "plain" for bf16 stacks, else
  the INT4 stacks' (`int4.pack_k`); stacks of one call in different layouts are a ValueError."""
  layouts = {w.k_layout if isinstance(w, Int4Weight) else "plain" for w in ws}
  if len(layouts) > 1:
    raise ValueError(f"expert stacks of one call must share one K layout (int4.pack_k), got "
                     f"{sorted(layouts)}")
  return layouts.pop()


def layout_args(*ws) -> dict:
  """The kernel API's layout arguments for these stacks: k_packed (Tuning.int4_k_packed) and
  k_interleaved (Tuning.int4_k_interleaved: exactly when they are pair-packed, "kpairs")."""
  layout = k_layout(*ws)
  return {"k_packed": layout != "plain", "k_interleaved": layout == "kpairs"}


def grouped_matmul(x_td, w, group_sizes, impl="auto"):
  """out[rows of expert e] = x[rows of expert e] @ w[e]; rows of x [T, in] are sorted by expert.

  impl: "auto" (the kernel on a GPU when the shapes suit it, else XLA), "pallas" (the kernel),
  "interpret" (the kernel on CPU, tests), "xla" (the reference); the kernel's API checks it.
  """
  return kernel_grouped_matmul(x_td, expert_operands(w), group_sizes, backend=impl,
                               **layout_args(w))


def gated_grouped_matmul(x_td, gate_edf, up_edf, group_sizes, impl="auto"):
  """silu(x @ gate[g]) * (x @ up[g]) per group: one kernel call on a GPU (fused epilogue)."""
  return kernel_gated_matmul(x_td, expert_operands(gate_edf), expert_operands(up_edf),
                             group_sizes, backend=impl, **layout_args(gate_edf, up_edf))


def expert_mlp(x_td, gate_edf, up_edf, down_efd, group_sizes, impl="auto", group_ends=None,
               items=None, row_groups=None, h_rows=None, pairs=None):
  """The gated call then the down call on one work list -> [splits, T, D] f32 split-K
  partials (1 split on XLA); rows past sum(group_sizes) undefined on the kernel.
  group_ends: cumsum(group_sizes), or an expert's last row + 1 where gaps separate the experts;
  items: R -> the work list, if the caller builds it;
  row_groups: each row's expert where rows are not in expert order (with items);
  h_rows: the gated row each down input row takes (dead rows -> one shared row; api.py);
  pairs: the rows the tunings are chosen for where x also holds gaps (api.py)."""
  return kernel_expert_mlp(x_td, expert_operands(gate_edf), expert_operands(up_edf),
                           expert_operands(down_efd), group_sizes, backend=impl,
                           group_ends=group_ends, items=items, row_groups=row_groups,
                           h_rows=h_rows, pairs=pairs, **layout_args(gate_edf, up_edf, down_efd))


def work_rows(x_td, gate_edf, up_edf, down_efd, group_sizes, impl="auto") -> int | None:
  """R of the work list `expert_mlp` builds (x_td may be a ShapeDtypeStruct); None on XLA."""
  return kernel_work_rows(x_td, expert_operands(gate_edf), expert_operands(up_edf),
                          expert_operands(down_efd), group_sizes, backend=impl,
                          **layout_args(gate_edf, up_edf, down_efd))
