"""The fewest bytes each phase of a decode step must move and the FLOPs it must do (one device).

Routed experts: tokens route over all `n_routed_experts` (E); this device holds the first
`num_local_experts` (E_l, all when None). A verify of T tokens with top-K routing is expected to
touch E_l * (1 - (1 - 1/E)^(K T)) local experts (independent routing; or the counts the router
gave, `routing`), each read once, at
`expert_bytes` per weight (2 for bf16, 0.5 + 2/32 for INT4 with bf16 group-32 scales), and to do
the FLOPs of the T * K * E_l / E (token, expert) pairs that land here.
Letters: T verify tokens, N verify width, D hidden, E experts, K per token, F expert width, V vocab.
"""

INT4_BYTES = 0.5 + 2 / 32


def local_experts(c) -> int:
  """Routed experts held on this device (TargetConfig.num_local_experts; None = all)."""
  return getattr(c, "num_local_experts", None) or c.n_routed_experts


def shared_width(c) -> int:
  """Width of the shared-expert FFN on this device."""
  return getattr(c, "shared_intermediate_size", None) or c.moe_intermediate_size * c.n_shared_experts


def _attn_weights(c):
  d, h = c.hidden_size, c.num_attention_heads
  q = (d * h * c.qk_head_dim if c.q_lora_rank is None
       else d * c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim)
  return q + d * c.cache_dim + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) \
      + h * c.v_head_dim * d


def _moe(c, t, wbytes, expert_bytes, routing=None):
  d, e, k, f = c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
  e_l, fs = local_experts(c), shared_width(c)
  touched, pairs = routing or independent_routing(c, t)
  return (c.num_moe_layers * (touched * 3 * d * f * expert_bytes + (3 * d * fs + d * e) * wbytes),
          c.num_moe_layers * 2 * (pairs * 3 * d * f + t * (3 * d * fs + d * e)))


def independent_routing(c, t):
  """(local experts touched, local (token, expert) pairs) per MoE layer for T tokens routed
  independently and uniformly (top-K of E, E_l held here)."""
  e, k, e_l = c.n_routed_experts, c.num_experts_per_tok, local_experts(c)
  return e_l * (1 - (1 - 1 / e) ** (k * t)), t * k * e_l / e


def _draft(dcfg, tcfg, spec, batch, ctx, wbytes):
  d, v = tcfg.hidden_size, tcfg.vocab_size
  dd, y = dcfg.hidden_size, dcfg.num_hidden_layers
  kv = dcfg.num_key_value_heads * dcfg.head_dim
  qo = dcfg.num_attention_heads * dcfg.head_dim
  layer_w = dd * (2 * qo + 2 * kv) + 3 * dd * dcfg.intermediate_size
  ctx_w = dcfg.n_taps * d * dd + y * 2 * dd * kv
  w_rows, bt = batch * spec.commit_width, batch * spec.block_size
  return {"draft_ctx": (ctx_w * wbytes, 2 * w_rows * ctx_w),
          "draft_block": ((y * layer_w + dd * v + y * 2 * batch * ctx * kv) * wbytes,
                          2 * bt * (y * layer_w + dd * v) + y * 4 * bt * ctx * qo),
          "tree": (batch * spec.depth * v * 4, 0)}


def phase_costs(tcfg, dcfg, spec, batch, ctx, wbytes=2, expert_bytes=None, routing=None):
  """{phase: (bytes, flops)} of one step at context `ctx` (weights at `wbytes` per element,
  routed experts at `expert_bytes`, default `wbytes`; routing: (local experts touched, local
  pairs) per MoE layer as counted from the router, default `independent_routing`)."""
  c, n = tcfg, spec.verify_width
  t, layers = batch * n, tcfg.num_hidden_layers
  d, h, v = c.hidden_size, c.num_attention_heads, c.vocab_size
  costs = {
      "attention": (layers * batch * (ctx + n) * c.cache_dim * wbytes,
                    layers * 2 * batch * h * n * (ctx + n) * (c.cache_dim + c.kv_lora_rank)),
      "moe": _moe(c, t, wbytes, wbytes if expert_bytes is None else expert_bytes, routing),
  }
  rest_w = layers * _attn_weights(c) + c.num_dense_layers * 3 * d * c.intermediate_size + d * v
  costs["rest"] = (rest_w * wbytes, 2 * t * rest_w)
  costs["verify"] = tuple(sum(costs[p][i] for p in ("attention", "moe", "rest")) for i in (0, 1))
  costs["accept"] = (t * v * 4, 0)
  compacted = spec.mode == "ddtree"  # ar / chain accept rows already in place
  costs["commit"] = (2 * layers * batch * spec.commit_width * c.cache_dim * wbytes * compacted, 0)
  if spec.mode != "ar":
    costs.update(_draft(dcfg, tcfg, spec, batch, ctx, wbytes))
  top = ("verify", "accept", "commit", "draft_ctx", "draft_block", "tree")
  costs["step"] = tuple(sum(val[i] for p, val in costs.items() if p in top) for i in (0, 1))
  return costs
