"""SwiGLU feed-forward: down(silu(x @ gate) * (x @ up)). Weights are [in, out]."""

import jax
import jax.numpy as jnp

from kdtree_jax.target.pack import dot_t


def swiglu(p, x):
  """Dense MLP (layer 0 of K2, and the shared expert): one dot over p["gate_up_t"] ((gate |
  up)^T, target/pack.py) when packed, else two."""
  if "gate_up_t" in p:
    gate, up = jnp.split(dot_t(x, p["gate_up_t"]), 2, axis=-1)
  else:
    gate, up = x @ p["gate"], x @ p["up"]
  return swiglu_down(gate, up, p["down"])


def swiglu_down(gate, up, down):
  """down(silu(gate) * up) of the gate and up projections."""
  return (jax.nn.silu(gate) * up) @ down
