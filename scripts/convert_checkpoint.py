"""Converts a HF target checkpoint (bf16/f32/FP8/INT4) or a DFlash draft to an orbax checkpoint.

  python scripts/convert_checkpoint.py --hf_dir /ckpt/Kimi-K2.6 --out_dir /ckpt/k26-orbax \
      --dtype bfloat16 --int4_experts --mesh tensor=8
  python scripts/convert_checkpoint.py --kind draft --hf_dir /ckpt/K2.6-DFlash \
      --out_dir /ckpt/draft-orbax
The output (kdtree_jax/orbax_io.py) is read by configs' `checkpoint` like a HF dir,
restored straight onto the mesh. Tokenizer files next to config.json are copied along.
"""

import glob
import json
import os
import time

from absl import app, flags

from kdtree_jax import cli, sharding
from kdtree_jax import orbax_io
from kdtree_jax.target.checkpoint import default_put, load_hf_checkpoint
from kdtree_jax.draft.checkpoint import load_dflash_checkpoint
from kdtree_jax.loader import DTYPES

_HF_DIR = flags.DEFINE_string("hf_dir", None, "HF checkpoint dir (config.json + safetensors).")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Orbax checkpoint directory to write.")
_KIND = flags.DEFINE_enum("kind", "target", ["target", "draft"], "Target model or DFlash draft.")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", list(DTYPES), "Stored dtype of the weights.")
_INT4 = flags.DEFINE_bool("int4_experts", False, "Keep INT4 routed experts packed (Int4Weight).")
_MESH = flags.DEFINE_string("mesh", "", "Load sharded over 'AXIS=N,...' (e.g. tensor=8); "
                            "'' = one device.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --out_dir.")

TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def check_dirs(hf_dir: str, out_dir: str, overwrite: bool):
  """Clear errors for a missing / invalid input directory or an existing output directory."""
  if not os.path.isdir(hf_dir):
    raise app.UsageError(f"--hf_dir {hf_dir!r} does not exist")
  if not os.path.isfile(os.path.join(hf_dir, "config.json")):
    raise app.UsageError(f"--hf_dir {hf_dir!r} has no config.json: not a HF checkpoint directory")
  if not glob.glob(os.path.join(hf_dir, "*.safetensors")):
    raise app.UsageError(f"--hf_dir {hf_dir!r} has no *.safetensors files")
  if os.path.abspath(out_dir) == os.path.abspath(hf_dir):
    raise app.UsageError("--out_dir must differ from --hf_dir")
  if os.path.exists(out_dir) and not overwrite:
    raise app.UsageError(f"--out_dir {out_dir!r} already exists; pass --overwrite to replace it")


def _is_draft_config(hf_dir: str) -> bool:
  with open(os.path.join(hf_dir, "config.json")) as f:
    raw = json.load(f)
  return "dflash_config" in raw or any("DFlash" in a for a in raw.get("architectures") or [])


def load(hf_dir, kind, dtype, mesh, int4_experts):
  """(config, params) of the HF checkpoint, placed on `mesh` (or the default device)."""
  if kind == "draft":
    if int4_experts:
      raise app.UsageError("--int4_experts applies to targets only (drafts have no routed experts)")
    cfg, params = load_dflash_checkpoint(hf_dir, dtype=dtype)
    if mesh is not None:
      params = sharding.shard(params, sharding.param_shardings(params, mesh))
    return cfg, params
  if _is_draft_config(hf_dir):
    raise app.UsageError(f"{hf_dir!r} holds a DFlash draft config; pass --kind draft")
  put = default_put(dtype) if mesh is None else sharding.loader_put(mesh, dtype)
  return load_hf_checkpoint(hf_dir, dtype, put=put, progress=True, int4_experts=int4_experts)


def format_summary(s: dict, load_s: float, save_s: float) -> str:
  total = sum(s["dtypes"].values())
  hist = ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(s["dtypes"].items()))
  return (f"params {s['num_params']:,} ({s['num_params'] / 1e9:.3f} B) | bytes {s['bytes']:,} "
          f"({s['bytes'] / 2**30:.3f} GiB) | dtypes (share of stored values): {hist} | "
          f"load {load_s:.1f} s, save {save_s:.1f} s")


def main(argv):
  del argv
  if not _HF_DIR.value or not _OUT_DIR.value:
    raise app.UsageError("--hf_dir and --out_dir are required")
  check_dirs(_HF_DIR.value, _OUT_DIR.value, _OVERWRITE.value)
  sharding.initialize_distributed(cli.distributed_from_env())
  mesh = sharding.make_mesh(_MESH.value) if _MESH.value else None
  dtype = DTYPES[_DTYPE.value]
  t0 = time.perf_counter()
  cfg, params = load(_HF_DIR.value, _KIND.value, dtype, mesh, _INT4.value)
  t1 = time.perf_counter()
  extra = [os.path.join(_HF_DIR.value, n) for n in TOKENIZER_FILES]
  extra = [p for p in extra if os.path.isfile(p)]
  kw = {"config": cfg} if _KIND.value == "target" else {"draft_config": cfg}
  out = orbax_io.save_params(_OUT_DIR.value, params, extra_files=extra, **kw)
  t2 = time.perf_counter()
  print(f"wrote {_KIND.value} {out}\n" + format_summary(orbax_io.summary(params), t1 - t0, t2 - t1))


if __name__ == "__main__":
  cli.run(main)
