"""The model's verify-attention entry point under a mesh: per-head-shard attention (shard_map).

The kernel backends take this path on GPUs. On CPU the Mosaic GPU interpreter cannot run inside
a multi-device shard_map (its emulated shared memory is global), so the wiring (specs, head
split, replicated cache) is checked with the XLA backend forced through the same shard_map, and
the kernel itself through it on a one-device mesh (every GPU on a GPU host).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax import sharding
from kdtree_jax.target import mla
from pallas_kernels import tree_verify_attention_reference


@pytest.mark.parametrize("mesh_spec", ["tensor=2,expert=4", "data=2,tensor=4", "tensor=8"])
def test_per_head_shard_attention_matches_reference(mesh_spec):
  cfg = C.tiny(num_attention_heads=8, kv_lora_rank=128, qk_rope_head_dim=64)  # C = 192, R = 128
  b, n, h, l = 2, 5, cfg.num_attention_heads, 150
  k = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(k[0], (b, n, h, cfg.cache_dim), jnp.float32)
  cache = jax.random.normal(k[1], (b, l, cfg.cache_dim), jnp.float32)
  lengths = jnp.array([37, 120], jnp.int32)
  mask = jax.random.bernoulli(k[2], 0.5, (b, n, n)) | jnp.eye(n, dtype=bool)[None]
  ref, _ = tree_verify_attention_reference(q, cache, lengths, mask, scale=cfg.softmax_scale,
                                           value_dim=cfg.kv_lora_rank)
  mesh = sharding.make_mesh(mesh_spec)
  with sharding.use_mesh(mesh):
    out = jax.jit(lambda *a: mla.verify_attention(cfg, *a, backend="xla", shard_heads=True))(
        q, cache, lengths, mask)
  assert out.sharding.spec[2] is not None  # heads stay split: each shard ran its own heads
  assert float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)) < 1e-5


def test_no_mesh_is_the_plain_call():
  cfg = C.tiny(num_attention_heads=4, kv_lora_rank=128, qk_rope_head_dim=64)
  q = jnp.ones((1, 2, 4, cfg.cache_dim))
  cache = jnp.ones((1, 16, cfg.cache_dim))
  out = mla.verify_attention(cfg, q, cache, jnp.array([3]), jnp.ones((1, 2, 2), bool), "xla")
  assert out.shape == (1, 2, 4, cfg.kv_lora_rank)


@pytest.mark.gpu
def test_kernel_per_head_shard():
  """The kernel backend through the model's shard_map path: compiled over every GPU, or in
  interpret mode on a one-device CPU mesh (the interpreter cannot span several devices)."""
  cfg = C.tiny(num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64)  # C = 576
  b, n, h, l = 2, 7, cfg.num_attention_heads, 256
  k = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(k[0], (b, n, h, cfg.cache_dim), jnp.bfloat16)
  cache = jax.random.normal(k[1], (b, l, cfg.cache_dim), jnp.bfloat16)
  lengths = jnp.array([249, 100], jnp.int32)
  mask = jax.random.bernoulli(k[2], 0.5, (b, n, n)) | jnp.eye(n, dtype=bool)[None]
  # The f32 reference on the CPU (on a GPU, XLA's compile of its f32 GEMMs at N*H >= 64 took
  # ~10 s in the kernel tests' H200 run; this test took 18.7 s there).
  cpu_args = jax.device_put((q, cache, lengths, mask), jax.devices("cpu")[0])
  ref, _ = jax.jit(lambda *a: tree_verify_attention_reference(
      *a, scale=cfg.softmax_scale, value_dim=cfg.kv_lora_rank))(*cpu_args)
  ref = np.asarray(ref, np.float32)
  on_gpu = jax.default_backend() == "gpu"
  devices = jax.devices() if on_gpu else jax.devices()[:1]
  backend = "pallas" if on_gpu else "interpret"
  mesh = sharding.make_mesh(f"tensor={len(devices)}", devices)
  with sharding.use_mesh(mesh):
    out = jax.jit(lambda *a: mla.verify_attention(cfg, *a, backend=backend, shard_heads=True))(
        q, cache, lengths, mask)
  out = np.asarray(out, np.float32)
  assert float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) < 1e-2
