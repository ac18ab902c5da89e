"""The two DFlash draft phases against their roofline floors, ceilings measured in the same run.

draft_ctx: materialize_context of one commit (W = block_size new rows: fc + k/v of every layer,
written into the cache in place; timed inside a fori_loop that carries the cache, as the decode
loop does). draft_block: draft_block over `ctx` committed rows (every layer's weights, the ctx
K/V, the target lm_head). Both are the decode path's own functions (kdtree_jax/draft/model.py).
Default: bench_k26's draft (K2.6 width, 3 layers, 32/8 heads, F 12288; V/8 head) at 46k.

  python scripts/bench_draft.py --out_dir results/bench_draft            # GPU: CUPTI times
  python scripts/bench_draft.py --small --out_dir /tmp/bd               # CPU smoke (wall times)
"""

import json
import os
import re
import statistics
import time
import types

from absl import app, flags
import jax
import jax.numpy as jnp

from kdtree_jax.target import config as model_config
from kdtree_jax import loader, roofline  # noqa: E402
from kdtree_jax.draft import DraftConfig, model

FLAGS = flags.FLAGS
flags.DEFINE_list("ctx", ["46000"], "committed context lengths")
flags.DEFINE_integer("batch", 1, "rows")
flags.DEFINE_integer("reps", 20, "timed repetitions (median)")
flags.DEFINE_integer("loop_steps", 16, "draft_ctx commits per timed program (cache carried)")
flags.DEFINE_string("out_dir", "results/bench_draft", "writes bench_draft.jsonl here")
flags.DEFINE_string("cache_dir", "/tmp/jax_cache", "persistent compilation cache")
flags.DEFINE_bool("small", False, "tiny draft and ceilings (CPU smoke run)")
flags.DEFINE_bool("probe_cudnn", True, "GPU: also time one layer's ctx attention, XLA vs cuDNN")


def draft_setup(small):
  """(DraftConfig, params, embed [V, D], head [D, V]) in bf16: bench_k26's draft, or a tiny one."""
  if small:
    tcfg = model_config.tiny()
    c = types.SimpleNamespace(checkpoint="", preset="tiny", seed=1)
  else:
    tcfg = model_config.bench_k26(layers=4)
    c = types.SimpleNamespace(checkpoint="", preset="bench_k26", seed=1)
  dcfg, dparams = loader.load_draft(c, tcfg, jnp.bfloat16)
  ke, kh = jax.random.split(jax.random.key(2))
  D, V = tcfg.hidden_size, tcfg.vocab_size
  embed = (jax.random.normal(ke, (V, D), jnp.float32)).astype(jnp.bfloat16)
  head = (0.02 * jax.random.normal(kh, (D, V), jnp.float32)).astype(jnp.bfloat16)
  return dcfg, dparams, embed, head


def nbytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def ctx_cost(cfg: DraftConfig, params, b, w, wb=2):
  """(bytes, FLOPs) of one commit of w rows: fc + k/v weights, taps in, K/V + pos out."""
  D, G, E, Y = cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
  weights = nbytes(params["fc"]) + nbytes(params["hidden_norm"]) + sum(
      nbytes({k: lp[k] for k in ("k_proj", "v_proj", "k_norm")}) for lp in params["layers"])
  io = b * w * cfg.n_taps * D * wb + Y * 2 * b * w * G * E * wb + b * w * 4
  flops = 2 * b * w * (cfg.n_taps * D * D + Y * 2 * D * G * E)
  return weights + io, flops


def block_cost(cfg: DraftConfig, params, head, b, ctx, wb=2):
  """(bytes, FLOPs) of one block: every layer weight, the head, ctx K/V of `ctx` rows."""
  S, D, H, G, E, Y = (cfg.block_size, cfg.hidden_size, cfg.num_attention_heads,
                      cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers)
  layer_bytes = nbytes(params["layers"]) + nbytes(params["norm"])
  kv = Y * 2 * b * G * ctx * E * wb
  n_weights = sum(x.size for x in jax.tree.leaves(params["layers"]))
  flops = 2 * b * S * (n_weights + D * head.shape[1]) + Y * 4 * b * H * S * (ctx + S) * E
  return layer_bytes + nbytes(head) + kv + b * S * D * wb, flops


def timed_us(prog, args, reps):
  """(median us per call, timer, top kernels): CUPTI kernel time on a GPU, else wall time."""
  if jax.devices()[0].platform != "gpu":
    return roofline.wall_time_s(prog, *args, reps=reps) * 1e6, "wall", []
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(prog(*args))
  _, ts = profiler.measure(prog, iterations=reps)(*args)
  _, kernels = profiler.measure(prog, aggregate=False)(*args)
  top = sorted(kernels or [], key=lambda kv: -kv[1])[:6]
  return statistics.median(ts) * 1e3, "cupti", [(name[:80], ms * 1e3) for name, ms in top]


def filled_cache(cfg, b, capacity, ctx, seed=3):
  """A bf16 cache with random K/V, pos = row index, ctx_len = ctx."""
  empty = jax.eval_shape(lambda: model.init_draft_cache(cfg, b, capacity, jnp.bfloat16))
  keys = iter(jax.random.split(jax.random.key(seed), 2 * cfg.num_hidden_layers))
  rand = lambda a: jax.random.normal(next(keys), a.shape, jnp.float32).astype(a.dtype)
  return model.DraftCache(k=tuple(rand(a) for a in empty.k), v=tuple(rand(a) for a in empty.v),
                          pos=jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (b, capacity)),
                          ctx_len=jnp.full((b,), ctx, jnp.int32))


def ctx_program(cfg, steps, count):
  """`steps` commits in one program, the cache carried through a fori_loop (updated in place).

  Each commit reads its own taps (nothing is loop-invariant, so nothing is hoisted); the
  program returns the last row written of every K/V buffer, which keeps every write alive.
  """
  w = cfg.block_size

  def commits(params, cache, taps_nbtf):
    def body(i, c):
      pos = c.ctx_len[:, None] + jnp.arange(w, dtype=jnp.int32)
      return model.materialize_context(params, cfg, c, taps_nbtf[i], pos, count)
    out = jax.lax.fori_loop(0, steps, body, cache)
    last = jax.vmap(lambda a, at: jax.lax.dynamic_slice_in_dim(a, at, 1, axis=1))
    return [last(a, out.ctx_len - 1) for a in out.k + out.v]

  return jax.jit(commits)


def bench_ctx(cfg, params, b, ctx, reps, steps):
  """draft_ctx per commit: (T(steps) - T(steps // 4)) / (steps - steps // 4), which drops the
  program's fixed costs (the copy of the un-donated input cache into the loop, launches)."""
  w, few = cfg.block_size, max(1, steps // 4)
  cache = filled_cache(cfg, b, ctx + w * (steps + 1), ctx)
  taps = jax.random.normal(jax.random.key(4), (steps, b, w, cfg.n_taps * cfg.hidden_size),
                           jnp.bfloat16)
  count = jnp.full((b,), w, jnp.int32)
  t_many, timer, top = timed_us(ctx_program(cfg, steps, count), (params, cache, taps), reps)
  t_few, _, _ = timed_us(ctx_program(cfg, few, count), (params, cache, taps), reps)
  return (t_many - t_few) / (steps - few), timer, top


def cache_sized_outputs(hlo_text, cache_shape):
  """Computations of the optimized HLO that read a cache-shaped array and return one with the
  cache's dims in any order (a transpose / convert / copy of the K or V cache: bytes the floor
  does not have)."""
  dims = lambda ds: sorted(d for d in ds if d != 1)
  head = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*\w+\[([\d,]*)\]")
  found = []
  for line in hlo_text.splitlines():
    m = head.match(line)
    reads_cache = "[" + ",".join(map(str, cache_shape)) + "]" in line.split("->")[0]
    if m and m.group(2) and reads_cache and dims(int(d) for d in m.group(2).split(",")) == dims(cache_shape):
      found.append(m.group(1))
  return found


def bench_block(cfg, params, embed, head, b, ctx, reps):
  """draft_block over ctx committed rows (cache capacity ctx + W, as the decode loop sizes it).

  Returns (us, timer, top kernels, names of computations that rewrite a whole cache buffer)."""
  cache = filled_cache(cfg, b, ctx + cfg.block_size, ctx)
  block = model.make_block(cfg, jnp.ones((b,), jnp.int32))
  start = jnp.full((b,), ctx, jnp.int32)
  prog = jax.jit(lambda p, c, t, s, e, h: model.draft_block(p, cfg, c, t, s, e, h))
  args = (params, cache, block, start, embed, head)
  rewrites = cache_sized_outputs(prog.lower(*args).compile().as_text(), cache.k[0].shape)
  return (*timed_us(prog, args, reps), rewrites)


def ctx_attention_probe(cfg, b, ctx, reps):
  """One layer's ctx attention alone: this draft's XLA partial (all C rows, masked) vs cuDNN
  flash attention (jax._src, BNTH layout = the cache's, kv_seqlen = ctx_len: reads only ctx
  rows). Rows with times and the relative error between the two; an 'error' row if cuDNN fails."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=import-outside-toplevel
  S, H, G, E = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  cache = filled_cache(cfg, b, ctx + S, ctx)
  k, v, scale = cache.k[0], cache.v[0], E ** -0.5
  q = jax.random.normal(jax.random.key(5), (b, H, S, E), jnp.bfloat16)
  live = (jnp.arange(ctx + S)[None, :] < cache.ctx_len[:, None])[:, None, :]

  def xla(q, k, v, live):
    o, m, l = model._partial_attention(q.reshape(b, G, H // G, S, E), k, v, live, scale)  # pylint: disable=protected-access
    return (o / l[..., None]).reshape(b, H, S, E), (m + jnp.log(l)).reshape(b, H, S)

  def cudnn(q, k, v, ctx_len):
    return fa.dot_product_attention(
        q, k, v, q_seqlen=jnp.full((b,), S, jnp.int32), kv_seqlen=ctx_len, scale=scale,
        mask_type=fa.MaskType.PADDING, qkv_layout="BNTH", return_residual=True)

  rows = [dict(impl="xla", us=timed_us(jax.jit(xla), (q, k, v, live), reps)[0])]
  try:
    ref, got = jax.jit(xla)(q, k, v, live), jax.jit(cudnn)(q, k, v, cache.ctx_len)
    err = float(jnp.linalg.norm((got[0] - ref[0]).astype(jnp.float32)) /
                jnp.linalg.norm(ref[0].astype(jnp.float32)))
    lse_err = float(jnp.max(jnp.abs(got[1].reshape(ref[1].shape) - ref[1])))
    us = timed_us(jax.jit(cudnn), (q, k, v, cache.ctx_len), reps)[0]
    rows.append(dict(impl="cudnn", us=us, rel_err=err, lse_abs_err=lse_err))
  except Exception as e:  # pylint: disable=broad-except
    rows.append(dict(impl="cudnn", error=f"{type(e).__name__}: {str(e)[:300]}"))
  kv_bytes = 2 * b * G * ctx * E * 2
  for r in rows:
    r.update(phase="ctx_attention_1layer", ctx=ctx, batch=b, kv_bytes=kv_bytes)
  return rows


def row(phase, ctx, us, timer, top, cost, ceil, cfg, b):
  nb, fl = cost
  floor_us = roofline.floor_s(nb, fl, ceil) * 1e6
  return dict(phase=phase, ctx=ctx, batch=b, us=us, timer=timer, bytes=nb, flops=fl,
              floor_us=floor_us, x_floor=us / floor_us, pct_floor=100 * floor_us / us,
              tbps=nb / us / 1e6, top_kernels=top, layers=cfg.num_hidden_layers,
              hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
              kv_heads=cfg.num_key_value_heads, block=cfg.block_size, **ceil)


def main(_):
  jax.config.update("jax_compilation_cache_dir", FLAGS.cache_dir)
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  t0 = time.time()
  ceil = roofline.measure_ceilings(small=FLAGS.small)
  dev = jax.devices()[0]
  print(f"device={dev.device_kind} jax={jax.__version__} copy={ceil['copy_tbps']:.2f} TB/s "
        f"matmul={ceil['mm_tflops']:.0f} TFLOP/s ({time.time() - t0:.0f} s)", flush=True)
  cfg, params, embed, head = draft_setup(FLAGS.small)
  rows, b = [], FLAGS.batch
  for ctx in map(int, FLAGS.ctx):
    us, timer, top = bench_ctx(cfg, params, b, ctx, FLAGS.reps, FLAGS.loop_steps)
    rows.append(row("draft_ctx", ctx, us, timer, top, ctx_cost(cfg, params, b, cfg.block_size),
                    ceil, cfg, b))
    us, timer, top, rewrites = bench_block(cfg, params, embed, head, b, ctx, FLAGS.reps)
    rows.append(row("draft_block", ctx, us, timer, top, block_cost(cfg, params, head, b, ctx),
                    ceil, cfg, b) | dict(cache_sized_outputs=rewrites))
    if FLAGS.probe_cudnn and jax.devices()[0].platform == "gpu":
      rows += ctx_attention_probe(cfg, b, ctx, FLAGS.reps)
    print(f"ctx={ctx} done ({time.time() - t0:.0f} s)", flush=True)
  path = os.path.join(FLAGS.out_dir, "bench_draft.jsonl")
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  for r in rows:
    if r["phase"] == "ctx_attention_1layer":
      print(f"  ctx attention, 1 layer, {r['impl']}: {r.get('us', float('nan')):.1f} us, "
            f"K/V {r['kv_bytes'] / r['us'] / 1e6 if 'us' in r else float('nan'):.2f} TB/s "
            f"{r.get('error', '')} rel err {r.get('rel_err', '-')}")
    for name, us in r.get("top_kernels", ()):
      print(f"  {r['phase']:>11} {r['ctx']:>6} {us:9.1f} us  {name}")
  print(f"{'phase':>11} {'ctx':>6} {'us':>9} {'floor us':>9} {'x floor':>8} {'TB/s':>6} timer")
  for r in (r for r in rows if "floor_us" in r):
    print(f"{r['phase']:>11} {r['ctx']:>6} {r['us']:9.1f} {r['floor_us']:9.1f} "
          f"{r['x_floor']:8.2f} {r['tbps']:6.2f} {r['timer']}")
  for r in (r for r in rows if "cache_sized_outputs" in r):
    print(f"draft_block ctx={r['ctx']}: computations writing a cache-sized array: "
          f"{len(r['cache_sized_outputs'])} {r['cache_sized_outputs'][:4]}")
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
