"""Collectives per step of the compiled decode loop on 8 simulated CPU devices (small config).

  .venv/bin/python scripts/count_collectives.py "tensor=8" "tensor=2,expert=4"
"""
import os, sys
os.environ["XLA_FLAGS"]="--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import jax, jax.numpy as jnp, numpy as np
from kdtree_jax import config as C, sharding
from kdtree_jax.collective_audit import count_collectives
from kdtree_jax.decoding import loop
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.draft import model as DM
from kdtree_jax.model import params as P
from test_sharding import small_configs
tcfg, dcfg = small_configs()
tcfg = tcfg.replace(num_hidden_layers=4)
dcfg = dcfg.replace(num_target_layers=4) if hasattr(dcfg, "replace") else dcfg
for mesh_spec in sys.argv[1:]:
  mesh = sharding.make_mesh(mesh_spec)
  tp = sharding.init_sharded(lambda k: P.init_params(k, tcfg, jnp.float32), mesh, jax.random.key(0))
  dp = sharding.init_sharded(lambda k: DM.init_draft_params(k, dcfg, tcfg.hidden_size, dcfg.n_taps), mesh, jax.random.key(1))
  for mode in ("ar", "ddtree"):
    spec = SpecConfig(mode=mode, budget=6, block_size=4, max_new_tokens=8)
    prompts = jnp.zeros((1, 16), jnp.int32); lengths = jnp.array([5], jnp.int32)
    with sharding.use_mesh(mesh):
      txt = loop.generate_device.lower(tp, dp, prompts, lengths, jax.random.key(0), tcfg=tcfg, dcfg=dcfg, spec=spec, max_len=64).compile().as_text()
    c = count_collectives(txt)
    print(mesh_spec, mode, "loop", dict(c["loop"]), "total", sum(c["loop"].values()), "per target layer", sum(c["loop"].values())/tcfg.num_hidden_layers)
