"""Orbax checkpoints: bit-exact round trips (INT4 too), restore onto a mesh, atomic saves, convert."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from kdtree_jax.target import config as C
from kdtree_jax import loader, sharding
from kdtree_jax import orbax_io
from kdtree_jax.target import hf_writer
from kdtree_jax.target.checkpoint import load_hf_checkpoint
from kdtree_jax.draft.checkpoint import save_dflash_checkpoint
from kdtree_jax.draft.config import DraftConfig
from kdtree_jax.draft.model import init_draft_params
from kdtree_jax.checkpoint import int4
from kdtree_jax.target.params import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERT = os.path.join(ROOT, "scripts", "convert_checkpoint.py")
MESH = "tensor=2,expert=4"
IS_INT4 = lambda x: isinstance(x, int4.Int4Weight)


def random_like(init_fn, seed=0):
  """Random params shaped like init_fn()'s, from numpy (eager jax init compiles for ~10 s)."""
  rng = np.random.default_rng(seed)
  fill = lambda s: jnp.asarray(0.02 * rng.standard_normal(s.shape, np.float32), s.dtype)
  return jax.tree.map(fill, jax.eval_shape(init_fn))


def target(dtype=jnp.bfloat16):
  cfg = C.tiny()
  params = random_like(lambda: init_params(jax.random.key(0), cfg, dtype))
  for layer in params["layers"][cfg.first_k_dense_replace:]:
    for m in ("gate", "up", "down"):
      layer["moe"][m] = int4.quantize(layer["moe"][m])
  return cfg, params


def draft():
  cfg = DraftConfig.tiny(hidden_size=64, vocab_size=264, num_target_layers=3,
                         target_layer_ids=(0, 2))
  return cfg, random_like(lambda: init_draft_params(jax.random.key(1), cfg, 64, cfg.n_taps,
                                                    jnp.float32), seed=1)


def assert_same(a, b):
  """Same tree (Int4Weight where it was), dtypes and bits."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("which", ["target", "draft"])
def test_round_trip_bit_exact(tmp_path, which):
  cfg, params = target() if which == "target" else draft()
  kw = {"config": cfg} if which == "target" else {"draft_config": cfg}
  path = orbax_io.save_params(str(tmp_path / "ck"), params, **kw)
  assert orbax_io.read_marker(path)["kind"] == which
  cfg2, restored = orbax_io.restore_params(path)
  assert cfg2 == cfg
  assert_same(restored, params)
  if which == "target":
    assert IS_INT4(restored["layers"][1]["moe"]["gate"])
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp dirs left behind


def test_restore_onto_mesh(tmp_path):
  cfg, params = target()
  path = orbax_io.save_params(str(tmp_path / "ck"), params, config=cfg)
  mesh = sharding.make_mesh(MESH)
  _, restored = orbax_io.restore_params(path, mesh=mesh)
  want = sharding.param_shardings(params, mesh)
  leaves = jax.tree.leaves_with_path(restored)
  for (path_, x), sh, y in zip(leaves, jax.tree.leaves(want), jax.tree.leaves(params)):
    assert x.sharding.is_equivalent_to(sh, x.ndim), (jax.tree_util.keystr(path_), x.sharding, sh)
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
  gate = restored["layers"][1]["moe"]["gate"].packed
  assert len(gate.addressable_shards) == 8 and gate.addressable_shards[0].data.shape[0] == 2
  _, as_f32 = orbax_io.restore_params(path, mesh=mesh, dtype=jnp.float32)
  assert as_f32["embed"].dtype == as_f32["layers"][1]["moe"]["bias"].dtype == jnp.float32
  assert as_f32["layers"][1]["moe"]["gate"].scale.dtype == jnp.bfloat16  # INT4 leaves kept


def _fail_marker(*_):
  raise KeyboardInterrupt("simulated interruption")


def test_interrupted_save_leaves_nothing_complete(tmp_path, monkeypatch):
  cfg, params = draft()
  path = str(tmp_path / "ck")
  monkeypatch.setattr(orbax_io, "_write_marker", _fail_marker)
  with pytest.raises(KeyboardInterrupt):
    orbax_io.save_params(path, params, draft_config=cfg)
  assert os.listdir(tmp_path) == []
  monkeypatch.undo()
  orbax_io.save_params(path, params, draft_config=cfg)  # an older complete checkpoint ...
  monkeypatch.setattr(orbax_io, "_write_marker", _fail_marker)
  with pytest.raises(KeyboardInterrupt):
    orbax_io.save_params(path, jax.tree.map(jnp.zeros_like, params), draft_config=cfg)
  assert_same(orbax_io.restore_params(path)[1], params)  # ... survives a failed overwrite


def test_killed_save_leaves_nothing_complete(tmp_path):
  """A process killed mid-save (no cleanup runs) leaves only `<dir>.partial`, never `<dir>`."""
  path = str(tmp_path / "ck")
  code = textwrap.dedent(f"""
      import os, jax.numpy as jnp
      from kdtree_jax import orbax_io
      orbax_io._write_marker = lambda *a: os._exit(9)
      orbax_io.save_params({path!r}, {{"fc": jnp.ones((4, 4))}})
  """)
  assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False).returncode == 9
  assert not os.path.exists(path) and not orbax_io.is_orbax_dir(path + ".partial")
  assert os.path.isdir(os.path.join(path + ".partial", orbax_io.PARAMS_DIR))
  with pytest.raises(ValueError, match="interrupted save"):
    orbax_io.read_marker(path + ".partial")
  cfg, params = draft()
  orbax_io.save_params(path, params, draft_config=cfg)  # the stale .partial is cleaned up
  assert sorted(os.listdir(tmp_path)) == ["ck"]


def _convert(*args):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return subprocess.run([sys.executable, CONVERT, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_convert_end_to_end(tmp_path, fmt):
  cfg = C.tiny()
  hf = str(tmp_path / "hf")
  params = random_like(lambda: init_params(jax.random.key(0), cfg, jnp.float32))
  hf_writer.save_hf_checkpoint(hf, cfg, params, fmt=fmt)
  out = str(tmp_path / "orbax")
  extra = ["--int4_experts", "--mesh", MESH] if fmt == "int4" else []
  res = _convert("--hf_dir", hf, "--out_dir", out, "--dtype", "bfloat16", *extra)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "params " in res.stdout and "bytes " in res.stdout and "bfloat16" in res.stdout
  assert ("int4" in res.stdout) == (fmt == "int4")
  _, want = load_hf_checkpoint(hf, jnp.bfloat16, int4_experts=fmt == "int4")
  c = ml_collections.ConfigDict(dict(checkpoint=out, preset="", seed=0))
  tcfg, got = loader.load_target(c, jnp.bfloat16, sharding.make_mesh(MESH))
  assert tcfg == cfg
  assert_same(got, want)
  assert IS_INT4(got["layers"][1]["moe"]["down"]) == (fmt == "int4")
  want_sh = sharding.param_shardings(want, sharding.make_mesh(MESH))
  assert got["embed"].sharding.is_equivalent_to(want_sh["embed"], 2)
  assert isinstance(loader.make_tokenizer("auto", c), loader.ByteTokenizer)
  res = _convert("--hf_dir", hf, "--out_dir", out)
  assert res.returncode != 0 and "--overwrite" in res.stderr


@pytest.mark.slow
def test_convert_draft_and_errors(tmp_path):
  cfg, params = draft()
  hf, out = str(tmp_path / "hf"), str(tmp_path / "orbax")
  save_dflash_checkpoint(hf, cfg, params)
  res = _convert("--kind", "draft", "--hf_dir", hf, "--out_dir", out, "--dtype", "float32")
  assert res.returncode == 0, res.stderr[-3000:]
  c = ml_collections.ConfigDict(dict(checkpoint=out, preset="", seed=1))
  dcfg, got = loader.load_draft(c, C.tiny(), jnp.float32)
  assert dcfg == cfg
  assert_same(got, params)
  with pytest.raises(ValueError, match="holds a draft checkpoint"):
    loader.load_target(c, jnp.float32)
  for args, msg in ((["--hf_dir", str(tmp_path / "nope")], "does not exist"),
                    (["--hf_dir", str(tmp_path)], "no config.json"),
                    (["--hf_dir", hf], "pass --kind draft")):
    res = _convert(*args, "--out_dir", str(tmp_path / "o2"))
    assert res.returncode != 0 and msg in res.stderr, res.stderr[-2000:]
