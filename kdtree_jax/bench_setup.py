"""What a K2.6-share benchmark builds from its run config (configs/bench_k26_*.py): the spec of a
mode and the pair in its decode layout. Shared by scripts/bench_k26_full.py (which times them)
and scripts/gpu_program.py (which compiles them for an H200 without one)."""

import jax

from kdtree_jax import forced_accept
from kdtree_jax.decoding import memory_bound
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.draft import model as draft_model
from kdtree_jax.loader import load_draft, load_target, load_target_for_decode


def bench_spec(c, mode, budget=None) -> SpecConfig:
  """The decode spec of `mode` (ddtree at `budget`, default bench.budget), with the config's
  forced acceptance (random weights accept nothing) and DDTree builder (bench.tree_impl, default
  'auto' as SpecConfig: the one-kernel builder on a GPU up to budget 34, XLA's sorts above;
  'xla' is the sorts' A/B)."""
  return SpecConfig(mode=mode, budget=budget or c.bench.budget, block_size=c.block_size,
                    max_new_tokens=4096, attn_backend=c.attn_backend,
                    target_choice=forced_accept.target_choice(c.forced_accept),
                    tree_impl=c.bench.get("tree_impl", "auto"))


def load_bench_pair(c, dtype, abstract):
  """(tcfg, tparams, dcfg, dparams): on the device, or ShapeDtypeStructs when `abstract`. The
  target in target.pack's decode layout (one dot for q_a | kv_a, router | shared gate | up per
  layer) unless bench.pack_target=False (the per-layer weights, for an A/B run); the
  draft in its decode layout (`draft.model.pack_for_decode`, as `load_pair` gives decode) unless
  bench.pack_draft=False; with bench.draft_token_qkv=True (the GPU A/B, default off) also
  `draft.model.pack_token_qkv`'s table of layer 0's q|k|v rows per token (from the target's
  embedding), so draft_block gathers those rows instead of running layer 0's q|k|v dot.
  On a device, weights that cannot fit its memory stop the run before anything is allocated
  (`memory_bound.check_weights_fit`; an H100 ran out after minutes of allocator retries)."""
  box = {}
  load = load_target_for_decode if c.bench.get("pack_target", True) else load_target
  pack_draft = c.bench.get("pack_draft", True)
  token_qkv = c.bench.get("draft_token_qkv", False)
  if token_qkv and not pack_draft:
    raise ValueError("bench.draft_token_qkv needs bench.pack_draft (pack_token_qkv reads the "
                     "packed q|k|v weight)")

  def build():
    box["tcfg"], tp = load(c.target, dtype)
    box["dcfg"], dp = load_draft(c.draft, box["tcfg"], dtype)
    dp = draft_model.pack_for_decode(dp) if pack_draft else dp
    return tp, (draft_model.pack_token_qkv(dp, box["dcfg"], tp["embed"]) if token_qkv else dp)

  shapes = jax.eval_shape(build)
  if abstract:
    return box["tcfg"], shapes[0], box["dcfg"], shapes[1]
  check_pair_fits(shapes, box["tcfg"].num_hidden_layers)
  tp, dp = jax.block_until_ready(build())
  return box["tcfg"], tp, box["dcfg"], dp


def check_pair_fits(weights, layers: int):
  """SystemExit before any allocation when the pair's weights (arrays or ShapeDtypeStructs)
  alone exceed one device's memory, naming both figures and the way out."""
  memory_bound.check_weights_fit(
      weights, f"the bench pair ({layers}-layer target + draft)",
      "run it on a larger GPU (K2.6's one-GPU share: an H200, 141 GB; on the device tool "
      "needs_h200=true) or fewer layers (--config.target.layers)")
