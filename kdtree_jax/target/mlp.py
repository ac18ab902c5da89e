"""SwiGLU feed-forward: down(silu(x @ gate) * (x @ up)). Weights are [in, out]."""

import jax
import jax.numpy as jnp

from kdtree_jax.target.pack import dot_t, folded_dot_t


def swiglu(p, x, x_inv_rms=None):
  """Dense MLP (layer 0 of K2, and the shared expert): one dot over p["gate_up_t"] ((gate |
  up)^T, target/pack.py) when packed, else two. Where the input norm's gain is folded into
  p["gate_up_t_folded"] (`reads_unnormalised_input`), x is the un-normalised input and
  x_inv_rms [..., 1] f32 the norm's scale (`norm.inv_rms`), applied to the dot's output."""
  if reads_unnormalised_input(p):
    gate, up = jnp.split(folded_dot_t(x, p["gate_up_t_folded"], x_inv_rms), 2, axis=-1)
  elif "gate_up_t" in p:
    gate, up = jnp.split(dot_t(x, p["gate_up_t"]), 2, axis=-1)
  else:
    gate, up = x @ p["gate"], x @ p["up"]
  return swiglu_down(gate, up, p)


def reads_unnormalised_input(p) -> bool:
  """Whether the dense MLP takes the hidden state before mlp_norm (its gain folded into the
  packed gate | up dot, pack.fold_norm_gains)."""
  return "gate_up_t_folded" in p


def swiglu_down(gate, up, p):
  """down(silu(gate) * up) of the gate and up projections: over p["down_t"] [D, F] (packed,
  out-major: target/pack.py) or p["down"] [F, D]."""
  h = jax.nn.silu(gate) * up
  return dot_t(h, p["down_t"]) if "down_t" in p else h @ p["down"]
