"""Generation: prefill, then speculative steps in a `lax.while_loop` on the device.

`generate` validates inputs on the host, runs prefill and the whole loop as one jitted program
(one dispatch; no host round trip between steps), and returns tokens and acceptance statistics.
"""

import contextlib
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import sharding
from kdtree_jax.api import check_tokens
from kdtree_jax.target.cache import LatentCache
from kdtree_jax.cli import UsageError
from kdtree_jax.decoding import memory_bound, sampling
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.decoding.state import DecodeState
from kdtree_jax.decoding.step import speculative_step
from kdtree_jax.draft import model as draft_model
from kdtree_jax.pair import Pair
from kdtree_jax.target import transformer


def out_size(spec: SpecConfig) -> int:
  """Output buffer: max_new + W slots for emitted tokens, + W write-off slots for finished rows."""
  return spec.max_new_tokens + 2 * spec.commit_width


def physical_rows(max_len: int, spec: SpecConfig) -> int:
  """Cache rows: max_len committed + N tree scratch, rounded up to 64 (whole kernel tiles)."""
  return -(-(max_len + spec.verify_width) // 64) * 64


def init_state(pair: Pair, spec: SpecConfig, prompts_bs, lengths_b, key, max_len: int,
               cache_dtype=jnp.float32) -> DecodeState:
  """Prefills the target (and the draft context) and picks the first token."""
  tcfg, tparams, dcfg, dparams = pair.tcfg, pair.tparams, pair.dcfg, pair.dparams
  b, s = prompts_bs.shape
  tap_layers = () if spec.mode == "ar" else tuple(dcfg.target_layer_ids)
  cache = LatentCache.zeros(tcfg, b, physical_rows(max_len, spec), cache_dtype)
  logits, cache, taps = transformer.prefill(tcfg, tparams, cache, prompts_bs, tap_layers)
  cache = cache.replace(lengths=lengths_b)
  key, sub = jax.random.split(key)
  last = jnp.take_along_axis(logits, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
  bonus = sampling.choose(last, sub, spec.sampling)
  draft_cache, pending = None, None
  if spec.mode != "ar":
    draft_cache = draft_model.init_draft_cache(dcfg, b, max_len + spec.commit_width,
                                               dtype=cache_dtype)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    draft_cache = draft_model.materialize_context(dparams, dcfg, draft_cache, taps, positions,
                                                  lengths_b)
    pending = jnp.zeros((b, spec.commit_width, taps.shape[-1]), taps.dtype)
  out = jnp.zeros((b, out_size(spec)), jnp.int32).at[:, 0].set(bonus)
  done = (lengths_b >= max_len) | (spec.max_new_tokens <= 1)
  if tcfg.eos_token_id is not None:
    done = done | (bonus == tcfg.eos_token_id)
  return sharding.constrain_state(DecodeState(
      cache=cache, draft_cache=draft_cache, bonus=bonus, pending_taps=pending,
      pending_count=jnp.zeros((b,), jnp.int32), out=out, n_out=jnp.ones((b,), jnp.int32),
      done=done, key=key, steps=jnp.zeros((), jnp.int32),
      accepted=jnp.zeros((spec.max_new_tokens, b), jnp.int32),
      capacity=jnp.asarray(max_len, jnp.int32),
      widths=jnp.zeros((spec.max_new_tokens,), jnp.int32) if spec.budget == "auto" else None))


def run_loop(pair: Pair, spec: SpecConfig, state: DecodeState, until=None) -> DecodeState:
  """Steps until every row is done, max_new_tokens steps, or `until` steps (data, so one
  compiled program serves every chunk length): a device-side while loop."""
  last = spec.max_new_tokens if until is None else jnp.minimum(until, spec.max_new_tokens)

  def cond(st):
    return jnp.any(~st.done) & (st.steps < last)

  def body(st):
    return sharding.constrain_state(speculative_step(pair, spec, st))

  return jax.lax.while_loop(cond, body, state)


# The pair's configs are static through its pytree structure; spec and shapes are static args.
_STATICS = ("spec", "max_len", "cache_dtype")


@functools.partial(jax.jit, static_argnames=_STATICS)
def generate_device(pair: Pair, prompts_bs, lengths_b, key, *, spec, max_len,
                    cache_dtype=jnp.float32):
  """Prefill + the whole decode loop as one XLA program."""
  state = init_state(pair, spec, prompts_bs, lengths_b, key, max_len, cache_dtype)
  return sharding.constrain_state(run_loop(pair, spec, state))


@functools.partial(jax.jit, static_argnames=_STATICS)
def prefill_device(pair: Pair, prompts_bs, lengths_b, key, *, spec, max_len,
                   cache_dtype=jnp.float32):
  """Prefill only (streaming: the loop then runs in chunks of steps)."""
  return init_state(pair, spec, prompts_bs, lengths_b, key, max_len, cache_dtype)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def steps_device(pair: Pair, state, until, *, spec):
  """The device loop up to step `until`: one dispatch per chunk, the state donated."""
  return sharding.constrain_state(run_loop(pair, spec, state, until))


STOP_REASONS = ("eos", "max_new_tokens", "max_len")


@dataclasses.dataclass
class GenerationResult:
  """Host-side result: per-row generated ids, tokens emitted per step (capped at what was
  emitted), why each row stopped, and timing: `seconds` runs the compiled program (prefill
  included) until the outputs are on the host; `compile_seconds` is tracing + compiling;
  `warmup_seconds` an untimed first run (its one-time costs kept out of `seconds`), if any."""

  tokens: list[list[int]]
  accepted_per_step: list[list[int]]
  steps: int
  seconds: float
  compile_seconds: float = 0.0
  warmup_seconds: float = 0.0
  stop_reasons: list[str] = dataclasses.field(default_factory=list)
  widths_per_step: list[int] = dataclasses.field(default_factory=list)  # budget='auto' only

  @property
  def mean_accept_len(self) -> float:
    acc = [a for row in self.accepted_per_step for a in row]
    return float(np.mean(acc)) if acc else 0.0

  @property
  def tokens_per_s(self) -> float:
    return sum(len(t) for t in self.tokens) / self.seconds if self.seconds else 0.0


def validate(tcfg, dcfg, spec: SpecConfig, prompts: list[list[int]], max_len: int):
  """Host-side checks with messages that say what to change."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise UsageError("prompt", "empty prompt: every row needs at least one token")
  longest = max(len(p) for p in prompts)
  if longest >= max_len:
    raise UsageError("max_len", f"a prompt of {longest} tokens reaches or exceeds max_len "
                     f"{max_len} (no room for a new token); raise --config.max_len above "
                     f"{longest} or shorten --config.prompt")
  for p in prompts:
    check_tokens(np.asarray(p), tcfg.vocab_size)
  if spec.mode != "ar":
    if dcfg is None:
      raise ValueError(f"mode {spec.mode!r} needs a draft model")
    check_draft_fits_target(dcfg, tcfg)
    if spec.block_size != dcfg.block_size:
      raise ValueError(f"{spec.block_size=} differs from the draft's block_size {dcfg.block_size}")
    if spec.mode == "ddtree":
      max_nodes = sum(min(spec.max_budget, tcfg.vocab_size) ** d for d in range(1, spec.depth + 1))
      if spec.max_budget > max_nodes:
        raise ValueError(f"{spec.budget=} exceeds the {max_nodes} prefixes a depth-{spec.depth} "
                         "tree can hold")


def length_warnings(tcfg, spec: SpecConfig, prompts: list[list[int]], max_len: int,
                    trained_positions: int = 0) -> list[str]:
  """What a run will not do as asked: stop at max_len early, or go past the trained positions."""
  longest = max(len(p) for p in prompts)
  out = []
  if longest + spec.max_new_tokens > max_len + 1:  # the last new token needs no cache row
    out.append(f"prompt ({longest} tokens) + --config.max_new_tokens {spec.max_new_tokens} "
               f"exceeds --config.max_len {max_len}: at most {max_len - longest + 1} tokens "
               "will be generated (stop_reason max_len)")
  trained, source = ((trained_positions, "--config.trained_positions") if trained_positions
                     else (tcfg.max_position_embeddings, "max_position_embeddings"))
  reach = min(longest + spec.max_new_tokens - 1, max_len)  # positions fed to the target
  if reach > trained:
    out.append(f"positions up to {reach} go past the {trained} the target was trained on "
               f"({source}); expect poor text and acceptance beyond position {trained}")
  return out


def check_draft_fits_target(dcfg, tcfg):
  """The draft shares the target's embedding/lm_head and reads its hidden states at taps."""
  if dcfg.hidden_size != tcfg.hidden_size:
    raise ValueError(f"draft hidden_size {dcfg.hidden_size} != target hidden_size "
                     f"{tcfg.hidden_size}: DFlash shares the target's embedding and lm_head")
  bad = [i for i in dcfg.target_layer_ids if not 0 <= i < tcfg.num_hidden_layers]
  if bad:
    raise ValueError(f"draft target_layer_ids {bad} do not exist in a "
                     f"{tcfg.num_hidden_layers}-layer target")
  if dcfg.mask_token_id is None or not 0 <= dcfg.mask_token_id < tcfg.vocab_size:
    raise ValueError(f"draft mask_token_id {dcfg.mask_token_id} is not a target token id "
                     f"(vocab {tcfg.vocab_size})")


def prompt_bucket(length: int, max_len: int) -> int:
  """Padded prompt width: the next power of two >= 64 (at most max_len), so a new prompt length
  reuses the compiled prefill + loop of its bucket instead of compiling another."""
  return min(max_len, max(64, 1 << (length - 1).bit_length()))


def _prepare(pair: Pair, spec, prompts, max_len, mesh):
  """Validates, right-pads the prompts, and places params on the mesh (if any)."""
  tparams, dparams = pair.tparams, pair.dparams
  validate(pair.tcfg, pair.dcfg, spec, prompts, max_len)
  b, s = len(prompts), prompt_bucket(max(len(p) for p in prompts), max_len)
  padded = np.zeros((b, s), np.int32)
  for i, p in enumerate(prompts):
    padded[i, :len(p)] = p
  lengths = np.array([len(p) for p in prompts], np.int32)
  if mesh is not None:
    tparams = sharding.shard(tparams, sharding.param_shardings(tparams, mesh))
    if dparams is not None:
      dparams = sharding.shard(dparams, sharding.param_shardings(dparams, mesh))
  placed = pair.replace(tparams=tparams, dparams=dparams)
  return jnp.asarray(padded), jnp.asarray(lengths), placed


def stop_reason(tokens: list[int], eos_id, max_new_tokens: int, length: int,
                max_len: int) -> str:
  """Why a finished row stopped: eos, max_new_tokens or max_len (cache full)."""
  if eos_id is not None and tokens and tokens[-1] == eos_id:
    return "eos"
  if len(tokens) >= max_new_tokens:
    return "max_new_tokens"
  if length >= max_len:
    return "max_len"
  return "unfinished"


def capped_accepts(accepted: list[int], emitted: int) -> list[int]:
  """Tokens per step, capped so they sum to the tokens emitted after the prefill's first one
  (the device counts a whole accepted path even past max_new_tokens or an eos)."""
  left, out = emitted - 1, []
  for a in accepted:
    take = min(a, left)
    if take > 0:
      out.append(take)
    left -= take
  return out


def _result(spec, state, t0, max_len, eos_id, compile_s=0.0, warmup_s=0.0) -> GenerationResult:
  """Fetches the outputs; `seconds` runs from t0 until they are on the host (device work done)."""
  out, n_out, acc, steps, lengths = sharding.to_host(
      (state.out, state.n_out, state.accepted, state.steps, state.cache.lengths))
  seconds = time.perf_counter() - t0
  tokens = [list(map(int, out[i, :min(n_out[i], spec.max_new_tokens)])) for i in range(len(out))]
  accepted = [capped_accepts([int(a) for a in acc[:steps, i] if a > 0], len(tokens[i]))
              for i in range(len(out))]
  reasons = [stop_reason(t, eos_id, spec.max_new_tokens, int(n), max_len)
             for t, n in zip(tokens, lengths)]
  widths = [] if state.widths is None else sharding.to_host(state.widths)[:steps].tolist()
  return GenerationResult(tokens=tokens, accepted_per_step=accepted, steps=int(steps),
                          seconds=seconds, compile_seconds=compile_s, warmup_seconds=warmup_s,
                          stop_reasons=reasons,
                          widths_per_step=widths)


def _no_progress(label):
  del label
  return contextlib.nullcontext()


def _size_field(spec) -> str:
  """The flag a user lowers when the run does not fit."""
  return "budget" if spec.mode == "ddtree" else "max_len"


def compile_checked(jitted, args, statics, mesh, limit_gb=0.0, field="max_len",
                    progress=_no_progress, label="compiling") -> float:
  """Traces, checks the memory bound (before compiling), compiles; returns the seconds. Later
  calls of `jitted` with these arguments reuse the compiled program (one compile)."""
  t0 = time.perf_counter()
  traced = jitted.trace(*args, **statics)
  memory_bound.check_fits(traced, 1 if mesh is None else mesh.size, limit_gb, field)
  with progress(label):
    traced.lower().compile()
  return time.perf_counter() - t0


def generate(pair: Pair, spec: SpecConfig, prompts: list[list[int]], max_len: int,
             seed: int = 0, cache_dtype=jnp.float32, mesh=None, memory_limit_gb: float = 0.0,
             progress=_no_progress, warmup: bool = False) -> GenerationResult:
  """Decodes a batch of (ragged) prompts in one dispatch. Tokens are exactly the target's.

  mesh: run sharded over it (params are placed by the rules unless already; caches and the
  decode state are created sharded inside the program). Before compiling, the program's memory
  bound is checked against memory_limit_gb (0: what the device has); progress(label) is a
  context manager around the compile (e.g. `cli.progress`). warmup: run once untimed first (a
  new program's first run pays one-time costs: 0.21 s vs 0.07 s for 32 k2tiny tokens, CPU).
  """
  prompts_bs, lengths_b, pair = _prepare(pair, spec, prompts, max_len, mesh)
  statics = dict(spec=spec, max_len=max_len, cache_dtype=cache_dtype)
  args = (pair, prompts_bs, lengths_b, jax.random.key(seed))
  with sharding.use_mesh(mesh):
    compile_s = compile_checked(generate_device, args, statics, mesh, memory_limit_gb,
                                _size_field(spec), progress, f"compiling the {spec.mode} loop")
    t0 = time.perf_counter()
    if warmup:
      jax.block_until_ready(generate_device(*args, **statics))
    t1 = time.perf_counter()
    state = generate_device(*args, **statics)
    return _result(spec, state, t1, max_len, pair.tcfg.eos_token_id, compile_s, t1 - t0)


class Stream:
  """Iterates per-row lists of new tokens every `chunk_steps` device steps; `.result` at the end.

  Each chunk is one dispatch of the same compiled loop (the step bound is data); only the
  output buffer comes back to the host between chunks. Both programs are compiled (memory
  bound checked) and run once untimed (one step) before the first chunk: `.result.seconds` is
  the decode alone, `.result.compile_seconds` the compile.
  """

  def __init__(self, pair: Pair, spec, prompts, max_len, seed=0,
               cache_dtype=jnp.float32, mesh=None, chunk_steps=8, memory_limit_gb=0.0,
               progress=_no_progress):
    if chunk_steps < 1:
      raise UsageError("stream", f"{chunk_steps} is too small; print every N >= 1 device steps")
    self._args = (spec, max_len, cache_dtype, mesh, chunk_steps, seed)
    self._limits = (memory_limit_gb, progress)
    self._data = _prepare(pair, spec, prompts, max_len, mesh)
    self.result: GenerationResult | None = None

  def _warm(self, pair, prefill_args, prefill_statics, statics):
    """Compiles prefill and steps; runs each once untimed. (compile s, warm-up s)."""
    spec, _, _, mesh, _, _ = self._args
    limit_gb, progress = self._limits
    field = _size_field(spec)
    c1 = compile_checked(prefill_device, prefill_args, prefill_statics, mesh, limit_gb, field,
                         progress, "compiling the prefill")
    warm = prefill_device(*prefill_args, **prefill_statics)
    c2 = compile_checked(steps_device, (pair, warm, jnp.int32(1)), statics, mesh,
                         limit_gb, field, progress, f"compiling the {spec.mode} loop")
    t0 = time.perf_counter()
    jax.block_until_ready(steps_device(pair, warm, jnp.int32(1), **statics))
    return c1 + c2, time.perf_counter() - t0

  def __iter__(self):
    spec, max_len, cache_dtype, mesh, chunk, seed = self._args
    prompts_bs, lengths_b, pair = self._data
    statics = dict(spec=spec)
    prefill_statics = dict(statics, max_len=max_len, cache_dtype=cache_dtype)
    prefill_args = (pair, prompts_bs, lengths_b, jax.random.key(seed))
    with sharding.use_mesh(mesh):
      compile_s, warmup_s = self._warm(pair, prefill_args, prefill_statics, statics)
      t0 = time.perf_counter()
      state = prefill_device(*prefill_args, **prefill_statics)
      sent = [0] * prompts_bs.shape[0]
      while True:
        out, n_out, done, steps = sharding.to_host((state.out, state.n_out, state.done,
                                                    state.steps))
        new = []
        for i, n in enumerate(np.minimum(n_out, spec.max_new_tokens)):
          new.append(list(map(int, out[i, sent[i]:n])))
          sent[i] = int(n)
        yield new
        if done.all() or steps >= spec.max_new_tokens:
          break
        state = steps_device(pair, state, jnp.int32(steps + chunk), **statics)
      self.result = _result(spec, state, t0, max_len, pair.tcfg.eos_token_id, compile_s,
                            warmup_s)
