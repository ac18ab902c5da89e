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
  return swiglu_down(gate, up, p)


def swiglu_down(gate, up, p):
  """down(silu(gate) * up) of the gate and up projections: over p["down_t"] [D, F] (packed,
  out-major: target/pack.py) or p["down"] [F, D]."""
  h = jax.nn.silu(gate) * up
  return dot_t(h, p["down_t"]) if "down_t" in p else h @ p["down"]
