"""Prompt lengths are bucketed: a new prompt length reuses the compiled prefill + loop of its
bucket, and the tokens equal those of the unpadded prompt."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax import loader
from kdtree_jax.decoding import loop
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.target.params import init_params
from kdtree_jax.pair import Pair


def test_bucket_sizes():
  assert [loop.prompt_bucket(n, 4096) for n in (1, 64, 65, 128, 129, 3000)] == [
      64, 64, 128, 128, 256, 4096]
  assert loop.prompt_bucket(100, 96) == 96  # never wider than the cache's committed rows


def _unpadded(pair, spec, prompt, max_len):
  """The tokens of generate_device on the prompt at its own width (no bucket)."""
  st = loop.generate_device(pair, jnp.asarray([prompt], jnp.int32),
                            jnp.asarray([len(prompt)], jnp.int32), jax.random.key(0), spec=spec,
                            max_len=max_len)
  return list(np.asarray(st.out)[0, :int(st.n_out[0])])


@pytest.mark.slow
def test_new_length_in_bucket_does_not_recompile():
  tcfg = C.tiny()
  tp = init_params(jax.random.key(0), tcfg, jnp.float32)
  ref = ml_collections.ConfigDict(dict(checkpoint="", preset="tiny", seed=1))
  dcfg, dp = loader.load_draft(ref, tcfg, jnp.float32)
  spec = SpecConfig(mode="ddtree", budget=4, block_size=dcfg.block_size, max_new_tokens=8)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(0, 250, n)) for n in (5, 9, 40)]
  pair = Pair(tcfg, tp, dcfg, dp)
  loop.generate(pair, spec, [prompts[0]], max_len=128)
  compiled = loop.generate_device._cache_size()
  for p in prompts:
    res = loop.generate(pair, spec, [p], max_len=128)
    assert res.tokens[0] == _unpadded(pair, spec, p, 128)[:len(res.tokens[0])]
    assert len(res.tokens[0]) == 8
  assert loop.generate_device._cache_size() == compiled + 3  # only the 3 unpadded references
