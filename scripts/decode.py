"""Decode with speculative decoding (ar | chain | ddtree) on the shipped default or any config.

  python scripts/decode.py                                   # the shipped trained pair
  python scripts/decode.py --config configs/tiny.py --mode chain --prompt "import os"
  python scripts/decode.py --config.max_new_tokens=64 --json_out /tmp/out.json
  python scripts/decode.py --mesh tensor=2,expert=4     # sharded over 8 devices
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from kdtree_jax import sharding  # noqa: E402
from kdtree_jax.decoding.loop import Stream, generate  # noqa: E402
from kdtree_jax.decoding.sampling import SamplingConfig  # noqa: E402
from kdtree_jax.decoding.spec_config import SpecConfig  # noqa: E402
from kdtree_jax.models import DTYPES, load_models  # noqa: E402
from kdtree_jax import runtime_flags  # noqa: E402,F401  (--compile_cache_dir, --command_buffers)

DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "default.py")
_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Run config (configs/*.py).")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (default: the config's).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Tokens to generate.")
_MODE = flags.DEFINE_enum("mode", None, ["ar", "chain", "ddtree"], "Decoding mode.")
_BUDGET = flags.DEFINE_integer("budget", None, "DDTree node budget.")
_TEMP = flags.DEFINE_float("temperature", None, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", None, "Nucleus sampling mass.")
_TOP_K = flags.DEFINE_integer("top_k", None, "Top-k sampling (0 = off).")
_SEED = flags.DEFINE_integer("seed", None, "Sampling seed.")
_DTYPE = flags.DEFINE_enum("dtype", None, list(DTYPES), "Parameter and cache dtype.")
_JSON = flags.DEFINE_string("json_out", None, "Write a JSON summary here.")
_STREAM = flags.DEFINE_integer("stream", 0, "Print text every N device steps (0: all at once, "
                               "timed after a compile run; streamed timings include the compile "
                               "and one host sync per chunk).")
_MESH = flags.DEFINE_string("mesh", None, "Device mesh 'AXIS=N,...' over data/expert/tensor "
                            "(e.g. tensor=8, expert=8, tensor=2,expert=4); '' = one device.")


def _override(c):
  """Explicit flags win over the config file."""
  for flag, field in ((_PROMPT, "prompt"), (_MAX_NEW, "max_new_tokens"), (_MODE, "mode"),
                      (_BUDGET, "budget"), (_TEMP, "temperature"), (_TOP_P, "top_p"),
                      (_TOP_K, "top_k"), (_SEED, "seed"), (_DTYPE, "dtype")):
    if flag.value is not None:
      setattr(c, field, flag.value)
  return c


def _stream(tokenizer, prompt, stream):
  """Prints the text as chunks of steps come back from the device; returns the result."""
  print(prompt, end="", flush=True)
  ids, shown = [], 0
  for delta in stream:
    ids.extend(delta[0])
    text = tokenizer.decode(ids)
    print(text[shown:], end="", flush=True)
    shown = len(text)
  print()
  return stream.result


def main(argv):
  del argv
  c = _override(_CONFIG.value)
  sharding.maybe_initialize_distributed()
  mesh_spec = _MESH.value if _MESH.value is not None else c.get("mesh", "")
  mesh = sharding.make_mesh(mesh_spec) if mesh_spec else None
  if mesh is not None:
    print(f"mesh {dict(mesh.shape)}: {jax.device_count()} devices in {jax.process_count()} "
          f"process(es)")
  models = load_models(c, mesh)
  block = models.dcfg.block_size if models.dcfg is not None else 2
  spec = SpecConfig(mode=c.mode, budget=c.budget, block_size=block,
                    max_new_tokens=c.max_new_tokens, attn_backend=c.attn_backend,
                    sampling=SamplingConfig(c.temperature, c.top_k, c.top_p))
  prompt_ids = models.tokenizer.encode(c.prompt)
  cache_dtype = DTYPES[c.dtype]
  args = (models.tcfg, models.tparams, models.dcfg, models.dparams, spec, [prompt_ids])
  kw = dict(max_len=c.max_len, seed=c.seed, cache_dtype=cache_dtype, mesh=mesh)
  if _STREAM.value:
    res = _stream(models.tokenizer, c.prompt, Stream(*args, **kw, chunk_steps=_STREAM.value))
  else:
    generate(*args, **kw)  # compiles; the timed call below reuses the program
    res = generate(*args, **kw)
    print(c.prompt + models.tokenizer.decode(res.tokens[0]))
  text = models.tokenizer.decode(res.tokens[0])
  steps = len(res.accepted_per_step[0])
  print(f"\n--- mode={c.mode} budget={c.budget if c.mode == 'ddtree' else '-'} "
        f"tokens={len(res.tokens[0])} steps={steps} mean_accept_len={res.mean_accept_len:.2f} "
        f"tokens/s={res.tokens_per_s:.1f} ms/step={1e3 * res.seconds / max(steps, 1):.2f}")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump({"mode": c.mode, "budget": c.budget, "prompt": c.prompt, "tokens": res.tokens[0],
                 "text": text, "steps": steps, "accepted_per_step": res.accepted_per_step[0],
                 "mean_accept_len": res.mean_accept_len, "tokens_per_s": res.tokens_per_s,
                 "seconds": res.seconds}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
