"""`Pair`: the target and the draft a speculative decode runs, as one pytree.

Configs are static (the pytree's aux data: hashed into jit's cache key, so a jitted function
taking a Pair compiles once per (target config, draft config)); params are the leaves. The
draft is None for autoregressive decoding (`SpecConfig(mode='ar')`).
"""

import flax.struct

from kdtree_jax.draft.config import DraftConfig
from kdtree_jax.target.config import TargetConfig


@flax.struct.dataclass
class Pair:
  """tcfg / tparams: the target model's config and params; dcfg / dparams: the draft's (or None)."""

  tcfg: TargetConfig = flax.struct.field(pytree_node=False)
  tparams: dict
  dcfg: DraftConfig | None = flax.struct.field(pytree_node=False, default=None)
  dparams: dict | None = None
