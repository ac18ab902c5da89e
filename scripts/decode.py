"""Decode with speculative decoding (ar | chain | ddtree): the shipped trained pair by default.

Examples:
  python scripts/decode.py                                  # k2tiny pair, ddtree, budget 32
  python scripts/decode.py --config.mode=chain --config.prompt="import os"
  python scripts/decode.py --config.temperature=0.8 --config.top_p=0.95 --json_out /tmp/out.json
  python scripts/decode.py --config configs/tiny.py --config.budget=16   # random tiny pair
  python scripts/decode.py --config.mesh=tensor=2,expert=4  # sharded over 8 devices

Every setting is a field of the config file (--config FILE[:preset], default configs/k2tiny.py),
set on the command line as --config.<field>=<value> (all fields: kdtree_jax/run_config.py):
  --config.mode=ddtree              ar: target alone; chain: draft block; ddtree: draft tree
  --config.budget=auto              DDTree nodes verified per step (>= 1), or auto: the program
                                    (chain, DDTree at a fixed width, or the per-step width switch)
                                    of most modelled tokens per second from the tables beside the
                                    config (the shipped pair's default); ddtree only
  --config.prompt="def f(x):"       prompt text
  --config.max_new_tokens=128       tokens to generate
  --config.temperature=0            0 = greedy; --config.top_p=1.0, --config.top_k=0 when > 0
  --config.seed=0                   sampling seed
  --config.dtype=float32            float32 (tokens equal ar exactly) | bfloat16
  --config.mesh=tensor=8            device mesh AXIS=N,... over data/expert/tensor ('' = one)
  --config.max_len=512              cache rows for prompt + new tokens (run stops there: max_len)
  --config.target.checkpoint=DIR    target checkpoint directory (HF or orbax)
  --config.draft.checkpoint=DIR     DFlash draft checkpoint directory (HF or orbax)
  --config.tokenizer=auto           auto | bytes | tiktoken
  --config.trained_positions=512    warn past the positions the target was trained on
  --config.memory_limit_gb=0        per-device memory checked before compiling (0 = the device's)

Prints the text, then one line: mode, budget (ddtree only), tokens, steps, mean tokens per step,
why it stopped (eos | max_new_tokens | max_len), decode tok/s and ms/step; compile time apart.
A mistake prints one `error:` line (exit 2: flag or config, 1: file or checkpoint); --verbose
adds the traceback and the INFO logs.
"""

import json
import os
import sys

from absl import flags
import jax

from kdtree_jax import cli, run_config, sharding
from kdtree_jax.decoding import auto_program, loop, step_cost
from kdtree_jax.decoding.sampling import SamplingConfig
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.loader import DTYPES, load_pair
from kdtree_jax import runtime_flags  # noqa: F401  (--compile_cache_dir, --command_buffers)

DEFAULT_CONFIG = os.path.join(cli.REPO_ROOT, "configs", "k2tiny.py")
_CONFIG = cli.define_config(DEFAULT_CONFIG, "Run config file (configs/*.py, FILE:preset); every "
                            "field can be overridden with --config.<field>=<value>.")
_JSON = flags.DEFINE_string("json_out", None, "Write every setting and result as JSON here.")
_STREAM = flags.DEFINE_integer("stream", 0, "Print text every N device steps (0: all at once). "
                               "Compiles first; tok/s counts the decode only.")


def _settings():
  """The run config (file, then --config.<field> overrides), validated."""
  c = cli.load_config(_CONFIG)
  if _STREAM.value < 0:
    raise cli.UsageError("stream", f"{_STREAM.value} is negative; 0 = no streaming, N >= 1 = "
                         "print every N device steps")
  out_dir = os.path.dirname(os.path.abspath(_JSON.value)) if _JSON.value else None
  if out_dir and not os.path.isdir(out_dir):
    raise cli.UsageError("json_out", f"directory {out_dir!r} does not exist; give a path in an "
                         "existing directory")
  if c.tokenizer == "none":
    raise cli.UsageError("tokenizer", "'none' cannot encode the prompt; use auto or bytes")
  return run_config.validate(c)


def _setting_warnings(c) -> list[str]:
  """Fields set on the command line that this run does not use, and what bfloat16 changes."""
  out = []
  if cli.overridden("budget") and c.mode != "ddtree":
    out.append(f"--config.budget applies to --config.mode=ddtree only; mode {c.mode} ignores it")
  for field in ("top_p", "top_k"):
    if cli.overridden(field) and c.temperature == 0:
      out.append(f"--config.{field} applies only when --config.temperature > 0 (greedy ignores "
                 "it)")
  if c.dtype == "bfloat16" and c.mode != "ar":
    out.append("bfloat16: tokens can differ from --config.mode=ar where argmaxes nearly tie "
               "(verifying N tokens at once rounds differently); float32 emits exactly the ar "
               "tokens")
  return out


def _mesh(c):
  sharding.initialize_distributed(cli.distributed_from_env())
  if not c.mesh:
    return None
  try:
    mesh = sharding.make_mesh(c.mesh)
  except ValueError as e:
    raise cli.UsageError("mesh", str(e)) from e
  print(f"mesh {dict(mesh.shape)}: {jax.device_count()} devices in {jax.process_count()} "
        f"process(es)")
  return mesh


def _stream(tokenizer, prompt, stream):
  """Prints the text as chunks of steps come back from the device; returns the result."""
  ids, shown, started = [], 0, False
  for delta in stream:
    if not started:  # compiled by now: the text starts after the progress lines
      print(prompt, end="", flush=True)
      started = True
    ids.extend(delta[0])
    text = tokenizer.decode(ids)
    print(text[shown:], end="", flush=True)
    shown = len(text)
  print()
  return stream.result


def _summary(c, spec, res, text):
  """Every setting of the run and its results (budget only where it applies)."""
  steps = len(res.accepted_per_step[0])
  return dict(
      mode=c.mode, budget=c.budget if c.mode == "ddtree" else None,
      block_size=spec.block_size if c.mode != "ar" else None, temperature=c.temperature,
      top_p=c.top_p, top_k=c.top_k, seed=c.seed, dtype=c.dtype, max_new_tokens=c.max_new_tokens,
      max_len=c.max_len, mesh=c.mesh, attn_backend=c.attn_backend,
      target=c.target.checkpoint or f"preset:{c.target.preset}",
      draft=c.draft.checkpoint or (f"preset:{c.draft.preset}" if c.draft.preset else None),
      prompt=c.prompt, tokens=res.tokens[0], text=text, stop_reason=res.stop_reasons[0],
      steps=steps, accepted_per_step=res.accepted_per_step[0],
      mean_accept_len=res.mean_accept_len, tokens_per_s=res.tokens_per_s,
      seconds=res.seconds, ms_per_step=1e3 * res.seconds / max(steps, 1),
      compile_seconds=res.compile_seconds, warmup_seconds=res.warmup_seconds,
      widths_per_step=res.widths_per_step or None,
      program=_program(spec) if c.mode == "ddtree" and c.budget == "auto" else None)


def _program(spec):
  """The program budget='auto' ran: chain, ddtree at one width, or the per-step switch."""
  if spec.mode != "ddtree":
    return spec.mode
  return "ddtree switch" if spec.budget == "auto" else f"ddtree {spec.budget}"


def _print_summary(s):
  budget = f" budget={s['budget']}" if s["budget"] is not None else ""
  budget += f" (ran {s['program']})" if s["program"] else ""
  print(f"\n--- mode={s['mode']}{budget} tokens={len(s['tokens'])} steps={s['steps']} "
        f"mean_accept_len={s['mean_accept_len']:.2f} stop_reason={s['stop_reason']} "
        f"tokens/s={s['tokens_per_s']:.1f} ms/step={s['ms_per_step']:.2f} "
        f"(decode only; compile {s['compile_seconds']:.1f} s, first run "
        f"{s['warmup_seconds']:.2f} s untimed)")


def main(argv):
  del argv
  c = _settings()
  mesh = _mesh(c)
  with cli.progress("loading the target and draft"):
    pair, tokenizer = load_pair(c, mesh)
  block = pair.dcfg.block_size if pair.dcfg is not None else 2
  auto = step_cost.auto_for_run(c, cli.config_path(), pair.tcfg, pair.dcfg) \
      if c.budget == "auto" and c.mode == "ddtree" else None
  spec = SpecConfig(mode=c.mode, budget=c.budget if c.mode == "ddtree" else SpecConfig.budget,
                    block_size=block,
                    max_new_tokens=c.max_new_tokens, attn_backend=c.attn_backend,
                    sampling=SamplingConfig(c.temperature, c.top_k, c.top_p), auto=auto)
  prompts = [tokenizer.encode(c.prompt)]
  spec = auto_program.for_run(spec, c, cli.config_path(), len(prompts[0]))  # auto: program
  warnings = _setting_warnings(c) + loop.length_warnings(pair.tcfg, spec, prompts, c.max_len,
                                                        c.trained_positions)
  for warning in warnings:
    print(f"warning: {warning}", file=sys.stderr, flush=True)
  args = (pair, spec, prompts)
  kw = dict(max_len=c.max_len, seed=c.seed, cache_dtype=DTYPES[c.dtype], mesh=mesh,
            memory_limit_gb=c.memory_limit_gb, progress=cli.progress)
  if _STREAM.value:
    res = _stream(tokenizer, c.prompt, loop.Stream(*args, **kw, chunk_steps=_STREAM.value))
  else:
    res = loop.generate(*args, **kw, warmup=True)
    print(c.prompt + tokenizer.decode(res.tokens[0]))
  summary = _summary(c, spec, res, tokenizer.decode(res.tokens[0]))
  _print_summary(summary)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(summary, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
