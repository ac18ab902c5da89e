"""Collectives per target layer in the compiled decode loop (8 simulated CPU devices; issue 14).

At batch 1 each small all-reduce costs ~15-25 us of latency on H200s, so a decode step should
pay one collective after attention and one after the FFN per target layer. The loop also holds
once-per-step collectives (embedding, sampling, the draft's layers and logits, the dense first
layer); models of 2 and 4 target layers differ by exactly two MoE layers, so
(count(4) - count(2)) / 2 is the per-layer count, whatever the once-per-step part is.

  .venv/bin/python -m pytest -s tests/sharding/test_collectives.py   (prints where each one comes from)
  .venv/bin/python scripts/count_collectives.py "tensor=8" "tensor=2,expert=4"
"""

import collections
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax import projection, sharding
from kdtree_jax.collective_audit import KINDS, count_collectives
from kdtree_jax.decoding import loop
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.draft import model as DM
from kdtree_jax.target import moe as moe_lib
from kdtree_jax.target import params as P
from kdtree_jax.pair import Pair
from test_sharding import small_configs

_OP = re.compile(r"\s(" + "|".join(KINDS) + r")(-start)?\(.*stack_frame_id=(\d+)")
_TABLE = re.compile(r"^(\d+) \{?(.*?)\}?$")


def decode_loop_hlo(mesh_spec: str, mode: str, layers: int) -> str:
  """Optimized HLO of the device loop (`generate_device`) of the small pair, `layers` deep
  (one prompt per `data` shard)."""
  tcfg, dcfg = small_configs()
  tcfg = tcfg.replace(num_hidden_layers=layers)
  mesh = sharding.make_mesh(mesh_spec)
  tp = sharding.init_sharded(lambda k: P.init_params(k, tcfg, jnp.float32), mesh,
                             jax.random.key(0))
  dp = sharding.init_sharded(lambda k: DM.init_draft_params(k, dcfg, tcfg.hidden_size,
                                                            dcfg.n_taps), mesh, jax.random.key(1))
  spec = SpecConfig(mode=mode, budget=6, block_size=4, max_new_tokens=8)
  batch = sharding.parse_mesh(mesh_spec)["data"]
  prompts, lengths = jnp.zeros((batch, 16), jnp.int32), jnp.full((batch,), 5, jnp.int32)
  with sharding.use_mesh(mesh):
    lowered = loop.generate_device.lower(Pair(tcfg, tp, dcfg, dp), prompts, lengths,
                                         jax.random.key(0), spec=spec, max_len=64)
    return lowered.compile().as_text()


def loop_total(hlo_text: str) -> int:
  return sum(count_collectives(hlo_text)["loop"].values())


def _stack_tables(hlo_text: str):
  """(file locations id -> 'file:line', stack frames id -> (location id, parent id))."""
  sections, current = collections.defaultdict(dict), None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FileLocations", "StackFrames"):
      current = line
      continue
    m = _TABLE.match(line) if current else None
    if not m:
      current = None
      continue
    sections[current][int(m.group(1))] = m.group(2)
  files = {i: os.path.basename(v.strip('"')) for i, v in sections["FileNames"].items()}
  locs = {}
  for i, v in sections["FileLocations"].items():
    f = dict(re.findall(r"(\w+)=(\d+)", v))
    locs[i] = f"{files[int(f['file_name_id'])]}:{f['line']}"
  frames = {i: tuple(int(x) for x in re.findall(r"=(\d+)", v)) for i, v in
            sections["StackFrames"].items()}
  return locs, frames


def sources(hlo_text: str) -> collections.Counter:
  """Counter of (kind, innermost source 'file:line') over the loop's collectives."""
  locs, frames = _stack_tables(hlo_text)
  out, in_entry = collections.Counter(), True
  for line in hlo_text.splitlines():
    if line.endswith("{") and not line.startswith(" "):
      in_entry = line.startswith("ENTRY")
    m = _OP.search(line)
    if m and not in_entry:
      frame = frames.get(int(m.group(3)))
      out[(m.group(1), locs.get(frame[0], "?") if frame else "?")] += 1
  return out


def breakdown(deep: str, shallow: str) -> str:
  """Lines 'kind source: n at 4 layers, m at 2 layers' (the difference is two MoE layers)."""
  a, b = sources(deep), sources(shallow)
  return "\n".join(f"  {k:13s} {s:28s} {a[(k, s)]:3d} {b[(k, s)]:3d}"
                   for k, s in sorted(set(a) | set(b)))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec,mode", [
    ("tensor=8", "ar"), ("tensor=2,expert=4", "ar"), ("tensor=8", "ddtree"),
    ("tensor=2,expert=4", "ddtree"), ("data=2,expert=4", "ar")])
def test_at_most_two_collectives_per_target_layer(mesh_spec, mode):
  deep, shallow = decode_loop_hlo(mesh_spec, mode, 4), decode_loop_hlo(mesh_spec, mode, 2)
  per_layer = (loop_total(deep) - loop_total(shallow)) / 2
  print(f"\n{mesh_spec} {mode}: {loop_total(deep)} in the loop at 4 target layers, "
        f"{loop_total(shallow)} at 2 -> {per_layer} per target layer\n"
        f"  kind          source                       4L  2L\n{breakdown(deep, shallow)}")
  assert per_layer <= 2
  if not mesh_spec.startswith("data"):  # the 8-GPU projection charges exactly this count
    draft_layers = small_configs()[1].num_hidden_layers
    assert loop_total(deep) == projection.collectives_per_step(mode, 4, draft_layers)


def _moe_case(dtype, **overrides):
  cfg = C.tiny(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
               moe_intermediate_size=16, **overrides)
  p = P.init_params(jax.random.key(3), cfg, dtype, std=0.3)["layers"][1]["moe"]
  x = jax.random.normal(jax.random.key(4), (2 * 13, cfg.hidden_size), dtype)
  return cfg, p, x


def _sharded_moe(cfg, p, x, mesh_spec):
  """(output, pre-optimization HLO, optimized HLO) of `moe` with p placed by the rules."""
  mesh = sharding.make_mesh(mesh_spec)
  shardings = sharding.param_shardings({"layers": [{"moe": p}]}, mesh)["layers"][0]["moe"]
  ps = sharding.shard(p, shardings)
  with sharding.use_mesh(mesh):
    fn = jax.jit(lambda p, x: moe_lib.moe(p, cfg, x))
    lowered = fn.lower(ps, x)
    return fn(ps, x), lowered.as_text("hlo"), lowered.compile().as_text()


@pytest.mark.parametrize("mesh_spec", ["tensor=8", "tensor=2,expert=4", "expert=8",
                                       "data=2,expert=4"])
@pytest.mark.slow
def test_moe_is_one_all_reduce_in_the_activation_dtype(mesh_spec):
  """Routed + shared experts: one psum, in bf16 for bf16 activations (the CPU backend widens
  it to f32 when compiling, so the dtype is read before optimization); same values as one
  device within bf16 rounding of the 8 partial sums (measured ~3.5e-3 relative L2)."""
  cfg, p, x = _moe_case(jnp.bfloat16)
  got, pre, post = _sharded_moe(cfg, p, x, mesh_spec)
  assert count_collectives(post)["entry"] == {"all-reduce": 1}
  assert re.findall(r"= (\w+)\[[\d,]*\]\S* all-reduce\(", pre) == ["bf16"]
  want = np.asarray(jax.jit(lambda p, x: moe_lib.moe(p, cfg, x))(p, x), np.float32)
  got = np.asarray(got, np.float32)
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["tensor=8", "tensor=2,expert=4"])
def test_moe_shared_expert_split_differently_keeps_two_reductions(mesh_spec):
  """A shared expert whose F does not divide like the routed experts' (12 rows: not over 8
  devices) is not folded into the routed psum; the sum still equals one device's (f32)."""
  cfg, p, x = _moe_case(jnp.float32, shared_intermediate_size=12)
  got, _, post = _sharded_moe(cfg, p, x, mesh_spec)
  want = jax.jit(lambda p, x: moe_lib.moe(p, cfg, x))(p, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  n = sum(count_collectives(post)["entry"].values())
  assert n == (1 if mesh_spec == "tensor=8" else 2), count_collectives(post)
