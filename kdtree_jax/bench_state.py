"""Decode states for benchmarks: the state `loop.init_state` builds, at any context, without a
prefill (random cache rows; timing does not depend on the values)."""

import jax
import jax.numpy as jnp

from kdtree_jax.decoding import loop
from kdtree_jax.decoding.state import DecodeState
from kdtree_jax.draft import model as draft_model
from kdtree_jax.pair import Pair
from kdtree_jax.target.params import abstract_params


def _abstract_state(tcfg, dcfg, spec, batch, max_len, dtype) -> DecodeState:
  """ShapeDtypeStructs of the state `loop.init_state` builds for `max_len` (nothing runs)."""
  tp = abstract_params(tcfg, dtype)
  dp = None if spec.mode == "ar" else jax.eval_shape(
      lambda k: draft_model.init_draft_params(k, dcfg, tcfg.hidden_size, dcfg.n_taps, dtype),
      jax.random.key(0))
  prompts = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
  return jax.eval_shape(lambda tp_, dp_, p, n, k: loop.init_state(
      Pair(tcfg, tp_, dcfg, dp_), spec, p, n, k, max_len, dtype), tp, dp, prompts,
      jax.ShapeDtypeStruct((batch,), jnp.int32), jax.random.key(0))


def _random_like(key, buffers, dtype):
  return tuple(jax.random.normal(k, a.shape, dtype)
               for k, a in zip(jax.random.split(key, len(buffers)), buffers))


def bench_state(tcfg, dcfg, spec, batch, ctx, dtype=jnp.bfloat16, seed=0,
                steps=64) -> DecodeState:
  """The state `loop.init_state` builds, at committed context `ctx`, with random cache rows
  (no prefill: timing does not depend on the values) and room for `steps` more full commits."""
  st = _abstract_state(tcfg, dcfg, spec, batch, ctx + spec.commit_width * steps, dtype)
  k = jax.random.split(jax.random.key(seed), 4)
  zeros = lambda a: jnp.zeros(a.shape, a.dtype)
  filled = jax.tree.map(zeros, st.replace(key=None, cache=None, draft_cache=None))
  cache = st.cache.replace(latent=_random_like(k[0], st.cache.latent, dtype),
                           lengths=jnp.full((batch,), ctx, jnp.int32))
  w = spec.commit_width
  draft_cache, pending = None, None
  if spec.mode != "ar":
    dc = st.draft_cache
    draft_cache = dc.replace(
        k=_random_like(k[1], dc.k, dtype), v=_random_like(k[2], dc.v, dtype),
        pos=jnp.broadcast_to(jnp.arange(dc.pos.shape[1], dtype=jnp.int32), dc.pos.shape),
        ctx_len=jnp.full((batch,), ctx - w, jnp.int32))
    pending = jax.random.normal(k[3], st.pending_taps.shape, st.pending_taps.dtype)
  return filled.replace(
      cache=cache, draft_cache=draft_cache, key=jax.random.key(seed), pending_taps=pending,
      bonus=jnp.ones((batch,), jnp.int32), n_out=jnp.ones((batch,), jnp.int32),
      pending_count=jnp.full((batch,), w, jnp.int32),
      capacity=jnp.asarray(ctx + w * steps, jnp.int32))


clone = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def at_context(state: DecodeState, spec, ctx: int) -> DecodeState:
  """The same (max-size) bench state with committed length `ctx` (data, not shape)."""
  b = state.bonus.shape[0]
  st = state.replace(cache=state.cache.replace(lengths=jnp.full((b,), ctx, jnp.int32)))
  if state.draft_cache is not None:
    st = st.replace(draft_cache=state.draft_cache.replace(
        ctx_len=jnp.full((b,), ctx - spec.commit_width, jnp.int32)))
  return st
