"""SwiGLU feed-forward: down(silu(x @ gate) * (x @ up)). Weights are [in, out]."""

import jax


def swiglu(p, x):
  """Dense MLP (layer 0 of K2, and the shared expert)."""
  h = jax.nn.silu(x @ p["gate"]) * (x @ p["up"])
  return h @ p["down"]
