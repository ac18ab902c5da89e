"""Phase profiler: each phase of the speculative step compiled alone, next to the fused step.

Phases: draft_ctx (materialise context K/V), draft_block (block forward), tree, verify (split
into attention / moe / rest), accept, commit; and `step` (the fused program). Every phase is
the step's own function (`decoding.step`), jitted once per (config, spec) with the state as an
argument (contexts are data), and donates what the fused step donates: the caches and the state,
so no phase pays a cache copy the step does not. Time = GPU kernel time (CUPTI, one trace per
program: the first trace of an executable is the one that sees its graph-launched kernels, see
`timing`) on a GPU, wall time elsewhere; each row also carries the wall time and its slowest
kernels.

Verify's parts, each compiled alone: `attention` (the tree-verify kernel of every layer on random
queries: its cost does not depend on the values), `moe` (every MoE layer on the inputs the step's
own verify gives it, captured from a forward of the same state and tree: the same routing, so the
same experts touched, as the step), `rest` = verify - attention - moe. Both parts are compiled
without command buffers: their layers do not depend on each other, so a CONCURRENT graph
(runtime's default) runs them side by side, which the step never does, and CUPTI then sums
overlapping kernels (H100, s17: attention + moe 4.42 ms of a 3.42 ms ar verify).
`step_nograph`: the fused step compiled without command buffers (every kernel launched by the
host, so CUPTI sees all of them): its kernel time is the device time a loop step needs, whatever
graphs do to tracing; compiled only when the process runs with command buffers (`runtime`: on by
default; without them `step` is that program). The verify row lists its kernels by jax op (`format_listing`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from kdtree_jax import profiling_hlo, roofline, runtime, timing
from kdtree_jax.decoding import loop, step
from kdtree_jax.decoding.state import DecodeState
from kdtree_jax.pair import Pair
from kdtree_jax.target.moe import moe
from kdtree_jax.bench_state import at_context, bench_state, clone  # noqa: F401 (re-exported)
from kdtree_jax.phase_costs import INT4_BYTES, independent_routing, phase_costs  # noqa: F401
from kdtree_jax.throughput import time_contexts, while_steps_fn  # noqa: F401


# ---- the phases as separately compiled programs (jitted once per config) -------------------
_STATIC = ("tcfg", "dcfg", "spec")


def _rest(state: DecodeState) -> DecodeState:
  """The state without its caches (those travel as separate, donated arguments)."""
  return state.replace(cache=None, draft_cache=None)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("dc",))
def _draft_ctx(dparams, dc, rest, *, tcfg, dcfg, spec):
  del tcfg, spec
  return step.draft_context_phase(dcfg, dparams, rest.replace(draft_cache=dc))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _draft_block(dparams, tparams, rest, lengths, dc, *, tcfg, dcfg, spec):
  del tcfg
  st = rest.replace(cache=loop.LatentCache(latent=(), lengths=lengths))
  return step.draft_block_phase(dcfg, dparams, tparams, spec, st, dc)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _tree(draft_logits, *, tcfg, dcfg, spec):
  del tcfg, dcfg
  return step.tree_phase(spec, draft_logits, draft_logits.shape[0])


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("cache",))
def _verify(tparams, cache, rest, tree, *, tcfg, dcfg, spec):
  taps = () if spec.mode == "ar" else tuple(dcfg.target_layer_ids)
  return step.verify_phase(tcfg, tparams, spec, rest.replace(cache=cache), tree, taps)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _accept(tree, logits, key, room, *, tcfg, dcfg, spec):
  del tcfg, dcfg
  return step.accept_phase(spec, tree, logits, key, room)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("rest", "cache", "dc"))
def _commit(rest, cache, dc, tree, taps, path, a, nxt, *, tcfg, dcfg, spec):
  del dcfg
  return step.commit_phase(spec, tcfg.eos_token_id, rest.replace(cache=cache), cache, dc, tree,
                           taps, path, a, nxt, rest.key)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def _step(tparams, dparams, state, *, tcfg, dcfg, spec):
  return step.speculative_step(Pair(tcfg, tparams, dcfg, dparams), spec, state)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _moe_inputs(tparams, cache, rest, tree, *, tcfg, dcfg, spec):
  """(each MoE layer's input, its expert ids [T, K]) in the verify `_verify` runs on these
  arguments (nothing donated)."""
  del dcfg
  xs, routes = [], []
  step.verify_phase(tcfg, tparams, spec, rest.replace(cache=cache), tree, (), routes=routes,
                    moe_inputs=xs)
  return xs, routes


def counted_routing(tcfg, routes):
  """(local experts touched, local (token, expert) pairs) per MoE layer, mean over layers, of
  the router's expert ids [T, K] per layer."""
  local = tcfg.num_local_experts or tcfg.n_routed_experts
  ids = [np.asarray(i) for i in jax.device_get(routes)]
  return (float(np.mean([len(np.unique(i[i < local])) for i in ids])),
          float(np.mean([(i < local).sum() for i in ids])))


def _split(state):
  return _rest(state), state.cache, state.draft_cache


_PHASES = dict(draft_ctx=_draft_ctx, draft_block=_draft_block, tree=_tree, verify=_verify,
               accept=_accept, commit=_commit, step=_step)


def phase_programs(pair: Pair, spec, state, program=None):
  """{name: (fn, args, feed)}: every phase on the inputs it sees inside the fused step, where
  `feed(args, out)` gives the next call's args (a donating phase gets its own output back).
  `state` is consumed (donated): pass a clone. program(name, jitted) -> the callable used for
  phase `name` (default: the jitted phase with this config; e.g. a program compiled ahead)."""
  tcfg, tparams, dcfg, dparams = pair.tcfg, pair.tparams, pair.dcfg, pair.dparams
  kw = dict(tcfg=tcfg, dcfg=dcfg, spec=spec)
  program = program or (lambda name, f: functools.partial(f, **kw))
  run = {name: program(name, f) for name, f in _PHASES.items()}
  progs = {}
  rest, cache, dc = _split(clone(state))
  draft_logits = None
  if spec.mode != "ar":
    progs["draft_ctx"] = (run["draft_ctx"], (dparams, clone(dc), rest),
                          lambda a, out: (a[0], out, a[2]))
    dc = run["draft_ctx"](dparams, dc, rest)
    blk_args = (dparams, tparams, rest, clone(cache.lengths), dc)  # cache: donated below
    progs["draft_block"] = (run["draft_block"], blk_args, timing.same_args)
    draft_logits = run["draft_block"](*blk_args)
    progs["tree"] = (run["tree"], (draft_logits,), timing.same_args)
  tree = (run["tree"](draft_logits) if spec.mode != "ar"
          else step.tree_phase(spec, None, state.bonus.shape[0]))
  progs["verify"] = (run["verify"], (tparams, clone(cache), rest, tree),
                     lambda a, out: (a[0], out[1], a[2], a[3]))
  logits, cache, taps = run["verify"](tparams, cache, rest, tree)
  room = jnp.full(state.bonus.shape, spec.depth, jnp.int32)
  acc_args = (tree, logits, rest.key, room)
  progs["accept"] = (run["accept"], acc_args, timing.same_args)
  path, a, nxt = run["accept"](*acc_args)
  progs["commit"] = (run["commit"], (clone(rest), cache, clone(dc), tree, taps, path, a, nxt),
                     lambda args, out: (*_split(out), *args[3:]))
  progs["step"] = (run["step"], (tparams, dparams, state),
                   lambda args, out: (args[0], args[1], out))
  return progs


def _structs(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def phase_structs(pair: Pair, spec, state) -> dict:
  """{phase name: ShapeDtypeStructs of its args} (one trace of `phase_programs` under
  eval_shape; nothing runs)."""
  kw = dict(tcfg=pair.tcfg, dcfg=pair.dcfg, spec=spec)
  seen = {}

  def program(name, f):
    def call(*args):
      seen.setdefault(name, _structs(args))
      return functools.partial(f, **kw)(*args)
    return call

  def trace(st, pr):
    for name, (_, args, _) in phase_programs(pr, spec, st, program).items():
      seen.setdefault(name, _structs(args))

  jax.eval_shape(trace, _structs(state), pair)
  return seen


def compile_phase_programs(pair: Pair, spec, state, extra=None, nograph=(), seen=None,
                           extra_options=None) -> dict:
  """{name: Compiled} of every phase program, from their abstract inputs (`phase_structs`, or
  `seen`), of `extra` ({name: (partial of a jitted fn, args, feed)}; compiler_options
  `extra_options`), and of the phases in
  `nograph` again without command buffers (as '<name>_nograph'), lowered one by one and
  compiled all at once (one thread each: XLA compiles release the GIL). Programs that fail to
  compile are left out (their first call compiles them)."""
  kw = dict(tcfg=pair.tcfg, dcfg=pair.dcfg, spec=spec)
  seen = seen or phase_structs(pair, spec, state)
  lowered = {name: (_PHASES[name].lower(*args, **kw), None) for name, args in seen.items()}
  for name, (fn, args, _) in (extra or {}).items():
    lowered[name] = (fn.func.lower(*args, **fn.keywords), extra_options)
  for name in nograph:
    lowered[f"{name}_nograph"] = (lowered[name][0], timing.NO_COMMAND_BUFFERS)
  outs = timing.Deadline(float("inf")).box_all(
      [lambda lo=lo, opt=opt: lo.compile(compiler_options=opt) for lo, opt in lowered.values()])
  return {name: exe for name, (exe, _, status) in zip(lowered, outs) if status == "ok"}


@functools.partial(jax.jit, static_argnames=("tcfg", "backend"))
def _attention_part(q, latent, lengths, mask, *, tcfg, backend):
  return [pallas_kernels.tree_verify_attention(q, lc, lengths, mask, scale=tcfg.softmax_scale,
                                               backend=backend, value_dim=tcfg.kv_lora_rank)
          for lc in latent]


@functools.partial(jax.jit, static_argnames=("tcfg",))
def _moe_part(moe_params, xs, *, tcfg):
  return [moe(p, tcfg, x) for p, x in zip(moe_params, xs)]


def _verify_parts(tcfg, tparams, spec, state, moe_xs):
  """Verify's attention alone (all layers, random queries) and MoE alone (all MoE layers, layer
  i on moe_xs[i]: the step's own MoE inputs, or their ShapeDtypeStructs to compile)."""
  b, n, c = state.bonus.shape[0], spec.verify_width, tcfg
  dtype = state.cache.dtype
  q = jax.random.normal(jax.random.key(1), (b, n, c.num_attention_heads, c.cache_dim), dtype)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
  attn = functools.partial(_attention_part, tcfg=tcfg, backend=spec.attn_backend)
  parts = {"attention": (attn, (q, state.cache.latent, state.cache.lengths, mask),
                         timing.same_args)}
  moe_layers = [lp["moe"] for lp in tparams["layers"] if "moe" in lp]
  if moe_layers:
    parts["moe"] = (functools.partial(_moe_part, tcfg=tcfg), (moe_layers, moe_xs),
                    timing.same_args)
  return parts


@dataclasses.dataclass
class PhaseRow:
  """One phase: `ms` (CUPTI kernel time on a GPU, else wall), its wall time, bytes, FLOPs and
  roofline floor."""

  phase: str
  ms: float
  bytes: float
  flops: float
  floor_ms: float
  wall_ms: float = 0.0
  timer: str = "wall"
  kernels: list = dataclasses.field(default_factory=list)  # [(name, calls, us)] per call, top
  note: str = ""
  launches: float = 0.0  # kernel launches per call (CUPTI)
  listing: list = dataclasses.field(default_factory=list)  # verify: profiling_hlo.kernel_listing

  @property
  def pct_roofline(self) -> float:
    return 100 * self.floor_ms / self.ms if self.ms else 0.0


def expert_bytes_per_weight(tparams, default: float) -> float:
  """INT4_BYTES when the routed experts are INT4 stacks, else `default`."""
  from kdtree_jax.checkpoint.int4 import Int4Weight  # pylint: disable=import-outside-toplevel
  leaves = jax.tree.leaves(tparams, is_leaf=lambda x: isinstance(x, Int4Weight))
  return INT4_BYTES if any(isinstance(x, Int4Weight) for x in leaves) else default


TOP_KERNELS = 15
# Calls per CUPTI trace. jax 0.11.2's Mosaic CUPTI hook aborts the process ("activity records were
# dropped", a C++ exception no Python code can catch) when one trace overflows its buffers: 20
# calls of the 61-layer step without command buffers did (H200, 2026-12-01). Kernel times of
# ms-long programs need few calls.
CUPTI_CALLS = 3


def time_program(fn, args, feed, reps):
  """(ms, wall ms, timer name, top kernel families, launches per call, kernels by name): CUPTI
  kernel time per call (one trace of min(reps, CUPTI_CALLS) calls, after the wall times), its
  kernels grouped by family and by name (each [(name, launches, us)] per call, slowest first)
  on a GPU; wall time, [], 0 and [] elsewhere."""
  wall, args = timing.wall_ms(fn, args, feed, reps=reps)
  if not timing.cupti_available():
    return wall, wall, "wall", [], 0.0, []
  try:  # the records themselves: grouped by family and by name from the ONE trace
    records, _ = timing._cupti_kernels(fn, args, feed, min(reps, CUPTI_CALLS))  # pylint: disable=protected-access
  except RuntimeError as e:  # CUPTI refused (e.g. another subscriber): the wall time, labelled
    print(f"CUPTI failed ({e}); wall time instead", flush=True)
    return wall, wall, "wall (CUPTI failed)", [], 0.0, []
  calls = min(reps, CUPTI_CALLS)
  top = timing.breakdown([(timing.family(n), ms) for n, ms in records], calls)
  return (sum(ms for _, ms in records) / calls, wall, "cupti", top, sum(n for _, n, _ in top),
          timing.breakdown(records, calls))


def profile_step(pair: Pair, spec, state, ceil, reps=20, parts=True,
                 nograph_step=None) -> list[PhaseRow]:
  """Times every phase alone and the fused step (consumes `state`); rows with roofline floors.
  parts: also verify's attention (all layers) and MoE (all MoE layers) alone, and the rest.
  nograph_step (parts only): also the step compiled without command buffers (`step_nograph`);
  None = when this process compiles with them (without them `step` is that program already).
  The verify row carries `listing`: its kernels by jax op (profiling_hlo.kernel_listing, from
  the compiled verify program's HLO and the same CUPTI trace)."""
  tcfg, tparams, dcfg = pair.tcfg, pair.tparams, pair.dcfg
  batch, ctx = state.bonus.shape[0], int(state.cache.lengths[0])
  wb = state.cache.dtype.itemsize
  kw = dict(tcfg=tcfg, dcfg=dcfg, spec=spec)
  seen = phase_structs(pair, spec, state)
  extra, routing = {}, None
  if parts:
    xs, _ = jax.eval_shape(functools.partial(_moe_inputs, **kw), *seen["verify"])
    extra = _verify_parts(tcfg, tparams, spec, state, xs)
    extra["moe_inputs"] = (functools.partial(_moe_inputs, **kw), seen["verify"], None)
  graphs = runtime.command_buffers_on()
  if nograph_step is None:
    nograph_step = graphs
  compiled = compile_phase_programs(pair, spec, state, extra,
                                    ("step",) if parts and nograph_step else (), seen,
                                    timing.NO_COMMAND_BUFFERS if graphs else None)
  jitted = lambda name, f: compiled[name] if name in compiled else functools.partial(f, **kw)
  nograph = clone(state) if "step_nograph" in compiled else None
  phases = phase_programs(pair, spec, state, jitted)
  progs = {}  # the parts first: attention reads `state`'s cache, which the step donates
  if parts:
    xs, routes = jitted("moe_inputs", _moe_inputs)(*phases["verify"][1])
    routing = counted_routing(tcfg, routes) if routes else None
    progs.update(_parts_on_step_inputs(extra, xs, compiled))
  progs.update(phases)
  costs = phase_costs(tcfg, dcfg, spec, batch, ctx, wb, expert_bytes_per_weight(tparams, wb),
                      routing)
  if nograph is not None:
    progs["step_nograph"] = (compiled["step_nograph"], (tparams, pair.dparams, nograph),
                             progs["step"][2])
  rows = []
  for name, (fn, args, feed) in progs.items():
    ms, wall, timer, top, launches, by_name = time_program(fn, args, feed, reps)
    nb, fl = costs.get(name.removesuffix("_nograph"), (0, 0))
    rows.append(PhaseRow(name, ms, nb, fl, 1e3 * roofline.floor_s(nb, fl, ceil), wall, timer,
                         top, launches=launches,
                         listing=_listing(compiled.get(name), by_name) if name == "verify"
                         else []))
  if parts:
    rows.append(_rest_row(rows, costs, ceil))
    _note_structure(rows, compiled.get("verify"), tcfg.num_hidden_layers)
    if routing:
      model = independent_routing(tcfg, batch * spec.verify_width)
      next(r for r in rows if r.phase == "moe").note = (
          f"moe (and verify, step floors) on the step's own routing: {routing[0]:.1f} local "
          f"experts touched, {routing[1]:.1f} local pairs per layer (independent-routing model: "
          f"{model[0]:.1f}, {model[1]:.1f})")
  return sorted(rows, key=lambda r: ORDER.index(r.phase))


LISTING_TOP = 40


def _hlo_text(exe):
  try:
    return exe.as_text() if exe is not None else None
  except Exception:  # pylint: disable=broad-except  (a backend without HLO text)
    return None


def _listing(exe, by_name):
  """profiling_hlo.kernel_listing of a compiled program's kernels by name ([] without CUPTI
  records or HLO text)."""
  text = _hlo_text(exe) if by_name else None
  return profiling_hlo.kernel_listing(text, by_name, LISTING_TOP) if text else []


def format_listing(rows: list[PhaseRow], phase: str) -> str:
  """The phase's kernels by jax op (its `listing`), then the same kernels by group
  (profiling_hlo.kernel_group: experts, dense dots, split-K sums, attention, draft, glue), or ''."""
  row = next((r for r in rows if r.phase == phase and r.listing), None)
  if row is None:
    return ""
  by_op = profiling_hlo.format_listing(
      row.listing, f"kernels of {phase} by op ({row.ms:.3f} ms, top {LISTING_TOP})")
  return by_op + "\n" + profiling_hlo.format_groups(
      row.listing, f"kernels of {phase} by group (the top {LISTING_TOP} above)")


def _note_structure(rows, verify_exe, layers):
  """The verify row's note: its launch structure (kernels, matmuls, matmuls sharing an input)
  from the compiled program's HLO, or nothing when the program or its text is missing."""
  text = _hlo_text(verify_exe)
  if text:
    structure = profiling_hlo.launch_structure(text)
    next(r for r in rows if r.phase == "verify").note = profiling_hlo.format_structure(
        structure, layers, "verify program (optimised HLO)")


ORDER = ("draft_ctx", "draft_block", "tree", "verify", "attention", "moe", "rest", "accept",
         "commit", "step", "step_nograph")


def _parts_on_step_inputs(extra, moe_xs, compiled):
  """Verify's parts ready to time: compiled where they compiled, the MoE part on `moe_xs` (the
  inputs the step's verify gives each MoE layer)."""
  out = {}
  for name, (fn, args, feed) in extra.items():
    if name == "moe_inputs":
      continue
    if name == "moe":
      args = (args[0], moe_xs)
    out[name] = (compiled.get(name, fn), args, feed)
  return out


def _rest_row(rows, costs, ceil) -> PhaseRow:
  """Verify minus its attention and MoE parts (times of separately compiled programs)."""
  by = {r.phase: r for r in rows}
  parts = [by[p] for p in ("attention", "moe") if p in by]
  nb, fl = costs["rest"]
  return PhaseRow("rest", by["verify"].ms - sum(p.ms for p in parts), nb, fl,
                  1e3 * roofline.floor_s(nb, fl, ceil),
                  by["verify"].wall_ms - sum(p.wall_ms for p in parts), by["verify"].timer,
                  rest_kernels(by["verify"].kernels, [p.kernels for p in parts]))


def rest_kernels(verify, parts):
  """[(family, calls, us)] per call of verify's kernel families minus the same families in the
  parts' programs, slowest first (positive us only). Mosaic / Pallas kernels keep their names
  across programs; XLA names fusions by their contents, so a part's glue fusion may keep a
  different family name in verify and stay in this list."""
  left = {name: [n, us] for name, n, us in verify}
  for part in parts:
    for name, n, us in part:
      if name in left:
        left[name][0] -= n
        left[name][1] -= us
  rows = [(name, n, us) for name, (n, us) in left.items() if us > 0]
  return sorted(rows, key=lambda r: -r[2])


def format_table(rows: list[PhaseRow]) -> str:
  step_ms = next(r.ms for r in rows if r.phase == "step")
  top = ("draft_ctx", "draft_block", "tree", "verify", "accept", "commit")
  total = sum(r.ms for r in rows if r.phase in top)
  lines = [f"{'phase':<14}{rows[0].timer + ' ms':>10}{'wall ms':>9}{'% step':>8}{'MB':>10}"
           f"{'GFLOP':>10}{'floor ms':>10}{'% floor':>8}"]
  for r in rows:
    indent = "  " if r.phase in ("attention", "moe", "rest", "step_nograph") else ""
    lines.append(f"{indent + r.phase:<14}{r.ms:10.3f}{r.wall_ms:9.3f}"
                 f"{100 * r.ms / step_ms:8.1f}{r.bytes / 1e6:10.1f}{r.flops / 1e9:10.2f}"
                 f"{r.floor_ms:10.3f}{r.pct_roofline:8.1f}")
  lines.append(f"sum of phases {total:.3f} ms vs fused step {step_ms:.3f} ms "
               f"({100 * (total - step_ms) / step_ms:+.1f}%)")
  lines += [r.note for r in rows if r.note]
  return "\n".join(lines)


def format_kernels(rows: list[PhaseRow], phase: str) -> str:
  """The slowest kernels of one phase's program (CUPTI, per call), or '' without them."""
  row = next((r for r in rows if r.phase == phase and r.kernels), None)
  if row is None:
    return ""
  what = (f"{row.ms:.3f} ms of kernels, {row.launches:.0f} launches per call" if phase != "rest"
          else "verify's kernel families minus the attention and moe programs' same families")
  lines = [f"slowest kernel families of {phase} ({what}): us/call launches/call family"]
  lines += [f"  {us:9.1f} {n:6.1f}  {name[:100]}" for name, n, us in row.kernels[:TOP_KERNELS]]
  return "\n".join(lines)


def trace_loop(pair: Pair, spec, state, logdir, n_steps=8):
  """A jax.profiler trace of the fused loop (named scopes per phase) for Perfetto/TensorBoard."""
  fn = while_steps_fn(spec)
  st = state.replace(steps=jnp.zeros((), jnp.int32))
  jax.block_until_ready(fn(pair, st, jnp.int32(n_steps)))
  with jax.profiler.trace(logdir):
    jax.block_until_ready(fn(pair, st, jnp.int32(n_steps)))
  return logdir


def as_dicts(rows):
  return [dict(dataclasses.asdict(r), pct_roofline=r.pct_roofline) for r in rows]
