"""SwiGLU feed-forward: down(silu(x @ gate) * (x @ up)). Weights are [in, out]."""

import jax
import jax.numpy as jnp


def swiglu(p, x):
  """Dense MLP (layer 0 of K2, and the shared expert): one dot over p["gate_up"] (gate | up,
  target/pack.py) when packed, else two."""
  if "gate_up" in p:
    gate, up = jnp.split(x @ p["gate_up"], 2, axis=-1)
  else:
    gate, up = x @ p["gate"], x @ p["up"]
  return swiglu_down(gate, up, p["down"])


def swiglu_down(gate, up, down):
  """down(silu(gate) * up) of the gate and up projections."""
  return (jax.nn.silu(gate) * up) @ down
