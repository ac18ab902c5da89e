"""The compiled decode loop updates the caches in place: no step copies a cache buffer.

A copy of a cache-sized buffer inside the loop body costs the whole cache's bytes every step; the
stacked [layers, B, L, C] cache this project had before made XLA do that four times per step
(WORKSPACE.md). The check reads the optimized HLO (`kdtree_jax.hlo_audit`), so it runs on CPU.
"""

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from kdtree_jax.target import config as C
from kdtree_jax import hlo_audit, loader, profiling
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.target.params import init_params
from kdtree_jax.pair import Pair


def _loop_hlo(mode):
  cfg = C.tiny(num_hidden_layers=3)
  spec = SpecConfig(mode=mode, budget=8, block_size=8, max_new_tokens=16)
  tp = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg, jnp.float32))
  dcfg = dp = None
  if mode != "ar":
    dcfg, dp = loader.load_draft(ml_collections.ConfigDict(dict(checkpoint="", preset="tiny",
                                                                seed=0)), cfg, jnp.float32)
  st = jax.eval_shape(lambda: profiling.bench_state(cfg, dcfg, spec, 1, 4000, jnp.float32))
  fn = profiling.while_steps_fn(spec)
  return fn.lower(Pair(cfg, tp, dcfg, dp), st, jnp.int32(4)).compile().as_text(), st


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_loop_body_copies_no_cache_buffer(mode):
  txt, st = _loop_hlo(mode)
  buffers = list(st.cache.latent)
  if st.draft_cache is not None:
    buffers += list(st.draft_cache.k) + list(st.draft_cache.v)
  smallest = min(a.size * a.dtype.itemsize for a in buffers)
  copies = hlo_audit.large_copies(txt, smallest)
  # No buffer copy of a cache-sized array (what the stacked cache caused) ...
  assert not [c for c in copies if not c.fused], copies
  # ... and the fused relayouts left are the XLA attentions' K layouts (target reference on CPU:
  # [B, C, L] per layer; the draft's GQA attention), never the target cache in its own shape.
  assert not [c for c in copies if c.shape in {a.shape for a in st.cache.latent}], copies


def test_audit_finds_a_copy():
  """The audit itself: a loop that keeps the old buffer alive next to its update must copy."""
  def body(carry):
    x, old, i = carry
    return x.at[i].set(1.0), x, i + 1  # the pre-update x is carried on too: XLA copies it
  fn = jax.jit(lambda x: jax.lax.while_loop(lambda c: c[2] < 3, body, (x, x, 0)))
  txt = fn.lower(jax.ShapeDtypeStruct((1 << 18,), jnp.float32)).compile().as_text()
  copies = hlo_audit.large_copies(txt, 1 << 20)
  assert copies and all(c.shape == (1 << 18,) and not c.fused for c in copies), copies


def test_compaction_one_gather_matches_reference_near_the_end():
  """compact_rows = gather the accepted rows, write them at len (a window clamped into the
  buffer like dynamic_update_slice); numpy reference, windows that run past the end included."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from kdtree_jax.target.cache import compact_rows  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  rows, a = 20, 5
  lat = rng.normal(size=(4, rows, 3)).astype(np.float32)
  lengths = np.array([0, 7, 17, 19], np.int32)  # the last two windows run past the end
  src = np.sort(rng.integers(0, 8, (4, a)), axis=1).astype(np.int32)
  count = np.array([5, 2, 3, 1], np.int32)
  (out,) = compact_rows((jnp.asarray(lat),), jnp.asarray(lengths), jnp.asarray(src),
                        jnp.asarray(count))
  want = lat.copy()
  for b in range(4):
    start = min(max(lengths[b], 0), rows - a)
    got = [lat[b, min(lengths[b] + src[b, k], rows - 1)] if k < count[b] else lat[b, start + k]
           for k in range(a)]
    want[b, start:start + a] = got
  np.testing.assert_array_equal(np.asarray(out), want)
