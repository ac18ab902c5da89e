"""Phase profiler: each phase of the speculative step compiled alone on the same inputs,
next to the fused step, with bytes / FLOPs counted and % of the measured roofline.

Phases: draft_ctx (materialise context K/V), draft_block (block forward), tree, verify
(split into attention / moe / rest), accept, commit; and `step` (the fused program).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


import pallas_kernels
from kdtree_jax import roofline
from kdtree_jax.cache import LatentCache
from kdtree_jax.decoding import loop, step
from kdtree_jax.decoding.state import DecodeState
from kdtree_jax.draft import model as draft_model
from kdtree_jax.model.moe import moe


def _random_like(key, buffers, dtype):
  """Random normal buffers shaped like a tuple of per-layer cache buffers."""
  return tuple(jax.random.normal(k, a.shape, dtype)
               for k, a in zip(jax.random.split(key, len(buffers)), buffers))


def bench_state(tcfg, dcfg, spec, batch, ctx, dtype=jnp.bfloat16, seed=0,
                steps=64) -> DecodeState:
  """A decode state at context length `ctx` with random cache contents (no prefill needed).

  The cache has room for `steps` more full commits, so rows stay live through a timed loop.
  """
  k = jax.random.split(jax.random.key(seed), 4)
  rows = -(-(ctx + spec.verify_width + spec.commit_width * steps) // 64) * 64
  shapes = jax.eval_shape(lambda: LatentCache.zeros(tcfg, batch, rows, dtype))
  cache = LatentCache(latent=_random_like(k[0], shapes.latent, dtype),
                      lengths=jnp.full((batch,), ctx, jnp.int32))
  draft_cache, pending = None, None
  if spec.mode != "ar":
    dc = jax.eval_shape(lambda: draft_model.init_draft_cache(dcfg, batch, rows + spec.commit_width,
                                                             dtype))
    draft_cache = dc.replace(
        k=_random_like(k[1], dc.k, dtype), v=_random_like(k[2], dc.v, dtype),
        pos=jnp.broadcast_to(jnp.arange(dc.pos.shape[1], dtype=jnp.int32), dc.pos.shape),
        ctx_len=jnp.full((batch,), ctx - spec.commit_width, jnp.int32))
    pending = jax.random.normal(
        k[3], (batch, spec.commit_width, dcfg.n_taps * tcfg.hidden_size), dtype)
  return DecodeState(
      cache=cache, draft_cache=draft_cache, bonus=jnp.ones((batch,), jnp.int32),
      pending_taps=pending, pending_count=jnp.full((batch,), spec.commit_width, jnp.int32),
      out=jnp.zeros((batch, loop.out_size(spec)), jnp.int32), n_out=jnp.ones((batch,), jnp.int32),
      done=jnp.zeros((batch,), bool), key=jax.random.key(seed),
      steps=jnp.zeros((), jnp.int32), accepted=jnp.zeros((spec.max_new_tokens, batch), jnp.int32),
      capacity=jnp.asarray(rows - spec.verify_width, jnp.int32))


# ---- bytes and FLOPs ----------------------------------------------------------------------
def _attn_weights(c):
  d, h = c.hidden_size, c.num_attention_heads
  q = (d * h * c.qk_head_dim if c.q_lora_rank is None
       else d * c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim)
  return q + d * c.cache_dim + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) \
      + h * c.v_head_dim * d


def phase_costs(tcfg, dcfg, spec, batch, ctx, wbytes=2):
  """{phase: (bytes, flops)}: the fewest bytes each phase must move and the FLOPs it must do."""
  n, t = spec.verify_width, batch * spec.verify_width
  c, layers = tcfg, tcfg.num_hidden_layers
  d, h, v = c.hidden_size, c.num_attention_heads, c.vocab_size
  e, k, f = c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
  moe_layers = c.num_moe_layers
  touched = e * (1 - (1 - k / e) ** t)  # expected distinct experts hit by t tokens
  fs = f * c.n_shared_experts
  costs = {
      "attention": (layers * batch * (ctx + n) * c.cache_dim * wbytes,
                    layers * 2 * batch * h * n * (ctx + n) * (c.cache_dim + c.kv_lora_rank)),
      "moe": (moe_layers * (touched * 3 * d * f + 3 * d * fs + d * e) * wbytes,
              moe_layers * 2 * t * (k * 3 * d * f + 3 * d * fs + d * e)),
  }
  rest_w = layers * _attn_weights(c) + c.num_dense_layers * 3 * d * c.intermediate_size + d * v
  costs["rest"] = (rest_w * wbytes, 2 * t * rest_w)
  costs["verify"] = tuple(sum(costs[p][i] for p in ("attention", "moe", "rest")) for i in (0, 1))
  costs["accept"] = (t * v * 4, 0)
  costs["commit"] = (2 * layers * batch * spec.commit_width * c.cache_dim * wbytes, 0)
  if spec.mode != "ar":
    dd, y = dcfg.hidden_size, dcfg.num_hidden_layers
    kv = dcfg.num_key_value_heads * dcfg.head_dim
    qo = dcfg.num_attention_heads * dcfg.head_dim
    layer_w = dd * (2 * qo + 2 * kv) + 3 * dd * dcfg.intermediate_size
    w_rows = batch * spec.commit_width
    costs["draft_ctx"] = ((dcfg.n_taps * d * dd + y * 2 * dd * kv) * wbytes,
                          2 * w_rows * (dcfg.n_taps * d * dd + y * 2 * dd * kv))
    bt = batch * spec.block_size
    costs["draft_block"] = ((y * layer_w + dd * v + y * 2 * batch * ctx * kv) * wbytes,
                            2 * bt * (y * layer_w + dd * v) + y * 4 * bt * ctx * qo)
    costs["tree"] = (batch * spec.depth * v * 4, 0)
  costs["step"] = tuple(sum(val[i] for p, val in costs.items()
                            if p in ("verify", "accept", "commit", "draft_ctx", "draft_block",
                                     "tree")) for i in (0, 1))
  return costs


# ---- the phases as separately compiled programs -------------------------------------------
def phase_programs(tcfg, tparams, dcfg, dparams, spec, state):
  """{name: (jitted fn, args)}: every phase on the inputs it sees inside the fused step."""
  progs = {}
  b = state.bonus.shape[0]
  tap_layers = () if spec.mode == "ar" else tuple(dcfg.target_layer_ids)
  draft_logits = None
  if spec.mode != "ar":
    dc = state.draft_cache
    w = state.pending_taps.shape[1]
    pos = dc.ctx_len[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
    ctx_fn = jax.jit(lambda dp, c, taps: draft_model.materialize_context(
        dp, dcfg, c, taps, pos, state.pending_count))
    progs["draft_ctx"] = (ctx_fn, (dparams, dc, state.pending_taps))
    dc2 = ctx_fn(dparams, dc, state.pending_taps)
    block = jnp.full((b, spec.block_size), dcfg.mask_token_id, jnp.int32).at[:, 0].set(state.bonus)
    blk_fn = jax.jit(lambda dp, tp, c: draft_model.draft_block(
        dp, dcfg, c, block, state.cache.lengths, tp["embed"], tp["lm_head"])[:, 1:])
    progs["draft_block"] = (blk_fn, (dparams, tparams, dc2))
    draft_logits = blk_fn(dparams, tparams, dc2)
  tree_fn = jax.jit(lambda x: step.tree_phase(spec, x, b))
  if spec.mode != "ar":
    progs["tree"] = (tree_fn, (draft_logits,))
  tree = tree_fn(draft_logits)
  ver_fn = jax.jit(lambda tp, st, tr: step.verify_phase(tcfg, tp, spec, st, tr, tap_layers))
  progs["verify"] = (ver_fn, (tparams, state, tree))
  logits, cache, taps = ver_fn(tparams, state, tree)
  progs.update(_verify_parts(tcfg, tparams, spec, state))
  room = jnp.full((b,), spec.depth, jnp.int32)
  acc_fn = jax.jit(lambda tr, lg, key: step.accept_phase(spec, tr, lg, key, room))
  progs["accept"] = (acc_fn, (tree, logits, state.key))
  path, a, nxt = acc_fn(tree, logits, state.key)
  com_fn = jax.jit(lambda st, c, dc, tr, tp_, p, a_, nx: step.commit_phase(
      spec, tcfg.eos_token_id, st, c, dc, tr, tp_, p, a_, nx, st.key))
  progs["commit"] = (com_fn, (state, cache, state.draft_cache, tree, taps, path, a, nxt))
  progs["step"] = (jax.jit(lambda tp, dp, st: step.speculative_step(tcfg, tp, dcfg, dp, spec, st)),
                   (tparams, dparams, state))
  return progs


def _verify_parts(tcfg, tparams, spec, state):
  """Verify's attention alone (all layers) and MoE alone (all MoE layers), on random inputs."""
  b, n, c = state.bonus.shape[0], spec.verify_width, tcfg
  dtype = state.cache.dtype
  q = jax.random.normal(jax.random.key(1), (b, n, c.num_attention_heads, c.cache_dim), dtype)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))

  def attn(latent, lengths):
    return [pallas_kernels.tree_verify_attention(q, latent[i], lengths, mask, scale=c.softmax_scale,
                                                 backend=spec.attn_backend, value_dim=c.kv_lora_rank)
            for i in range(c.num_hidden_layers)]

  x = jax.random.normal(jax.random.key(2), (b * n, c.hidden_size), dtype)
  moe_layers = [lp["moe"] for lp in tparams["layers"] if "moe" in lp]
  parts = {"attention": (jax.jit(attn), (state.cache.latent, state.cache.lengths))}
  if moe_layers:
    parts["moe"] = (jax.jit(lambda ps, x: [moe(p, c, x) for p in ps]), (moe_layers, x))
  return parts


@dataclasses.dataclass
class PhaseRow:
  phase: str
  ms: float
  bytes: float
  flops: float
  floor_ms: float

  @property
  def pct_roofline(self) -> float:
    return 100 * self.floor_ms / self.ms if self.ms else 0.0


def profile_step(tcfg, tparams, dcfg, dparams, spec, state, ceil, reps=20) -> list[PhaseRow]:
  """Times every phase alone and the fused step; returns rows with roofline floors."""
  batch, ctx = state.bonus.shape[0], int(state.cache.lengths[0])
  costs = phase_costs(tcfg, dcfg, spec, batch, ctx, state.cache.dtype.itemsize)
  rows = []
  for name, (fn, args) in phase_programs(tcfg, tparams, dcfg, dparams, spec, state).items():
    ms = 1e3 * roofline.wall_time_s(fn, *args, reps=reps)
    nb, fl = costs.get(name, (0, 0))
    rows.append(PhaseRow(name, ms, nb, fl, 1e3 * roofline.floor_s(nb, fl, ceil)))
  rest = next(r for r in rows if r.phase == "verify").ms - sum(
      r.ms for r in rows if r.phase in ("attention", "moe"))
  nb, fl = costs["rest"]
  rows.append(PhaseRow("rest", rest, nb, fl, 1e3 * roofline.floor_s(nb, fl, ceil)))
  return rows


def format_table(rows: list[PhaseRow]) -> str:
  step_ms = next(r.ms for r in rows if r.phase == "step")
  top = ("draft_ctx", "draft_block", "tree", "verify", "accept", "commit")
  total = sum(r.ms for r in rows if r.phase in top)
  lines = [f"{'phase':<12}{'ms':>9}{'% step':>8}{'MB':>10}{'GFLOP':>10}{'floor ms':>10}"
           f"{'% roof':>8}"]
  for r in rows:
    indent = "  " if r.phase in ("attention", "moe", "rest") else ""
    lines.append(f"{indent + r.phase:<12}{r.ms:9.3f}{100 * r.ms / step_ms:8.1f}"
                 f"{r.bytes / 1e6:10.1f}{r.flops / 1e9:10.2f}{r.floor_ms:10.3f}"
                 f"{r.pct_roofline:8.1f}")
  lines.append(f"sum of phases {total:.3f} ms vs fused step {step_ms:.3f} ms "
               f"({100 * (total - step_ms) / step_ms:+.1f}%)")
  return "\n".join(lines)


def while_steps_fn(tcfg, dcfg, spec):
  """jit(tparams, dparams, state, n): n steps in a lax.while_loop with a device-side condition,
  as the generate loop runs them. Params are arguments (never captured as constants)."""
  def run(tp, dp, st, n):
    return jax.lax.while_loop(lambda s: s.steps < n, lambda s: step.speculative_step(
        tcfg, tp, dcfg, dp, spec, s), st)
  return jax.jit(run)


def device_busy_us(fn, *args):
  """Sum of the GPU kernel times of one call (CUPTI via Mosaic GPU's profiler); None off-GPU."""
  if jax.default_backend() != "gpu":
    return None
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  _, ts = profiler.measure(fn, iterations=10)(*args)
  return 1e3 * sorted(ts)[len(ts) // 2]


def loop_host_gap_us(tcfg, tparams, dcfg, dparams, spec, state, steps=(8, 40), loop_fn=None):
  """Per-step wall time inside the device loop vs the step's own GPU kernel time.

  loop_us: slope of loop wall time over two step counts (dispatch amortised away);
  kernel_us: kernels of one fused step (CUPTI); gap_us = loop_us - kernel_us is the per-step
  time the GPU idles inside the loop (while-loop predicate round trips, launch gaps).
  """
  loop_fn = loop_fn or while_steps_fn(tcfg, dcfg, spec)
  st = state.replace(steps=jnp.zeros((), jnp.int32))
  t = {n: roofline.wall_time_s(loop_fn, tparams, dparams, st, jnp.int32(n), reps=5)
       for n in steps}
  loop_us = 1e6 * (t[steps[1]] - t[steps[0]]) / (steps[1] - steps[0])
  one = jax.jit(lambda tp, dp, s: step.speculative_step(tcfg, tp, dcfg, dp, spec, s))
  kernel_us = device_busy_us(one, tparams, dparams, st)
  return dict(loop_us=loop_us, kernel_us=kernel_us,
              gap_us=None if kernel_us is None else loop_us - kernel_us,
              loop_total_s={n: t[n] for n in steps})


def at_context(state: DecodeState, spec, ctx: int) -> DecodeState:
  """The same (max-size) bench state with committed length `ctx` (data, not shape)."""
  b = state.bonus.shape[0]
  st = state.replace(cache=state.cache.replace(lengths=jnp.full((b,), ctx, jnp.int32)))
  if state.draft_cache is not None:
    st = st.replace(draft_cache=state.draft_cache.replace(
        ctx_len=jnp.full((b,), ctx - spec.commit_width, jnp.int32)))
  return st


def measured_accept(loop_fn, tparams, dparams, state, n):
  """Mean tokens committed per step (root included) over n loop steps from `state`."""
  st = loop_fn(tparams, dparams, state.replace(steps=jnp.zeros((), jnp.int32)), jnp.int32(n))
  return float(np.asarray(jax.device_get(st.accepted))[:n].mean())


def time_contexts(tcfg, tparams, dcfg, dparams, spec, ctxs, dtype, batch=1, gen=16):
  """One compiled device loop for `spec`; per context (data, not shape): ms/step (slope of the
  loop time over 4 vs 4 + gen steps), tokens/step measured from the loop, GPU kernel time and
  host gap per step."""
  big = bench_state(tcfg, dcfg, spec, batch, max(ctxs), dtype, steps=gen + 8)
  loop_fn = while_steps_fn(tcfg, dcfg, spec)
  rows = []
  for ctx in ctxs:
    st = at_context(big, spec, ctx)
    gap = loop_host_gap_us(tcfg, tparams, dcfg, dparams, spec, st, steps=(4, 4 + gen),
                           loop_fn=loop_fn)
    tok = measured_accept(loop_fn, tparams, dparams, st, gen)
    ms, timing = gap["loop_us"] / 1e3, "slope"
    if ms <= 0:  # timing noise swamped the slope (tiny CPU runs): whole-loop time per step
      ms, timing = 1e3 * gap["loop_total_s"][4 + gen] / (4 + gen), "total"
    rows.append(dict(mode=spec.mode, budget=spec.budget if spec.mode == "ddtree" else None,
                     block_size=spec.block_size if spec.mode != "ar" else None, ctx=ctx,
                     batch=batch, attn_backend=spec.attn_backend,
                     forced_accept=spec.forced_accept, verify_width=spec.verify_width,
                     ms_per_step=ms, timing=timing, accepted_per_step=tok,
                     tokens_per_s=1e3 * tok * batch / ms, kernel_us=gap["kernel_us"],
                     host_gap_us=gap["gap_us"], layers=tcfg.num_hidden_layers,
                     device=jax.devices()[0].device_kind))
  return rows


def trace_loop(tcfg, tparams, dcfg, dparams, spec, state, logdir, n_steps=8):
  """A jax.profiler trace of the fused loop (named scopes per phase) for Perfetto/TensorBoard."""
  fn = while_steps_fn(tcfg, dcfg, spec)
  st = state.replace(steps=jnp.zeros((), jnp.int32))
  jax.block_until_ready(fn(tparams, dparams, st, jnp.int32(n_steps)))
  with jax.profiler.trace(logdir):
    jax.block_until_ready(fn(tparams, dparams, st, jnp.int32(n_steps)))
  return logdir


def as_dicts(rows):
  return [dict(dataclasses.asdict(r), pct_roofline=r.pct_roofline) for r in rows]


