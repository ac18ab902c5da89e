"""HF checkpoint formats: FP8 / INT4 / sharded / K2.5 wrapper load exactly; bad input fails clearly."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kdtree_jax
from kdtree_jax.target import config as C
from kdtree_jax.checkpoint import safetensors_io
from kdtree_jax.target import hf_writer
from kdtree_jax.target import params as P

QUANT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "quant")


def rel(a, b):
  return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", ["fp8_k2", "int4_k25"])
def test_quantized_fixture_matches_transformers(name):
  """transformers' logits on the dequantised weights (scripts/make_quant_fixtures.py)."""
  cfg, params = kdtree_jax.load_hf_checkpoint(os.path.join(QUANT, name))
  ref = np.load(os.path.join(QUANT, name, "reference.npz"))
  logits = kdtree_jax.forward(cfg, params, ref["tokens"])
  assert rel(logits, ref["logits"]) < 1e-4


def _numpy_dequant_dir(src, dst):
  """Independent numpy dequantisation of every FP8 / INT4 tensor, written as a plain f32 ckpt."""
  with open(os.path.join(src, "config.json")) as f:
    conf = json.load(f)
  text = conf.get("text_config", conf)
  qc = text.pop("quantization_config")
  ckpt = safetensors_io.CheckpointDir(src)
  out = {}
  for name in ckpt.keys():
    w = np.asarray(ckpt.get(name))
    if name.endswith("_scale_inv") or name.endswith(("weight_scale", "weight_shape")):
      continue
    if name.endswith("weight_packed"):
      base = name[:-len("_packed")]
      scale = np.asarray(ckpt.get(base + "_scale")).astype(np.float32)
      g = qc["config_groups"]["group_0"]["weights"]["group_size"]
      words = w.view(np.uint32)
      vals = np.zeros((w.shape[0], w.shape[1] * 8), np.float32)
      for col in range(vals.shape[1]):
        vals[:, col] = ((words[:, col // 8] >> (4 * (col % 8))) & 15).astype(np.float32) - 8
      out[base] = vals * np.repeat(scale, g, axis=1)
    elif w.dtype == ml_dtypes.float8_e4m3fn:
      s = np.asarray(ckpt.get(name + "_scale_inv"))
      bs = qc["weight_block_size"]
      wf = w.astype(np.float32)
      for i in range(wf.shape[0]):
        for j in range(wf.shape[1]):
          wf[i, j] *= s[i // bs[0], j // bs[1]]
      out[name] = wf
    else:
      out[name] = w.astype(np.float32)
  os.makedirs(dst)
  safetensors_io.save_file(out, os.path.join(dst, "model.safetensors"))
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(conf, f)


@pytest.mark.parametrize("name", ["fp8_k2", "int4_k25"])
def test_quantized_load_equals_numpy_dequantised(name, tmp_path):
  _numpy_dequant_dir(os.path.join(QUANT, name), str(tmp_path / "deq"))
  cfg_q, p_q = kdtree_jax.load_hf_checkpoint(os.path.join(QUANT, name))
  cfg_d, p_d = kdtree_jax.load_hf_checkpoint(str(tmp_path / "deq"))
  assert cfg_q == cfg_d
  tokens = np.load(os.path.join(QUANT, name, "reference.npz"))["tokens"]
  a, b = kdtree_jax.forward(cfg_q, p_q, tokens), kdtree_jax.forward(cfg_d, p_d, tokens)
  assert rel(a, np.asarray(b)) < 1e-5


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
  cfg = C.tiny()
  params = P.init_params(jax.random.key(0), cfg, jnp.float32, std=0.1)
  path = str(tmp_path_factory.mktemp("ckpt") / "tiny")
  hf_writer.save_hf_checkpoint(path, cfg, params, fmt="float32", num_shards=3)
  return cfg, params, path


def _copy(src, tmp_path):
  dst = str(tmp_path / "copy")
  shutil.copytree(src, dst)
  return dst


def test_round_trip_all_formats(tiny_ckpt, tmp_path):
  cfg, params, path = tiny_ckpt
  _, loaded = kdtree_jax.load_hf_checkpoint(path)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(a, b)
  for fmt in ("bfloat16", "fp8", "int4"):
    p = str(tmp_path / fmt)
    hf_writer.save_hf_checkpoint(p, cfg, params, fmt=fmt, num_shards=2)
    cfg2, _ = kdtree_jax.load_hf_checkpoint(p)
    assert cfg2 == cfg


def test_truncated_safetensors(tiny_ckpt, tmp_path):
  d = _copy(tiny_ckpt[2], tmp_path)
  f = os.path.join(d, "model-00002-of-00003.safetensors")
  with open(f, "r+b") as fh:
    fh.truncate(os.path.getsize(f) - 100)
  with pytest.raises(ValueError, match="truncated"):
    kdtree_jax.load_hf_checkpoint(d)


def test_shard_missing_from_index(tiny_ckpt, tmp_path):
  d = _copy(tiny_ckpt[2], tmp_path)
  os.remove(os.path.join(d, "model-00003-of-00003.safetensors"))
  with pytest.raises(FileNotFoundError, match="model-00003-of-00003"):
    kdtree_jax.load_hf_checkpoint(d)


def _rewrite(d, fn):
  """Applies fn(dict of tensors) to every shard and rewrites the index."""
  index = os.path.join(d, "model.safetensors.index.json")
  with open(index) as f:
    wm = json.load(f)["weight_map"]
  new_map = {}
  for fname in sorted(set(wm.values())):
    path = os.path.join(d, fname)
    f = safetensors_io.SafetensorsFile(path)
    tensors = fn({k: np.array(f.get(k)) for k in f.keys()})
    safetensors_io.save_file(tensors, path)
    new_map.update({k: fname for k in tensors})
  with open(index, "w") as f:
    json.dump({"weight_map": new_map}, f)


@pytest.mark.parametrize("edit,err,match", [
    (lambda t: {k.replace("kv_b_proj", "kv_bb_proj"): v for k, v in t.items()}, ValueError,
     "missing .*kv_b_proj"),
    (lambda t: {k: (v[:-1] if "q_b_proj" in k else v) for k, v in t.items()}, ValueError,
     "q_b_proj.weight' has shape"),
    (lambda t: {k: (v.astype(np.int32) if "o_proj" in k else v) for k, v in t.items()},
     ValueError, "stored as I32"),
    (lambda t: {**t, "model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)}
     if any("layers.0." in k for k in t) else t, ValueError, "unexpected weight"),
])
def test_bad_weights(tiny_ckpt, tmp_path, edit, err, match):
  d = _copy(tiny_ckpt[2], tmp_path)
  _rewrite(d, edit)
  with pytest.raises(err, match=match):
    kdtree_jax.load_hf_checkpoint(d)


def test_unknown_quant_method_and_model_type(tiny_ckpt, tmp_path):
  d = _copy(tiny_ckpt[2], tmp_path)
  cfg_path = os.path.join(d, "config.json")
  with open(cfg_path) as f:
    conf = json.load(f)
  with open(cfg_path, "w") as f:
    json.dump(dict(conf, quantization_config={"quant_method": "gptq"}), f)
  with pytest.raises(ValueError, match="unknown quant_method 'gptq'"):
    kdtree_jax.load_hf_checkpoint(d)
  with open(cfg_path, "w") as f:
    json.dump(dict(conf, model_type="llama"), f)
  with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
    kdtree_jax.load_hf_checkpoint(d)


def test_interrupted_write_leaves_no_checkpoint(tiny_ckpt, tmp_path, monkeypatch):
  cfg, params, _ = tiny_ckpt
  calls = []

  def failing_save(tensors, path, metadata=None):
    calls.append(path)
    if len(calls) == 2:
      raise KeyboardInterrupt("simulated interruption")
    return safetensors_io.save_file(tensors, path, metadata)

  monkeypatch.setattr(hf_writer, "save_file", failing_save)
  target = str(tmp_path / "out")
  with pytest.raises(KeyboardInterrupt):
    hf_writer.save_hf_checkpoint(target, cfg, params, num_shards=3)
  assert not os.path.exists(target)
  assert not os.path.exists(os.path.join(target, "config.json"))
