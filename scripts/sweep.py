"""Benchmark sweep: budget x block size x context (x attention backend) for ar / chain / ddtree.

Random-weight bench configs with the fixed acceptance pattern (`forced_accept`): one compiled
device loop per (mode, budget, block size, backend); the context is data (cache lengths) in a
bench state sized for the largest context, as in scripts/bench_context_decode.py. Block size is
a draft-config property, so the draft config is rebuilt per block size (same params: the DFlash
weights do not depend on it). Tokens per step are read back from the loop (not assumed).

  python scripts/sweep.py --config configs/bench_tiny.py --budgets 4,16 --block_sizes 4,8 \
      --ctx 128,512 --json_out runs/sweep_cpu.jsonl
  python scripts/sweep.py --config configs/bench_k26.py --budgets 16,32,64,128 \
      --block_sizes 8,16 --ctx 4096,16384,46000 --attn_backend pallas,xla \
      --json_out runs/sweep.jsonl
"""

import dataclasses
import itertools
import json
import time

from absl import app, flags
import jax

from kdtree_jax import cli, profiling
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.loader import DTYPES, load_draft, load_target_for_decode
from kdtree_jax.pair import Pair
from kdtree_jax import forced_accept

_CONFIG = cli.define_config(None, "Bench config (configs/bench_*.py).")
_MODE = flags.DEFINE_list("mode", ["ar", "chain", "ddtree"], "Modes (ar: once; chain: per block).")
_BUDGETS = flags.DEFINE_list("budgets", ["8", "16", "32", "64"], "DDTree budgets.")
_BLOCKS = flags.DEFINE_list("block_sizes", ["4", "8", "16"], "Draft block sizes.")
_CTX = flags.DEFINE_list("ctx", ["1024", "4096", "16384"], "Context lengths.")
_BACKENDS = flags.DEFINE_list("attn_backend", None, "Verify attention backends (default: config).")
_FORCED = flags.DEFINE_integer("forced_accept", None, "Fixed acceptance (default: config).")
_GEN = flags.DEFINE_integer("gen", 16, "Steps per timed loop (time = slope over 4 vs 4 + gen).")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size.")
_JSON = flags.DEFINE_string("json_out", None, "JSON lines output (one line per point).")


def points(modes, budgets, blocks, backends):
  """(mode, budget, block, backend) combinations; budget only varies ddtree, block not ar."""
  out = []
  for backend, mode in itertools.product(backends, modes):
    if mode == "ar":
      out.append((mode, 1, blocks[0], backend))
    elif mode == "chain":
      out.extend((mode, 1, b, backend) for b in blocks)
    else:
      out.extend((mode, n, b, backend) for b in blocks for n in budgets)
  return out


def sweep_point(pair, spec, ctxs, dtype, batch, gen):
  """One compiled loop; one row per context (see profiling.time_contexts)."""
  t0 = time.perf_counter()
  rows = profiling.time_contexts(pair, spec, ctxs, dtype, batch, gen)
  return [dict(kind="sweep", **r, wall_s=time.perf_counter() - t0) for r in rows]


def main(_):
  c = cli.load_config(_CONFIG, "configs/bench_tiny.py (CPU) or configs/bench_k26.py (GPU)")
  dtype = DTYPES[c.dtype]
  tcfg, tp = load_target_for_decode(c.target, dtype)
  dcfg0, dp = load_draft(c.draft, tcfg, dtype)
  modes = list(_MODE.value)
  if dcfg0 is None and any(m != "ar" for m in modes):
    raise app.UsageError(f"modes {modes} need a draft; the config has none")
  forced = c.forced_accept if _FORCED.value is None else _FORCED.value
  backends = _BACKENDS.value or [c.attn_backend]
  blocks = [int(b) for b in _BLOCKS.value]
  ctxs = sorted(int(x) for x in _CTX.value)
  pts = points(modes, [int(b) for b in _BUDGETS.value], blocks, backends)
  print(f"device={jax.devices()[0].device_kind} layers={tcfg.num_hidden_layers} "
        f"batch={_BATCH.value} points={len(pts)} x ctx={ctxs}", flush=True)
  out = open(_JSON.value, "w") if _JSON.value else None  # pylint: disable=consider-using-with
  t_start = time.perf_counter()
  for i, (mode, budget, block, backend) in enumerate(pts):
    dcfg = None if dcfg0 is None else dataclasses.replace(dcfg0, block_size=block)
    spec = SpecConfig(mode=mode, budget=budget, block_size=block, max_new_tokens=4096,
                      attn_backend=backend, target_choice=forced_accept.target_choice(forced))
    t0 = time.perf_counter()
    for r in sweep_point(Pair(tcfg, tp, dcfg, dp), spec, ctxs, dtype, _BATCH.value, _GEN.value):
      print(f"[{i + 1}/{len(pts)}] {mode:>6} budget={r['budget'] or '-':>4} "
            f"block={r['block_size'] or '-':>3} {backend:>6} ctx={r['ctx']:>7}: "
            f"{r['ms_per_step']:8.3f} ms/step {r['accepted_per_step']:5.2f} tok/step "
            f"{r['tokens_per_s']:9.1f} tok/s", flush=True)
      if out:
        out.write(json.dumps(r) + "\n")
        out.flush()
    print(f"  ({time.perf_counter() - t0:.1f} s, {time.perf_counter() - t_start:.0f} s total)",
          flush=True)
  if out:
    out.close()


if __name__ == "__main__":
  cli.run(main)
