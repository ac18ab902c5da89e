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
reduction. The same rule for the per-layer dots that contract a non-D dim: q_b (N 1536, K Rq 1536),
the absorbed queries' w_qc (per head 576 x 192), o (N 7168, K H * Dv 1024) and the shared
expert's down (N 7168, K 256) are strength-reduced too, so they are stored out-major as well
(H200 ar at 46k, 61 layers: multiply + column reductions of 617 / 187 / 450 / 200 us per step,
q_b's product materialised, against 70 / 26 / 218 / 54 us floors; `dot_t`'s out-major rows are
one row-reduction kernel). A tree step's GEMMs read
either layout (cuBLAS / Triton take either operand transposed: a 2-D dot needs no transpose).

Not for training, checkpoints or tensor-parallel sharding (the sharding rules, the checkpoint
writers and the optimiser name the per-layer weights): `loader.load_pair` packs only without a
mesh. Per layer (the forward reads either layout; see mla.input_dots, mlp.swiglu, moe.moe):
  * attn "qkv_a_t" [Rq + R + P, D] = (q_a | kv_a)^T (both read the normed hidden state; without the
    q LoRA, q flattened to [D, H * (Dn + P)] | kv_a), replacing q_a (or q) and kv_a; "q_b_t"
    [H * (Dn + P), Rq] = q_b^T (flattened heads) and "o_t" [D, H * Dv] = o^T, replacing q_b and o;
    and kv_b [R, H, Dn + Dv] as "w_qc_t" [H, R + P, Dn + P] = [[key half, 0], [0, I_P]] (the
    kernel's queries, absorbed q_nope and q_pe, from ONE product: mla.kernel_queries; P / R more
    bytes than the key half alone, no concatenate per layer) and its value half "w_uv" [H, Dv, R],
    heads major (the batch dim of the absorbed products), so no step slices or transposes the
    weight;
  * mlp (the dense layers) "gate_up_t" [2F, D] = (gate | up)^T, replacing gate and up (down stays
    [F, D]: at one token its (D + 1) * F >= 10M on K2.6, a GEMM);
  * moe "router_gate_up_t" [E + 2Fs, D] = (router | shared gate | shared up)^T, replacing the router
    and the shared expert's gate and up, where the router has the shared expert's dtype (one
    dot with f32 accumulation: the router's logits are the same f32 sums, the shared expert's
    rounded to its dtype as its own dot would); a router of another dtype (e.g. an f32 router
    beside bf16 experts) stays apart: joining would round it to 16 bits or widen the shared
    expert's weights to f32 (twice the bytes), so only the shared gate | up is packed; the shared
    expert's down [Fs, D] as "down_t" [D, Fs] either way; INT4 routed stacks K-packed
    (`int4.pack_k`: the grouped-matmul kernel reads a thread's 8 values with one 32-bit load;
    H200 mlp_tune, sixth session: 1.02-1.08x faster at T = 1, 9, 16, 65), pair-interleaved as
    well with cfg.int4_k_interleaved (`expert_k_layout`), bf16 stacks as stored.
With cfg.fold_norm_weights (`fold_norm_gains`), three RMSNorm gains go into the dot after them.
"""

import jax
import jax.numpy as jnp

from kdtree_jax.checkpoint import int4
from kdtree_jax.target.config import TargetConfig


def pack_for_decode(cfg: TargetConfig, params, out_major: bool = True,
                    donate_experts: bool = False):
  """params with every layer in the packed layout (a new pytree; the input is not changed,
  unless donate_experts).
  out_major=False: the fifth session's layout (q_b, o and the shared down as stored per layer,
  "w_qc" [H, Dn + P, R + P]), kept for the GPU A/B (probe_xla_options --layouts packed_s5).
  donate_experts: each INT4 routed stack's buffer is donated to its K-packed copy (the input's
  stacks are deleted), so packing a loaded model needs one stack's room, not a second copy of
  every expert (without it, K2.6's one-GPU share, ~63 GB of experts, did not fit the H200
  while it loaded: sixth session). The loader passes it; tests keep both layouts."""
  layers = [pack_layer(cfg, lp, out_major, donate_experts) for lp in params["layers"]]
  return fold_norm_gains(cfg, params | {"layers": layers})


def fold_norm_gains(cfg: TargetConfig, params):
  """The packed `params` with cfg.fold_norm_weights' folds (a new pytree sharing every other
  array; `params` as it is when the flag is off). Per layer, where the packed dot exists:
    * attn_norm's gain g into "qkv_a_t" as "qkv_a_t_folded" = qkv_a_t diag(g), attn_norm
      removed: mla.input_dots reads the un-normalised x and scales the dot's output rows by
      rsqrt(mean(x^2) + eps) (`folded_dot_t`);
    * the q LoRA norm's gain into "q_b_t" as "q_b_t_folded", q_a_norm removed (mla.project_q);
    * a dense layer's mlp_norm into its "gate_up_t" as "gate_up_t_folded", mlp_norm removed
      (transformer._ffn_input passes the raw hidden state, mlp.swiglu scales the dot's output).
  Each norm's only consumer is that dot. Not folded: the kv LoRA norm (its output is the
  cache row), the final norm (the lm_head is shared with the draft) and a MoE layer's
  mlp_norm: its routed experts (INT4: no exact gain fold) read the normalised row, and with the
  gain folded into the router | shared gate | up dot its output scale became a kernel of its own
  (XLA:GPU fuses no epilogue into that one-token row reduction: deviceless H200 compile, no
  kernel fewer); `one_token_rows_first` removes that norm's separate kernel another way
  (moe._one_token_moe).
  The product is rounded once to the weight's dtype (bf16: one more rounding than HF's, which
  rounds the normalised x instead)."""
  if not cfg.fold_norm_weights:
    return params
  return params | {"layers": [_fold_layer(lp) for lp in params["layers"]]}


def _fold_layer(lp):
  attn, out = dict(lp["attn"]), dict(lp)
  if "qkv_a_t" in attn and "attn_norm" in out:
    attn["qkv_a_t_folded"] = _scale_columns(attn.pop("qkv_a_t"), out.pop("attn_norm"))
  if "q_b_t" in attn and "q_a_norm" in attn:
    attn["q_b_t_folded"] = _scale_columns(attn.pop("q_b_t"), attn.pop("q_a_norm"))
  ffn = _fold_mlp_norm(out)  # pops "mlp_norm" from out where it folds
  return out | {"attn": attn} | ffn


def _fold_mlp_norm(lp):
  """{"mlp": the dense MLP with mlp_norm's gain folded into its packed gate | up} (the layer's
  "mlp_norm" popped from lp), or {} (a MoE layer, or gate | up not packed: the norm stays)."""
  if "mlp_norm" not in lp or "gate_up_t" not in lp.get("mlp", {}):
    return {}
  mlp = dict(lp["mlp"])
  mlp["gate_up_t_folded"] = _scale_columns(mlp.pop("gate_up_t"), lp.pop("mlp_norm"))
  return {"mlp": mlp}


def _scale_columns(w_t, gain):
  """w_t [N, K] diag(gain [K]): an out-major weight's contracted dim scaled by the gain (f32
  product, rounded once to w_t's dtype)."""
  return (w_t.astype(jnp.float32) * gain.astype(jnp.float32)).astype(w_t.dtype)


LAYOUTS = ("per_layer", "packed_s5", "packed")


def layout_params(cfg: TargetConfig, params, names):
  """{name: params} of the loaded per-layer `params` in each named layout (the GPU layout A/B,
  scripts/probe_xla_options.py --layouts): per_layer (as loaded), packed_s5 (out_major=False),
  packed. K2.6's one-GPU share fits ONE copy of its routed experts (~63 GB of 126.9 usable on an
  H200), so packed donates the loaded stacks to its K-packed copy unless per_layer or packed_s5
  (which keep reading them) is named too."""
  names = set(names)
  if names - set(LAYOUTS):
    raise ValueError(f"unknown layouts {sorted(names - set(LAYOUTS))}; known: {LAYOUTS}")
  out = {}
  if "per_layer" in names:
    out["per_layer"] = params
  if "packed_s5" in names:
    out["packed_s5"] = pack_for_decode(cfg, params, out_major=False)
  if "packed" in names:
    keep = bool(names & {"per_layer", "packed_s5"})
    out["packed"] = pack_for_decode(cfg, params, donate_experts=not keep)
  return out


def dot_t(x, w_t, **kw):
  """x [..., D] @ w_t[N, D]^T -> [..., N] (kw: dot_general's precision, preferred_element_type)."""
  return jax.lax.dot_general(x, w_t, (((x.ndim - 1,), (1,)), ((), ())), **kw)


def folded_dot_t(x, w_folded_t, inv_rms):
  """rms_norm(x, g) @ w^T over w_folded_t = w diag(g) (`fold_norm_gains`): x @ w_folded_t^T
  accumulated in f32, times inv_rms [..., 1] (the norm's rsqrt, per row), rounded once to x's
  dtype. The same value in f32; in bf16 x itself is the dot's input, not x's normalised
  rounding."""
  y = dot_t(x, w_folded_t, preferred_element_type=jnp.float32)
  return (y * inv_rms).astype(x.dtype)


def pack_layer(cfg: TargetConfig, lp, out_major: bool = True, donate_experts: bool = False):
  attn = _pack_attn(lp["attn"], cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, out_major)
  out = dict(lp, attn=attn)
  if "mlp" in lp:
    out["mlp"] = _pack_gate_up(lp["mlp"])
  if "moe" in lp:
    out["moe"] = _pack_moe(cfg, lp["moe"], out_major, donate_experts)
  return out


def _cat_t(ws):
  """[in, out_i] weights -> (w_0 | w_1 | ...)^T [sum out_i, in]."""
  return jnp.concatenate(ws, axis=1).T


def _pack_attn(p, qk_nope_head_dim, qk_rope_head_dim, out_major=True):
  kv_b = _split_kv_b(p["kv_b"], qk_nope_head_dim, qk_rope_head_dim)
  if out_major:
    out = {k: w for k, w in p.items() if k not in ("kv_b", "q_b", "o")}
    out |= kv_b | _out_major_q_b_o(p)
  else:
    out = {k: w for k, w in p.items() if k != "kv_b"} | {
        "w_qc": jnp.swapaxes(kv_b["w_qc_t"], 1, 2), "w_uv": kv_b["w_uv"]}
  q_name = "q_a" if "q_a" in p else "q"
  q = p[q_name].reshape(p[q_name].shape[0], -1)
  if q.dtype != p["kv_a"].dtype:
    return out
  out = {k: w for k, w in out.items() if k not in (q_name, "kv_a")}
  return out | {"qkv_a_t": _cat_t([q, p["kv_a"]])}


def _out_major_q_b_o(p):
  """q_b [Rq, H, K] -> "q_b_t" [H * K, Rq] (if the q LoRA exists) and o [H, Dv, D] -> "o_t"
  [D, H * Dv]: the one-token dots contract their weights' minor dim (a row reduction)."""
  o = p["o"]
  out = {"o_t": o.reshape(-1, o.shape[-1]).T}
  if "q_b" in p:
    out["q_b_t"] = p["q_b"].reshape(p["q_b"].shape[0], -1).T
  return out


def _split_kv_b(kv_b, dn, rope_dim):
  """kv_b [R, H, Dn + Dv] -> w_qc_t [H, R + P, Dn + P] = [[w_uk, 0], [0, I_P]] (out-major: the
  queries' product, absorbed q_nope and q_pe side by side, mla.kernel_queries, contracts its
  minor dim) and w_uv [H, Dv, R]: heads major (the batch of the absorbed products)."""
  r, h = kv_b.shape[0], kv_b.shape[1]
  w_qc_t = jnp.zeros((h, r + rope_dim, dn + rope_dim), kv_b.dtype)
  w_qc_t = w_qc_t.at[:, :r, :dn].set(jnp.transpose(kv_b[..., :dn], (1, 0, 2)))
  w_qc_t = w_qc_t.at[:, r:, dn:].set(jnp.broadcast_to(jnp.eye(rope_dim, dtype=kv_b.dtype),
                                                      (h, rope_dim, rope_dim)))
  return {"w_qc_t": w_qc_t, "w_uv": jnp.transpose(kv_b[..., dn:], (1, 2, 0))}


def _down(p, down_t):
  """down [F, D], or with down_t stored out-major as "down_t" [D, F] (the shared expert: at one
  token its (D + 1) * F < 10M dot is a reduction over F)."""
  return {"down_t": p["down"].T} if down_t else {"down": p["down"]}


def _pack_gate_up(p, down_t=False):
  """gate | up joined (when of one dtype) and `_down`."""
  down = _down(p, down_t)
  if p["gate"].dtype != p["up"].dtype:
    return {k: w for k, w in p.items() if k != "down"} | down
  return {"gate_up_t": _cat_t([p["gate"], p["up"]])} | down


def expert_k_layout(cfg: TargetConfig) -> str:
  """The K layout decode's INT4 routed stacks are stored in (`int4.K_LAYOUTS`): "kpairs" with
  cfg.int4_k_interleaved (the kernel's PRMT-free dequantise), else "kpack"."""
  return "kpairs" if cfg.int4_k_interleaved else "kpack"


def _pack_experts(cfg: TargetConfig, p, donate_experts=False):
  """p with its INT4 routed stacks (gate, up, down) in `expert_k_layout(cfg)`: all of them, or
  none where one's in-dim is not a multiple of the packs' 64-column block (int4.pack_k keeps
  such a stack plain, and the expert FFN reads its three stacks in one layout: a small model's
  F = 32 would otherwise pack gate and up but not down)."""
  layout = expert_k_layout(cfg)
  stacks = {n: p[n] for n in ("gate", "up", "down") if isinstance(p.get(n), int4.Int4Weight)}
  if any(not int4.k_packable(w) for w in stacks.values()):
    return p
  return p | {n: int4.pack_k(w, donate=donate_experts, layout=layout) for n, w in stacks.items()}


def relayout_experts(cfg: TargetConfig, params, donate_experts=False):
  """`params` with every K-packed INT4 routed stack in `expert_k_layout(cfg)` (a new pytree;
  stacks already so, and plain ones, are shared: per-layer params stay per-layer): a packed
  model whose cfg changed the layout field afterwards (gpu_program --target_fields,
  probe_xla_options --layouts packed+...)."""
  layout = expert_k_layout(cfg)

  def moe(p):
    return p | {n: int4.pack_k(w, donate=donate_experts, layout=layout) for n, w in p.items()
                if isinstance(w, int4.Int4Weight) and w.k_packed}
  layers = [lp | {"moe": moe(lp["moe"])} if "moe" in lp else lp for lp in params["layers"]]
  return params | {"layers": layers}


def apply_pack_fields(cfg: TargetConfig, params, donate_experts=False):
  """Packed `params` as `pack_for_decode(cfg, ...)` would lay them out for cfg's pack-time
  fields, from a model packed under other values of them: the experts' K layout
  (int4_k_interleaved, `relayout_experts`: a second copy of every re-laid stack unless
  donate_experts) and the norm folds (fold_norm_weights, `fold_norm_gains`)."""
  return fold_norm_gains(cfg, relayout_experts(cfg, params, donate_experts))


def _pack_moe(cfg: TargetConfig, p, out_major=True, donate_experts=False):
  p = _pack_experts(cfg, p, donate_experts)
  if "shared" not in p:
    return p
  shared = p["shared"]
  if p["router"].dtype != shared["gate"].dtype or shared["gate"].dtype != shared["up"].dtype:
    return p | {"shared": _pack_gate_up(shared, down_t=out_major)}
  rest = {k: w for k, w in p.items() if k not in ("router", "shared")}
  return rest | {"router_gate_up_t": _cat_t([p["router"], shared["gate"], shared["up"]]),
                 "shared": _down(shared, out_major)}
