"""Parameter pytree layout and random initialisation.

params = {"embed": [V, D], "final_norm": [D], "lm_head": [D, V],
          "layers": [ {"attn_norm", "mlp_norm", "attn": {...}, "mlp" | "moe": {...}}, ... ]}
Dense layers (i < first_k_dense_replace) have "mlp"; MoE layers have "moe" with
router [D, E], bias [E] (f32, selection only), gate/up [E_l, D, F], down [E_l, F, D], shared {...}
(E_l = cfg.experts_held: all E, or one GPU's share for benchmarks). `int4_experts=True` makes the
routed stacks random INT4 (`checkpoint.int4.Int4Weight`), as a K2.6 checkpoint holds them, with
zero-mean codes (`random_int4`'s zero_mean: the full code range's offset collapses a deep model).
One device's decode reads target/pack.py's layout of the same weights (joined dots, built at load).
"""

import jax
import jax.numpy as jnp

from kdtree_jax.target.config import TargetConfig
from kdtree_jax.checkpoint import int4


def layer_shapes(cfg: TargetConfig, i: int) -> dict:
  """Shapes of layer i's parameters (nested dict of tuples)."""
  d, h = cfg.hidden_size, cfg.num_attention_heads
  qk, r, p = cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
  attn = {"kv_a": (d, r + p), "kv_a_norm": (r,), "kv_b": (r, h, cfg.qk_nope_head_dim + cfg.v_head_dim),
          "o": (h, cfg.v_head_dim, d)}
  if cfg.q_lora_rank is None:
    attn["q"] = (d, h, qk)
  else:
    attn.update(q_a=(d, cfg.q_lora_rank), q_a_norm=(cfg.q_lora_rank,), q_b=(cfg.q_lora_rank, h, qk))
  out = {"attn_norm": (d,), "mlp_norm": (d,), "attn": attn}
  if i < cfg.first_k_dense_replace:
    f = cfg.intermediate_size
    out["mlp"] = {"gate": (d, f), "up": (d, f), "down": (f, d)}
  else:
    e, el, f = cfg.n_routed_experts, cfg.experts_held, cfg.moe_intermediate_size
    moe = {"router": (d, e), "bias": (e,), "gate": (el, d, f), "up": (el, d, f), "down": (el, f, d)}
    if cfg.n_shared_experts:
      fs = cfg.shared_intermediate_size or f * cfg.n_shared_experts
      moe["shared"] = {"gate": (d, fs), "up": (d, fs), "down": (fs, d)}
    out["moe"] = moe
  return out


def param_shapes(cfg: TargetConfig) -> dict:
  """Shapes of the whole params pytree."""
  return {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,),
          "lm_head": (cfg.hidden_size, cfg.vocab_size),
          "layers": [layer_shapes(cfg, i) for i in range(cfg.num_hidden_layers)]}


def _is_shape(x):
  return isinstance(x, tuple) and all(isinstance(v, int) for v in x)


_ROUTED = ("['gate']", "['up']", "['down']")


def init_params(rng, cfg: TargetConfig, dtype=jnp.float32, std=0.02, int4_experts=False):
  """Random params: normal(std) matrices, ones for norms, small random routing bias (f32)."""
  shapes = param_shapes(cfg)
  leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=_is_shape)
  keys = jax.random.split(rng, len(leaves))
  out = []
  for (path, shape), key in zip(leaves, keys):
    name = jax.tree_util.keystr(path)
    if int4_experts and "['moe']" in name and "['shared']" not in name and name.endswith(_ROUTED):
      out.append(int4.random_int4(key, shape, std, zero_mean=True))
    elif name.endswith("norm']"):
      out.append(jnp.ones(shape, dtype))
    elif name.endswith("['bias']"):
      out.append(0.01 * jax.random.normal(key, shape, jnp.float32))
    else:
      out.append((std * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
  return jax.tree.unflatten(treedef, out)


def abstract_params(cfg: TargetConfig, dtype=jnp.bfloat16, int4_experts=False):
  """ShapeDtypeStructs of the params (no memory): `jax.eval_shape` of `init_params`."""
  return jax.eval_shape(lambda k: init_params(k, cfg, dtype, int4_experts=int4_experts),
                        jax.random.key(0))


def count_params(cfg: TargetConfig) -> dict[str, int]:
  """Parameter counts split into routed experts, attention, shared experts, dense, router, embed+head."""
  tree = abstract_params(cfg)
  counts = {"routed_experts": 0, "attention": 0, "shared_experts": 0, "dense_mlp": 0,
            "router": 0, "norms": 0, "embed_head": 0}
  for path, leaf in jax.tree.flatten_with_path(tree)[0]:
    name, n = jax.tree_util.keystr(path), leaf.size
    if "['shared']" in name:
      counts["shared_experts"] += n
    elif "['router']" in name or "['bias']" in name:
      counts["router"] += n
    elif "['moe']" in name:
      counts["routed_experts"] += n
    elif "['mlp']" in name:
      counts["dense_mlp"] += n
    elif "norm" in name:
      counts["norms"] += n
    elif "['attn']" in name:
      counts["attention"] += n
    else:
      counts["embed_head"] += n
  counts["total"] = sum(counts.values())
  return counts
