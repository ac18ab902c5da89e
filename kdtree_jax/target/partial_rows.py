"""Row access shared by the Pallas Triton kernels that sum a dot's K-partials themselves
(`route_kernel.route_with_shared`, `qkv_kernel.qkv_epilogue`; the partials come from
`pack.dot_t_partials`): one program per token row, a column range read as power-of-2 lanes
masked past its width."""

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def live(n: int):
  """[next_power_of_2(n)] bool: the lanes below n."""
  return jnp.arange(pl.next_power_of_2(n)) < n


def lanes(row, start: int, n: int):
  """pl.ds of n's power-of-2 lanes from `start`, the start made a traced value (+ min(row, 0)
  = 0): Pallas' bound check rejects a static start whose masked lanes reach past the array,
  which Triton masks and interpret mode pads for a traced one."""
  return pl.ds(start + jnp.minimum(row, 0), pl.next_power_of_2(n))


def summed(parts_ref, row, start: int, n: int):
  """sum over s = 0..S-1 of parts[s, row, start:start + n], added in that order, as
  [next_power_of_2(n)] f32 (0 past n)."""
  return functools.reduce(jnp.add, [
      plt.load(parts_ref.at[jnp.int32(i), row, lanes(row, start, n)], mask=live(n), other=0.0)
      for i in range(parts_ref.shape[0])])
