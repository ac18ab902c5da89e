"""The target's inference layout: per layer, the matmuls that read one input as ONE dot over
weights concatenated once, at load (the target analogue of draft.model.pack_for_decode).

The packed weights that contract the hidden size D are stored OUT-major, [out, D] (suffix `_t`;
`dot_t` multiplies by them). At one token XLA:GPU rewrites a [1, D] x [D, N] dot with
(N + 1) * D < 10M into multiply + reduce (DotStrengthReduction), else it is a GEMM; a reduction
over D = 7168 along the MAJOR dim (a column reduction, race-free up to 32 x 128 = 4096 rows)
runs as two kernels (partial sums, then their sum), along the MINOR dim (a row reduction, up to
1024 x 16 = 16384) as one. K2.6 at one token: q_a (N 1536) was a GEMM and kv_a (576) a
two-kernel reduction, q_a | kv_a (2112) is one GEMM; the router (384) and the shared gate and up
(256 each) were two-kernel reductions, router | gate | up (896, out-major) is one row
reduction. A tree step's GEMMs read either layout.

Not for training, checkpoints or tensor-parallel sharding (the sharding rules, the checkpoint
writers and the optimiser name the per-layer weights): `loader.load_pair` packs only without a
mesh. Per layer (the forward reads either layout; see mla.input_dots, mlp.swiglu, moe.moe):
  * attn "qkv_a_t" [Rq + R + P, D] = (q_a | kv_a)^T (both read the normed hidden state; without the
    q LoRA, q flattened to [D, H * (Dn + P)] | kv_a), replacing q_a (or q) and kv_a; and kv_b
    [R, H, Dn + Dv] as "w_qc" [H, Dn + P, R + P] = [[key half^T, 0], [0, I_P]] (the kernel's
    queries, absorbed q_nope and q_pe, from ONE product: mla.kernel_queries; P / R more bytes
    than the key half alone, no concatenate per layer) and its value half "w_uv" [H, Dv, R],
    heads major (the batch dim of the absorbed products), so no step slices or transposes the
    weight;
  * mlp (the dense layers) "gate_up_t" [2F, D] = (gate | up)^T, replacing gate and up;
  * moe "router_gate_up_t" [E + 2Fs, D] = (router | shared gate | shared up)^T, replacing the router
    and the shared expert's gate and up, where the router has the shared expert's dtype (one
    dot with f32 accumulation: the router's logits are the same f32 sums, the shared expert's
    rounded to its dtype as its own dot would); a router of another dtype (e.g. an f32 router
    beside bf16 experts) stays apart: joining would round it to 16 bits or widen the shared
    expert's weights to f32 (twice the bytes), so only the shared gate | up is packed.
"""

import jax
import jax.numpy as jnp

from kdtree_jax.target.config import TargetConfig


def pack_for_decode(cfg: TargetConfig, params):
  """params with every layer in the packed layout (a new pytree; the input is not changed)."""
  return params | {"layers": [pack_layer(cfg, lp) for lp in params["layers"]]}


def dot_t(x, w_t, **kw):
  """x [..., D] @ w_t[N, D]^T -> [..., N] (kw: dot_general's precision, preferred_element_type)."""
  return jax.lax.dot_general(x, w_t, (((x.ndim - 1,), (1,)), ((), ())), **kw)


def pack_layer(cfg: TargetConfig, lp):
  out = dict(lp, attn=_pack_attn(lp["attn"], cfg.qk_nope_head_dim, cfg.qk_rope_head_dim))
  if "mlp" in lp:
    out["mlp"] = _pack_gate_up(lp["mlp"])
  if "moe" in lp:
    out["moe"] = _pack_moe(lp["moe"])
  return out


def _cat_t(ws):
  """[in, out_i] weights -> (w_0 | w_1 | ...)^T [sum out_i, in]."""
  return jnp.concatenate(ws, axis=1).T


def _pack_attn(p, qk_nope_head_dim, qk_rope_head_dim):
  q_name = "q_a" if "q_a" in p else "q"
  q = p[q_name].reshape(p[q_name].shape[0], -1)
  out = {k: w for k, w in p.items() if k != "kv_b"} | _split_kv_b(p["kv_b"], qk_nope_head_dim,
                                                                  qk_rope_head_dim)
  if q.dtype != p["kv_a"].dtype:
    return out
  out = {k: w for k, w in out.items() if k not in (q_name, "kv_a")}
  return out | {"qkv_a_t": _cat_t([q, p["kv_a"]])}


def _split_kv_b(kv_b, dn, rope_dim):
  """kv_b [R, H, Dn + Dv] -> w_qc [H, Dn + P, R + P] = [[w_uk^T, 0], [0, I_P]] (the queries'
  product: absorbed q_nope and q_pe side by side, mla.kernel_queries) and w_uv [H, Dv, R]:
  heads major (the batch of the absorbed products)."""
  r, h = kv_b.shape[0], kv_b.shape[1]
  w_qc = jnp.zeros((h, dn + rope_dim, r + rope_dim), kv_b.dtype)
  w_qc = w_qc.at[:, :dn, :r].set(jnp.transpose(kv_b[..., :dn], (1, 2, 0)))
  w_qc = w_qc.at[:, dn:, r:].set(jnp.broadcast_to(jnp.eye(rope_dim, dtype=kv_b.dtype),
                                                  (h, rope_dim, rope_dim)))
  return {"w_qc": w_qc, "w_uv": jnp.transpose(kv_b[..., dn:], (1, 2, 0))}


def _pack_gate_up(p):
  if p["gate"].dtype != p["up"].dtype:
    return p
  return {"gate_up_t": _cat_t([p["gate"], p["up"]]), "down": p["down"]}


def _pack_moe(p):
  if "shared" not in p:
    return p
  shared = p["shared"]
  if p["router"].dtype != shared["gate"].dtype or shared["gate"].dtype != shared["up"].dtype:
    return p | {"shared": _pack_gate_up(shared)}
  rest = {k: w for k, w in p.items() if k not in ("router", "shared")}
  return rest | {"router_gate_up_t": _cat_t([p["router"], shared["gate"], shared["up"]]),
                 "shared": {"down": shared["down"]}}
