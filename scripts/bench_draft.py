"""The two DFlash draft phases against their roofline floors, ceilings measured in the same run.

draft_ctx: materialize_context of one commit (W = block_size new rows: fc + k/v of every layer,
written into the cache in place; timed inside a fori_loop that carries the cache, as the decode
loop does), once per K/V projection form (--ctx_kv: xla = two dots per layer, which XLA:GPU's
DotMerger turns into one dot over a concatenation of the weights built on every commit;
nomerge = compiled with the DotMerger off; packed = model.pack_ctx_kv's weights, concatenated once before the
program, as a load would). draft_block: draft_block over `ctx` committed rows (every layer's
weights, the ctx K/V, the target lm_head), once per ctx attention implementation (--ctx_impls:
xla = chunked XLA dots over the whole capacity; pallas[:chunk:block_k:warps:stages] = the fused
Triton kernel, rows < ctx_len only, default_tuning's fields where left out; +block = the
block's own keys as one more program of that kernel instead of an XLA part; +packed = params
through model.pack_for_decode, q|k|v and gate|up weights side by side: one dot each; with
+block+packed the kernel reads q and the block's K/V from the q|k|v dot's packed output and a
second kernel merges its partials into the o_proj input (draft_block's packed_io, the default);
+splitio = the older form, packed_io=False: q, k, v sliced and transposed for the kernel, its
partials merged by XLA; packed_io's kernel also applies the q/k norms and rope to the dot's
raw heads (qk_in_kernel, the default; +xlaqk = XLA's norm + rope fusion instead); the A/B
options +qkjoin, +expe (base-e softmax; base 2 is the default since s5), +msplitN, +hgN
(see --ctx_impls); +tokqkv (with +packed: model.pack_token_qkv's table, layer 0's q|k|v rows
looked up per block token instead of its dot; the floor stays the draft's own);
+cublas = compiled with XLA's Triton GEMMs off). Both are the decode path's own functions
(kdtree_jax/draft/model.py). Drafts (--drafts): k26_dflash_share
= bench_k26_full's draft (published K2.6 DFlash shape sliced 1/8: 6 layers, 8 q / 1 kv heads,
F 2304, 6 taps), bench_k26 = a Qwen3-8B-DFlash-sized draft (3 layers, 32/8 heads, F 12288,
3 taps); both at K2.6 width with the V/8 head, at 46k. On a GPU each phase also prints its
kernels per call (CUPTI, aggregated by name; draft_ctx per commit, the loop's fixed costs
dropped as in its time), each with its optimized-HLO instruction's shapes and op name.

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

from kdtree_jax import bench_models, loader, roofline, timing
from kdtree_jax.profiling_hlo import kernel_ops  # CUPTI kernel -> HLO op, source line
from kdtree_jax.draft import DraftConfig, model
from kdtree_jax.target import config as model_config

FLAGS = flags.FLAGS
flags.DEFINE_list("ctx", ["46000"], "committed context lengths")
flags.DEFINE_integer("batch", 1, "rows")
flags.DEFINE_integer("reps", 20, "timed repetitions (median)")
flags.DEFINE_integer("loop_steps", 16, "draft_ctx commits per timed program (cache carried)")
flags.DEFINE_string("out_dir", "results/bench_draft", "writes bench_draft.jsonl here")
flags.DEFINE_string("cache_dir", "/tmp/jax_cache", "persistent compilation cache")
flags.DEFINE_bool("small", False, "tiny draft and ceilings (CPU smoke run)")
flags.DEFINE_bool("probe_cudnn", False, "GPU: also time one layer's ctx attention, XLA vs cuDNN")
flags.DEFINE_list("drafts", ["k26_dflash_share", "bench_k26"], "draft shapes (see the docstring)")
flags.DEFINE_list("ctx_impls", [
    "xla", "pallas", "pallas+block", "pallas+packed", "pallas+block+packed",
    "pallas+block+packed+cublas", "pallas:p132", "pallas:p131+block", "pallas:p131:128+block",
    "pallas:p131+block+packed", "pallas:p131:128+block+packed", "pallas:p131:64:8:3+block+packed",
    "pallas:p66:128+block", "pallas+block+packed+splitio",
    "pallas+block+packed+xlaqk", "pallas+block+packed+qkjoin", "pallas+block+packed+expe",
    "pallas+block+packed+msplit2", "pallas+block+packed+hg2", "pallas:p65+block+packed+hg2",
    "pallas:512:128", "pallas:512:128+block", "pallas:512:32", "pallas:512:64:4",
    "pallas:512:64:8:3"],
                  "draft_block ctx attention: xla, or pallas[:chunk or pPROGRAMS[:block_k"
                  "[:num_warps[:num_stages]]]][+SUFFIX...] (GPU only; fields left out: "
                  "ctx_attention.default_tuning's). Suffixes: +block: the block's own keys as "
                  "one more program of the kernel, model.draft_block(block_in_kernel=True); "
                  "+packed: params through model.pack_for_decode: q|k|v and gate|up in one dot "
                  "each; +splitio: draft_block(packed_io=False), the kernel's older I/O; "
                  "+xlaqk: draft_block(qk_in_kernel=False), q/k norm and rope by XLA (the "
                  "default before the fifth session); +qkjoin: Tuning.join_halves (in-kernel "
                  "roped halves joined, full-width score dots); +exp2: Tuning.exp2 (base-2 "
                  "softmax, the default); +expe: the base-e softmax (before s5); +msplitN: Tuning.merge_pieces=N (merge programs of Y/N columns); "
                  "+hgN: Tuning.head_groups=N (each kv head's query heads in N program rows); "
                  "+tokqkv (with +packed): model.pack_token_qkv, layer 0's q|k|v rows looked "
                  "up per token, no layer-0 q|k|v dot; "
                  "+cublas: "
                  "compiled with XLA's Triton GEMMs off, cuBLAS for every dot")
flags.DEFINE_list("ctx_kv", ["xla", "nomerge", "packed"],
                  "draft_ctx K/V projections: xla (two dots per layer; XLA may merge them), "
                  "nomerge (compiled with XLA's DotMerger off), packed (model.pack_ctx_kv: one "
                  "dot for all layers)")
flags.DEFINE_integer("top", 12, "kernels listed per phase")
flags.DEFINE_bool("f32_ref", False, "draft_block rows also report their logits' rel L2 against "
                  "the same draft in f32 (XLA attention; weights, cache and inputs upcast): "
                  "the bf16 error of each form, to compare A/B forms that round differently")


def draft_setup(small, name):
  """(DraftConfig, params, embed [V, D], head [D, V]) in bf16 of draft `name`, or a tiny one."""
  if small:
    tcfg = model_config.tiny()
    c = types.SimpleNamespace(checkpoint="", preset="tiny", seed=1)
  elif name == "k26_dflash_share":
    tcfg = bench_models.k26_share()
    c = types.SimpleNamespace(checkpoint="", preset=name, seed=1, get=lambda k, d: d)
  elif name == "bench_k26":
    tcfg = model_config.bench_k26(layers=4)
    c = types.SimpleNamespace(checkpoint="", preset=name, seed=1)
  else:
    raise ValueError(f"unknown draft {name!r}; use k26_dflash_share or bench_k26")
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
  """(median us per call, timer, kernels per call): CUPTI kernel time on a GPU, else wall time.
  Kernels: [(name, launches per call, us per call)] (timing.kernel_breakdown), slowest first."""
  if jax.devices()[0].platform != "gpu":
    return roofline.wall_time_s(prog, *args, reps=reps) * 1e6, "wall", []
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(prog(*args))
  _, ts = profiler.measure(prog, iterations=reps)(*args)
  return statistics.median(ts) * 1e3, "cupti", timing.kernel_breakdown(prog, args, iters=3)


def kernels_per_step(many, few, steps_many, steps_few):
  """Per-name (launches, us) of one loop step: (many - few) / (steps_many - steps_few), which
  drops what both programs run once (the input cache copy, launches outside the loop)."""
  per = {}
  for sign, rows in ((1, many), (-1, few)):
    for name, n, us in rows:
      a, b = per.get(name, (0.0, 0.0))
      per[name] = (a + sign * n, b + sign * us)
  d = steps_many - steps_few
  rows = [(name, n / d, us / d) for name, (n, us) in per.items() if abs(us) > 1e-3]
  return sorted(rows, key=lambda r: -r[2])


def filled_cache(cfg, b, capacity, ctx, seed=3):
  """A bf16 cache with random K/V, pos = row index, ctx_len = ctx."""
  empty = jax.eval_shape(lambda: model.init_draft_cache(cfg, b, capacity, jnp.bfloat16))
  keys = iter(jax.random.split(jax.random.key(seed), 2 * cfg.num_hidden_layers))
  rand = lambda a: jax.random.normal(next(keys), a.shape, jnp.float32).astype(a.dtype)
  rows = empty.pos.shape[1]  # capacity rounded up as init_draft_cache does
  return model.DraftCache(k=tuple(rand(a) for a in empty.k), v=tuple(rand(a) for a in empty.v),
                          pos=jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32), (b, rows)),
                          ctx_len=jnp.full((b,), ctx, jnp.int32))


# XLA options of two A/B rows (a program's own compile options, not the process's flags):
NO_DOT_MERGER = {"xla_gpu_dot_merger_threshold_mb": 0}  # draft_ctx 'nomerge'
CUBLAS_GEMMS = {"xla_gpu_enable_triton_gemm": False}  # draft_block '+cublas'


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


def bench_ctx(cfg, params, b, ctx, reps, steps, variant="xla"):
  """draft_ctx per commit: (T(steps) - T(steps // 4)) / (steps - steps // 4), which drops the
  program's fixed costs (the copy of the un-donated input cache into the loop, launches).
  variant: a --ctx_kv name ('packed': params through model.pack_ctx_kv first, as a load would;
  'nomerge': per-layer dots compiled with XLA's DotMerger off)."""
  params = model.pack_ctx_kv(params) if variant == "packed" else params
  options = NO_DOT_MERGER if variant == "nomerge" else None
  w, few = cfg.block_size, max(1, steps // 4)
  cache = filled_cache(cfg, b, ctx + w * (steps + 1), ctx)
  taps = jax.random.normal(jax.random.key(4), (steps, b, w, cfg.n_taps * cfg.hidden_size),
                           jnp.bfloat16)
  count = jnp.full((b,), w, jnp.int32)
  args = (params, cache, taps)
  compile_ = lambda n: ctx_program(cfg, n, count).lower(*args).compile(options)
  prog = compile_(steps)
  t_many, timer, k_many = timed_us(prog, args, reps)
  t_few, _, k_few = timed_us(compile_(few), args, reps)
  per_step = kernels_per_step(k_many, k_few, steps, few)
  ops = kernel_ops(prog.as_text(), per_step, FLAGS.top)
  return (t_many - t_few) / (steps - few), timer, per_step, ops


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


SUFFIXES = ("block", "packed", "splitio", "xlaqk", "cublas", "qkjoin", "exp2", "expe", "tokqkv")
NUMBERED = ("msplit", "hg")  # +msplitN: Tuning.merge_pieces=N; +hgN: Tuning.head_groups=N


def parse_ctx_impl(name):
  """'pallas:512:64:8:3+block+packed' -> ('pallas', 512, (('block_k', 64), ('num_warps', 8),
  ('num_stages', 3)), {'block': 1, 'packed': 1}); 'pallas:p131' -> tuning (('programs', 131),):
  131 programs per kv head sharing the rows below ctx_len; fields left out keep
  default_tuning's. Suffixes: SUFFIXES, and NUMBERED ones with their number ('msplit': 2)."""
  name, *suffixes = name.split("+")
  extras = {}
  for x in suffixes:
    m = re.fullmatch(r"(" + "|".join(NUMBERED) + r")(\d+)", x)
    if x not in SUFFIXES and not m:
      raise ValueError(f"unknown ctx_impl suffix {x!r} in {name!r}: "
                       f"{', '.join(SUFFIXES)} or {'N, '.join(NUMBERED)}N only")
    extras[m.group(1) if m else x] = int(m.group(2)) if m else 1
  impl, *fields = name.split(":")
  split = bool(fields) and fields[0].startswith("p")  # p132: tuning.programs = 132
  fields = [int(f.lstrip("p")) for f in fields]
  chunk = fields[0] if fields and not split else None
  tuning = tuple(zip(("block_k", "num_warps", "num_stages"), fields[1:]))
  tuning += (("programs", fields[0]),) if split else ()
  tuning += tuple((field, True) for field, x in (("join_halves", "qkjoin"), ("exp2", "exp2"))
                  if x in extras)
  tuning += (("exp2", False),) if "expe" in extras else ()  # the base-e softmax (before s5)
  tuning += (("merge_pieces", extras["msplit"]),) if "msplit" in extras else ()
  tuning += (("head_groups", extras["hg"]),) if "hg" in extras else ()
  return impl, chunk, tuning, extras


def bench_block(cfg, params, embed, head, b, ctx, reps, ctx_impl):
  """draft_block over ctx committed rows (cache capacity ctx + W rounded up as init_draft_cache
  does, as the decode loop sizes it).

  Returns (us, timer, kernels per call, names of computations that rewrite a whole cache
  buffer, logits, kernel_ops of the top kernels)."""
  cache = filled_cache(cfg, b, ctx + cfg.block_size, ctx)
  block = model.make_block(cfg, jnp.ones((b,), jnp.int32))
  start = jnp.full((b,), ctx, jnp.int32)
  impl, chunk, tuning, extras = parse_ctx_impl(ctx_impl)
  params = model.pack_for_decode(params) if "packed" in extras else params
  params = model.pack_token_qkv(params, cfg, embed) if "tokqkv" in extras else params
  options = CUBLAS_GEMMS if "cublas" in extras else None
  prog = jax.jit(lambda p, c, t, s, e, h: model.draft_block(
      p, cfg, c, t, s, e, h, ctx_impl=impl, kernel_chunk=chunk, kernel_tuning=tuning,
      block_in_kernel="block" in extras, packed_io="splitio" not in extras,
      qk_in_kernel="xlaqk" not in extras))
  args = (params, cache, block, start, embed, head)
  compiled = prog.lower(*args).compile(options)  # timed as is: one compile per impl
  text = compiled.as_text()
  us, timer, kernels = timed_us(compiled, args, reps)
  return (us, timer, kernels, cache_sized_outputs(text, cache.k[0].shape), compiled(*args),
          kernel_ops(text, kernels, FLAGS.top))


def f32_reference(cfg, params, embed, head, b, ctx):
  """bench_block's draft_block inputs upcast to f32 through the XLA form: [B, S, V] f32 logits
  (the bf16 rows' common reference)."""
  up = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x,
                              t)
  cache = up(filled_cache(cfg, b, ctx + cfg.block_size, ctx))
  block = model.make_block(cfg, jnp.ones((b,), jnp.int32))
  start = jnp.full((b,), ctx, jnp.int32)
  prog = jax.jit(lambda p, c, t, s, e, h: model.draft_block(p, cfg, c, t, s, e, h, ctx_impl="xla"))
  return prog(up(params), cache, block, start, up(embed), up(head))


def rel_l2(got, ref):
  """||got - ref|| / ||ref|| in f32."""
  got, ref = got.astype(jnp.float32), ref.astype(jnp.float32)
  return float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))


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


def row(phase, ctx, us, timer, kernels, cost, ceil, cfg, b):
  nb, fl = cost
  floor_us = roofline.floor_s(nb, fl, ceil) * 1e6
  return dict(phase=phase, ctx=ctx, batch=b, us=us, timer=timer, bytes=nb, flops=fl,
              floor_us=floor_us, x_floor=us / floor_us, pct_floor=100 * floor_us / us,
              tbps=nb / us / 1e6, kernels=[(name[:90], n, k_us) for name, n, k_us in kernels],
              layers=cfg.num_hidden_layers,
              hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
              kv_heads=cfg.num_key_value_heads, block=cfg.block_size, **ceil)


def bench_draft(name, ceil, t0):
  """Rows of one draft: per ctx, draft_ctx, then draft_block per ctx impl (+ the cuDNN probe)."""
  cfg, params, embed, head = draft_setup(FLAGS.small, name)
  on_gpu = jax.devices()[0].platform == "gpu"
  rows, b = [], FLAGS.batch
  for ctx in map(int, FLAGS.ctx):
    for variant in FLAGS.ctx_kv:
      try:
        us, timer, kernels, ops = bench_ctx(cfg, params, b, ctx, FLAGS.reps, FLAGS.loop_steps,
                                            variant)
      except Exception as e:  # pylint: disable=broad-except
        rows.append(dict(phase="draft_ctx", ctx=ctx, ctx_kv=variant,
                         error=f"{type(e).__name__}: {str(e)[:400]}"))
        continue
      rows.append(row("draft_ctx", ctx, us, timer, kernels,
                      ctx_cost(cfg, params, b, cfg.block_size), ceil, cfg, b)
                  | dict(ctx_kv=variant, kernel_ops=ops))
    first = None  # the first impl's logits: the others' rel L2 is against them
    ref = f32_reference(cfg, params, embed, head, b, ctx) if FLAGS.f32_ref else None
    for impl in FLAGS.ctx_impls:
      if parse_ctx_impl(impl)[0] != "xla" and not on_gpu:
        continue
      try:
        us, timer, kernels, rewrites, logits, ops = bench_block(cfg, params, embed, head, b, ctx,
                                                                FLAGS.reps, impl)
      except Exception as e:  # pylint: disable=broad-except
        rows.append(dict(phase="draft_block", ctx=ctx, ctx_impl=impl, error=f"{type(e).__name__}: "
                         f"{str(e)[:400]}"))
        continue
      first = logits if first is None else first
      rows.append(row("draft_block", ctx, us, timer, kernels,
                      block_cost(cfg, params, head, b, ctx), ceil, cfg, b)
                  | dict(cache_sized_outputs=rewrites, ctx_impl=impl, kernel_ops=ops,
                         logits_rel_l2_vs_first=rel_l2(logits, first))
                  | ({} if ref is None else dict(logits_rel_l2_vs_f32=rel_l2(logits, ref))))
      r = rows[-1]  # printed now too: a run cut off by its time box still shows it
      vs_f32 = f", vs f32: {r['logits_rel_l2_vs_f32']:.2e}" if ref is not None else ""
      print(f"{name} draft_block {impl} ctx={ctx}: {us:.1f} us = {r['x_floor']:.2f}x floor, "
            f"{sum(n for _, n, _ in kernels):.0f} launches, logits rel L2 vs "
            f"{rows_first_impl()}: {r['logits_rel_l2_vs_first']:.1e}{vs_f32} "
            f"({time.time() - t0:.0f} s)", flush=True)
    if FLAGS.probe_cudnn and on_gpu:
      rows += ctx_attention_probe(cfg, b, ctx, FLAGS.reps)
    print(f"{name} ctx={ctx} done ({time.time() - t0:.0f} s)", flush=True)
  return [r | dict(draft=name) for r in rows]


def rows_first_impl():
  """The ctx impl the others' logits are compared against."""
  return FLAGS.ctx_impls[0]


def variant_of(r):
  """The row's variant: ctx_kv for draft_ctx, ctx_impl for draft_block."""
  return r.get("ctx_kv", r.get("ctx_impl", ""))


def report(rows):
  """Kernels per phase (per call), then the phase table."""
  for r in rows:
    if r["phase"] == "ctx_attention_1layer":
      print(f"  ctx attention, 1 layer, {r['impl']}: {r.get('us', float('nan')):.1f} us, "
            f"K/V {r['kv_bytes'] / r['us'] / 1e6 if 'us' in r else float('nan'):.2f} TB/s "
            f"{r.get('error', '')} rel err {r.get('rel_err', '-')}")
    if r.get("kernels"):
      total = sum(us for _, _, us in r["kernels"])
      print(f"{r['draft']} {r['phase']} {variant_of(r)} ctx={r['ctx']}: kernels per "
            f"{'commit' if r['phase'] == 'draft_ctx' else 'call'} ({total:.1f} us in "
            f"{sum(n for _, n, _ in r['kernels']):.0f} launches; top {FLAGS.top}):")
      for name, n, us in r["kernels"][:FLAGS.top]:
        print(f"  {us:9.1f} us {n:5.1f}x  {name}  {r.get('kernel_ops', {}).get(name, '')}")
  print(f"{'draft':>16} {'phase':>11} {'variant':>17} {'ctx':>6} {'us':>9} {'floor us':>9} "
        f"{'x floor':>8} {'TB/s':>6} timer")
  for r in rows:
    if "error" in r:
      print(f"{r['draft']:>16} {r['phase']:>11} {variant_of(r):>17} {r['ctx']:>6} "
            f"error: {r['error']}")
    elif "floor_us" in r:
      print(f"{r['draft']:>16} {r['phase']:>11} {variant_of(r):>17} {r['ctx']:>6} "
            f"{r['us']:9.1f} {r['floor_us']:9.1f} {r['x_floor']:8.2f} {r['tbps']:6.2f} "
            f"{r['timer']}" + (f"  logits rel L2 vs {rows_first_impl()}: "
                               f"{r['logits_rel_l2_vs_first']:.1e}"
                               if r.get("ctx_impl") not in (None, rows_first_impl()) else ""))
  for r in (r for r in rows if "cache_sized_outputs" in r):
    print(f"{r['draft']} draft_block {r['ctx_impl']} ctx={r['ctx']}: computations writing a "
          f"cache-sized array: {len(r['cache_sized_outputs'])} {r['cache_sized_outputs'][:4]}")
  for phase in ("draft_ctx", "draft_block"):
    timed = [r for r in rows if r["phase"] == phase and "us" in r]
    for ctx in sorted({r["ctx"] for r in timed}):
      best = min((r for r in timed if r["ctx"] == ctx), key=lambda r: r["us"])
      print(f"BEST {best['draft']} {phase} ctx={ctx}: {variant_of(best)} {best['us']:.1f} us = "
            f"{best['x_floor']:.2f}x floor ({best['floor_us']:.1f} us; 1.5x = "
            f"{1.5 * best['floor_us']:.1f} us)")


def main(_):
  jax.config.update("jax_compilation_cache_dir", FLAGS.cache_dir)
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  t0 = time.time()
  ceil = roofline.measure_ceilings(small=FLAGS.small)
  dev = jax.devices()[0]
  print(f"device={dev.device_kind} jax={jax.__version__} copy={ceil['copy_tbps']:.2f} TB/s "
        f"matmul={ceil['mm_tflops']:.0f} TFLOP/s ({time.time() - t0:.0f} s)", flush=True)
  drafts = ["tiny"] if FLAGS.small else FLAGS.drafts
  path = os.path.join(FLAGS.out_dir, "bench_draft.jsonl")
  with open(path, "w") as f:
    for name in drafts:  # each draft's rows written and reported as soon as it is done
      rows = bench_draft(name, ceil, t0)
      for r in rows:
        f.write(json.dumps(r) + "\n")
      f.flush()
      report(rows)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
