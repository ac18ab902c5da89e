"""The target's inference layout: per layer, the matmuls that read one input as ONE dot over
weights concatenated once, at load (the target analogue of draft.model.pack_for_decode).

Not for training, checkpoints or tensor-parallel sharding (the sharding rules, the checkpoint
writers and the optimiser name the per-layer weights): `loader.load_pair` packs only without a
mesh. Per layer (the forward reads either layout; see mla.input_dots, mlp.swiglu, moe.moe):
  * attn "qkv_a" [D, Rq + R + P] = q_a | kv_a (both read the normed hidden state; without the
    q LoRA, q flattened to [D, H * (Dn + P)] | kv_a), replacing q_a (or q) and kv_a;
  * mlp (the dense layers) "gate_up" [D, 2F] = gate | up, replacing gate and up;
  * moe "router_gate_up" [D, E + 2Fs] = router | shared gate | shared up, replacing the router
    and the shared expert's gate and up, where the router has the shared expert's dtype (one
    dot with f32 accumulation: the router's logits are the same f32 sums, the shared expert's
    rounded to its dtype as its own dot would); a router of another dtype (e.g. an f32 router
    beside bf16 experts) stays apart: joining would round it to 16 bits or widen the shared
    expert's weights to f32 (twice the bytes), so only the shared gate | up is packed.
"""

import jax.numpy as jnp


def pack_for_decode(params):
  """params with every layer in the packed layout (a new pytree; the input is not changed)."""
  return params | {"layers": [pack_layer(lp) for lp in params["layers"]]}


def is_packed(params) -> bool:
  return any("qkv_a" in lp["attn"] for lp in params["layers"])


def pack_layer(lp):
  out = dict(lp, attn=_pack_attn(lp["attn"]))
  if "mlp" in lp:
    out["mlp"] = _pack_gate_up(lp["mlp"])
  if "moe" in lp:
    out["moe"] = _pack_moe(lp["moe"])
  return out


def _cat(ws):
  return jnp.concatenate(ws, axis=1)


def _pack_attn(p):
  q_name = "q_a" if "q_a" in p else "q"
  q = p[q_name].reshape(p[q_name].shape[0], -1)
  if q.dtype != p["kv_a"].dtype:
    return p
  rest = {k: w for k, w in p.items() if k not in (q_name, "kv_a")}
  return rest | {"qkv_a": _cat([q, p["kv_a"]])}


def _pack_gate_up(p):
  if p["gate"].dtype != p["up"].dtype:
    return p
  return {"gate_up": _cat([p["gate"], p["up"]]), "down": p["down"]}


def _pack_moe(p):
  if "shared" not in p:
    return p
  shared = p["shared"]
  if p["router"].dtype != shared["gate"].dtype or shared["gate"].dtype != shared["up"].dtype:
    return p | {"shared": _pack_gate_up(shared)}
  rest = {k: w for k, w in p.items() if k not in ("router", "shared")}
  return rest | {"router_gate_up": _cat([p["router"], shared["gate"], shared["up"]]),
                 "shared": {"down": shared["down"]}}
