"""kdtree-jax: speculative decoding (DFlash draft + DDTree verify) for Kimi K2.6-shaped models.

Layout: `target/` is the verified model (its config, params, latent cache, HF checkpoint reader
and writer, and modules: MLA, MoE, experts, transformer), laid out like `draft/` (the DFlash
draft: config, model, checkpoint); `pair.py` holds both as one pytree (`Pair`); `loader.py` turns
a run config into a pair and a tokenizer; `decoding/` runs the speculative step and its device
loop; `tree.py` builds DDTrees; `checkpoint/` is format code both models use (safetensors, FP8
and INT4 quantisation); `orbax_io.py` saves / restores converted pairs.

Settings, named apart (each is its own type; "config" alone means the run config):
  TargetConfig  target/config.py   the target's architecture (from HF config.json); `tcfg`
  DraftConfig   draft/config.py    the draft's architecture (z-lab config.json); `dcfg`
  SpecConfig    decoding/spec_config.py   how one decode runs (mode, budget, block, sampling,
                attention backend); `spec`, static under jit
  SamplingConfig  decoding/sampling.py    greedy or temperature / top-k / top-p
  RuntimeConfig runtime.py         process-wide XLA settings (compile cache, command buffers)
  run config    configs/*.py       a script's whole input (an ml_collections ConfigDict: which
                target / draft to load, dtype, mesh, backends, decode fields); `c` / `config`

Dimension letters, one meaning each, in array-name suffixes (`x_bsd` is [B, S, D]) and docstring
shapes across the package (einsum subscripts follow them where they can; pallas_kernels/
documents its own matmul letters per kernel):
  A  blocks per training row (anchors)        N  verify width: the tree's root + nodes
  B  batch                                        (arrays over the nodes alone: N - 1 rows)
  C  latent cache width, R + P (576)          P  rope dim (qk_rope_head_dim)
  D  hidden size                              Q  INT4 quantisation group (32 input rows)
  E  routed experts                           R  kv_lora_rank (the MLA latent)
  F  FFN width (dense MLP, expert, draft)     S  tokens of a sequence (prompt, draft block)
  G  kv heads (draft GQA)                     T  tokens of one call (new context tokens), or
  H  attention (query) heads                      flattened B * S / B * N
  I  compiled verify widths (budget='auto')   U  query heads per kv head, H = G * U
  J  draft depth (block positions 1..J)       V  vocab
  K  top-k: experts per token, DDTree         W  commit width, J + 1 (= block_size)
     candidates per depth                     X  key positions of one attention call
  L  cache rows (target latent cache, draft   Y  head dim (draft; MLA's q/k Dn + P)
     K/V cache)                               Z  tapped features, n_taps * D (draft input)
  M  output buffer length (DecodeState.out)
MLA weights also use Dn (qk_nope dim), Dv (value dim), Rq (q_lora_rank).
"""

from kdtree_jax.api import forward, load_hf_checkpoint
from kdtree_jax.target.cache import LatentCache
from kdtree_jax.target.config import TargetConfig, load_hf_config
from kdtree_jax.decoding.loop import GenerationResult, generate
from kdtree_jax.decoding.sampling import SamplingConfig
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.draft.checkpoint import load_dflash_checkpoint, save_dflash_checkpoint
from kdtree_jax.draft.config import DraftConfig
from kdtree_jax.tree import accept_walk, build_chain, build_ddtree

__all__ = [
    "forward", "load_hf_checkpoint", "LatentCache", "TargetConfig", "load_hf_config",
    "GenerationResult", "generate", "SamplingConfig", "SpecConfig", "load_dflash_checkpoint",
    "save_dflash_checkpoint", "DraftConfig", "accept_walk", "build_chain", "build_ddtree",
]
