"""The speculative decoder: lossless vs greedy AR, exact sampling, compiles once, clear errors."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax.decoding import loop, step
from kdtree_jax.decoding.sampling import SamplingConfig
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.draft import model as DM
from kdtree_jax.draft.config import DraftConfig
from kdtree_jax.target import params as P
from kdtree_jax.pair import Pair

BLOCK = 6


def make_pair(seed, vocab=264, eos=None, std=0.15):
  tcfg = C.tiny(vocab_size=vocab, eos_token_id=eos, bos_token_id=None, pad_token_id=None)
  tp = P.init_params(jax.random.key(seed), tcfg, jnp.float32, std=std)
  dcfg = DraftConfig.tiny(hidden_size=tcfg.hidden_size, vocab_size=vocab, mask_token_id=vocab - 1,
                          target_layer_ids=(0, 2), num_target_layers=3, block_size=BLOCK)
  dp = DM.init_draft_params(jax.random.key(seed + 100), dcfg, tcfg.hidden_size, 2)
  return Pair(tcfg, tp, dcfg, dp)


def oracle_draft(ref_bm, miss_rate):
  """A stand-in draft phase whose block logits favour the AR reference continuation.

  With probability `miss_rate` per position a wrong token is ranked first (the right one second),
  so chains break and DDTree siblings matter; acceptance spans 0 .. the whole block.
  """
  ref = jnp.asarray(ref_bm)

  def phase(dcfg, dparams, tparams, spec, state):
    b, depth, v = state.bonus.shape[0], spec.depth, tparams["lm_head"].shape[1]
    key = jax.random.fold_in(jax.random.key(7), state.steps)
    k1, k2, k3 = jax.random.split(key, 3)
    logits = jax.random.normal(k1, (b, depth, v))
    idx = jnp.clip(state.n_out[:, None] + jnp.arange(depth)[None], 0, ref.shape[1] - 1)
    right = jnp.take_along_axis(ref, idx, axis=1)
    wrong = jax.random.randint(k2, right.shape, 0, v)
    miss = jax.random.uniform(k3, right.shape) < miss_rate
    bi, di = jnp.indices(right.shape)
    logits = logits.at[bi, di, right].add(6.0)
    logits = logits.at[bi, di, wrong].add(jnp.where(miss & (wrong != right), 9.0, 0.0))
    return state.draft_cache, logits

  return phase


def run(pair, spec, prompts, max_len):
  return loop.generate(pair, spec, prompts, max_len=max_len)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lossless_greedy_with_oracle_draft(seed, monkeypatch):
  rng = np.random.default_rng(seed)
  pair = make_pair(seed)
  prompts = [list(rng.integers(0, 256, n)) for n in (rng.integers(3, 12), rng.integers(3, 12))]
  n_new = 40
  ar = run(pair, SpecConfig(mode="ar", max_new_tokens=n_new, block_size=BLOCK), prompts, 96)
  ref = np.zeros((2, n_new + 2 * BLOCK), np.int32)
  for i, t in enumerate(ar.tokens):
    ref[i, :len(t)] = t
  jax.clear_caches()
  monkeypatch.setattr(step, "draft_phase", oracle_draft(ref, miss_rate=0.25))
  for spec in (SpecConfig(mode="chain", max_new_tokens=n_new, block_size=BLOCK),
               SpecConfig(mode="ddtree", budget=9, max_new_tokens=n_new, block_size=BLOCK)):
    res = run(pair, spec, prompts, 96)
    assert res.tokens == ar.tokens, spec.mode
    acc = [a for row in res.accepted_per_step for a in row]
    assert max(acc) == BLOCK and min(acc) == 1, acc  # full-block and zero acceptance both seen
  jax.clear_caches()


@pytest.mark.slow
def test_lossless_eos_inside_accepted_path_and_cache_full(monkeypatch):
  pair = make_pair(3)
  prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15]]
  ar = run(pair, SpecConfig(mode="ar", max_new_tokens=30, block_size=BLOCK), prompts, 64)
  eos = ar.tokens[0][12]  # a token the AR run emits mid-way: stop there
  pair_eos = pair.replace(tcfg=dataclasses.replace(pair.tcfg, eos_token_id=int(eos)))
  for max_len in (64, 24):  # 24: row 1 hits the cache limit before 30 tokens
    ar = run(pair_eos, SpecConfig(mode="ar", max_new_tokens=30, block_size=BLOCK), prompts, max_len)
    ref = np.zeros((2, 30 + 2 * BLOCK), np.int32)
    for i, t in enumerate(ar.tokens):
      ref[i, :len(t)] = t
    jax.clear_caches()
    monkeypatch.setattr(step, "draft_phase", oracle_draft(ref, miss_rate=0.1))
    for spec in (SpecConfig(mode="chain", max_new_tokens=30, block_size=BLOCK),
                 SpecConfig(mode="ddtree", budget=7, max_new_tokens=30, block_size=BLOCK)):
      res = run(pair_eos, spec, prompts, max_len)
      assert res.tokens == ar.tokens, (spec.mode, max_len)
    assert ar.tokens[0][-1] == eos
    if max_len == 24:
      assert len(ar.tokens[1]) == 24 - len(prompts[1]) + 1  # stopped by the full cache
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.slow
def test_lossless_with_the_real_draft():
  pair = make_pair(4)
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  out = {m: run(pair, SpecConfig(mode=m, budget=5, max_new_tokens=16, block_size=BLOCK), prompts, 48)
         for m in ("ar", "chain", "ddtree")}
  assert out["ar"].tokens == out["chain"].tokens == out["ddtree"].tokens


@pytest.mark.slow
def test_step_compiles_once_over_50_steps():
  pair = make_pair(5)
  spec = SpecConfig(mode="ddtree", budget=6, max_new_tokens=200, block_size=BLOCK)
  traces = []

  def counted(pair_, st):
    traces.append(1)
    return step.speculative_step(pair_, spec, st)

  jitted = jax.jit(counted, donate_argnums=1)
  state = jax.jit(lambda: loop.init_state(pair, spec, jnp.array([[1, 2, 3, 4]]), jnp.array([4]),
                                          jax.random.key(0), 256))()
  lengths = set()
  for _ in range(50):
    state = jitted(pair, state)
    lengths.add(int(state.cache.lengths[0]))
  assert len(lengths) == 50 and len(traces) == 1


@pytest.mark.slow
def test_sampling_matches_target_distribution():
  """At temperature 1, the second emitted token's law is sum_t1 p(t1) p(t2 | t1) (chi-square)."""
  vocab = 8
  pair = make_pair(6, vocab=vocab, std=0.5)
  tcfg, tp = pair.tcfg, pair.tparams
  prompt = [1, 2, 3]
  n = 4000
  spec = SpecConfig(mode="ddtree", budget=4, max_new_tokens=3, block_size=BLOCK,
                    sampling=SamplingConfig(temperature=1.0))
  res = run(pair, spec, [prompt] * n, 16)
  second = np.array([t[1] for t in res.tokens])
  from kdtree_jax.api import forward  # pylint: disable=import-outside-toplevel
  p1 = jax.nn.softmax(forward(tcfg, tp, jnp.array([prompt]))[0, -1])
  seqs = jnp.array([prompt + [t] for t in range(vocab)])
  p2 = jax.nn.softmax(forward(tcfg, tp, seqs)[:, -1], axis=-1)
  expected = n * np.asarray(p1 @ p2)
  counts = np.bincount(second, minlength=vocab)
  chi2 = float(np.sum((counts - expected) ** 2 / expected))
  assert chi2 < 24.32, (chi2, counts, expected)  # chi-square 0.999 quantile, 7 dof
  assert sum(len(r) for r in res.accepted_per_step) < 2 * n  # the tree path was taken


@pytest.mark.parametrize("bad,match", [
    (dict(prompts=[[]]), "empty prompt"),
    (dict(spec=dict(mode="ddtree", budget=0)), "budget"),
    (dict(max_len=4, prompts=[[1, 2, 3, 4, 5]]), "exceeds max_len"),
    (dict(prompts=[[1, 999]]), "token ids"),
    (dict(draft=dict(hidden_size=48)), "hidden_size"),
    (dict(draft=dict(target_layer_ids=(0, 7))), "target_layer_ids"),
])
def test_bad_input(bad, match):
  pair = make_pair(0)
  tcfg, dcfg = pair.tcfg, pair.dcfg
  with pytest.raises(ValueError, match=match):
    spec = SpecConfig(**{"mode": "chain", "block_size": BLOCK, **bad.get("spec", {})})
    if "draft" in bad:
      dcfg = dataclasses.replace(dcfg, **bad["draft"])
    loop.validate(tcfg, dcfg, spec, bad.get("prompts", [[1, 2]]), bad.get("max_len", 32))


@pytest.mark.slow
def test_streaming_equals_one_dispatch_and_compiles_once():
  pair = make_pair(7)
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
  spec = SpecConfig(mode="ddtree", budget=5, max_new_tokens=30, block_size=BLOCK)
  whole = run(pair, spec, prompts, 64)
  stream = loop.Stream(pair, spec, prompts, 64, chunk_steps=3)
  pieces = [[], []]
  for delta in stream:
    for i, d in enumerate(delta):
      pieces[i].extend(d)
  assert pieces == whole.tokens == stream.result.tokens
  assert stream.result.accepted_per_step == whole.accepted_per_step
  assert loop.steps_device._cache_size() == 1  # every chunk reused one program


def test_reported_seconds_include_fetching_the_results(monkeypatch):
  """GenerationResult.seconds runs until the outputs are on the host (the device work is done),
  not just until the asynchronous dispatch returns: a slow fetch must show in it."""
  pair = make_pair(3)
  spec = SpecConfig(mode="ar", max_new_tokens=4, block_size=BLOCK)
  run(pair, spec, [[1, 2, 3]], 32)  # compile
  fetch = loop.sharding.to_host

  def slow_fetch(tree):
    time.sleep(0.3)
    return fetch(tree)

  monkeypatch.setattr(loop.sharding, "to_host", slow_fetch)
  assert run(pair, spec, [[1, 2, 3]], 32).seconds >= 0.3
