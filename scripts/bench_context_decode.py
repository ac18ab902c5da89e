"""Decode throughput vs context length for ar / chain / ddtree, plus the phase table.

Random-weight bench configs (configs/bench_k26.py) use a fixed acceptance pattern
(`forced_accept`); trained checkpoints accept for real only in scripts/eval_acceptance.py.
The cache holds random rows at the given context (no prefill), which does not change timing.

  python scripts/bench_context_decode.py --config configs/bench_k26.py \
      --ctx 4096,16384,46000,131072 --mode ar,chain,ddtree --gen 32 --profile_ctx 46000 \
      --json_out runs/ctx.jsonl --plot_out runs/ctx.png
"""

import json

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from kdtree_jax import plots, profiling, roofline, runtime  # noqa: E402
from kdtree_jax.decoding.spec_config import SpecConfig  # noqa: E402
from kdtree_jax.loader import DTYPES, load_draft, load_target_for_decode  # noqa: E402
from kdtree_jax.pair import Pair  # noqa: E402
from kdtree_jax import forced_accept

_CONFIG = config_flags.DEFINE_config_file("config", None, "Bench config (configs/bench_*.py).")
_CTX = flags.DEFINE_list("ctx", ["1024", "4096", "16384", "46000", "131072"], "Context lengths.")
_MODE = flags.DEFINE_list("mode", ["ar", "chain", "ddtree"], "Modes.")
_BUDGET = flags.DEFINE_integer("budget", None, "DDTree budget (default: config).")
_GEN = flags.DEFINE_integer("gen", 32, "Steps per timed loop.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size.")
_PROFILE_CTX = flags.DEFINE_integer("profile_ctx", 0, "Also print the phase table here (0: no).")
_PROFILE_MODES = flags.DEFINE_list("profile_modes", ["ddtree"], "Modes of the phase table.")
_TRACE = flags.DEFINE_string("trace_dir", None, "Write a jax.profiler trace of the fused loop.")
_JSON = flags.DEFINE_string("json_out", None, "JSON lines output.")
_PLOT = flags.DEFINE_string("plot_out", None, "Throughput vs context plot (PNG).")
runtime.define_flags()


def _spec(c, mode, gen):
  budget = (_BUDGET.value or c.budget) if mode == "ddtree" else SpecConfig.budget
  return SpecConfig(mode=mode, budget=budget, block_size=c.block_size, max_new_tokens=4096,
                    attn_backend=c.attn_backend,
                    target_choice=forced_accept.target_choice(c.forced_accept))


def plot(rows, path):
  """Throughput vs context per mode (kdtree_jax.plots)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(6, 4))
  plots.plot_throughput(ax, [dict(r, source=jax.devices()[0].device_kind) for r in rows])
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(_):
  c = _CONFIG.value
  dtype = DTYPES[c.dtype]
  tcfg, tp = load_target_for_decode(c.target, dtype)
  dcfg, dp = load_draft(c.draft, tcfg, dtype)
  pair = Pair(tcfg, tp, dcfg, dp)
  dev = jax.devices()[0]
  rows = []
  out = open(_JSON.value, "w") if _JSON.value else None  # pylint: disable=consider-using-with
  print(f"device={dev.device_kind} layers={tcfg.num_hidden_layers} batch={_BATCH.value}", flush=True)
  if _PROFILE_CTX.value:
    ceil = roofline.measure_ceilings(small=jax.default_backend() == "cpu")
    print(f"ceilings: copy {ceil['copy_tbps']:.2f} TB/s, matmul {ceil['mm_tflops']:.0f} TFLOP/s")
    for mode in _PROFILE_MODES.value:
      spec = _spec(c, mode, _GEN.value)
      state = profiling.bench_state(tcfg, dcfg, spec, _BATCH.value, _PROFILE_CTX.value, dtype)
      prow = profiling.profile_step(pair, spec, state, ceil)  # consumes state
      print(f"\n== phase table: mode={mode} ctx={_PROFILE_CTX.value}\n"
            + profiling.format_table(prow), flush=True)
      if out:
        out.write(json.dumps(dict(kind="phases", mode=mode, ctx=_PROFILE_CTX.value, ceil=ceil,
                                  rows=profiling.as_dicts(prow))) + "\n")
        out.flush()
      if _TRACE.value and mode == _PROFILE_MODES.value[-1]:
        state = profiling.bench_state(tcfg, dcfg, spec, _BATCH.value, _PROFILE_CTX.value, dtype)
        profiling.trace_loop(pair, spec, state, _TRACE.value)
  ctxs = [int(x) for x in _CTX.value]
  for mode in _MODE.value:
    spec = _spec(c, mode, _GEN.value)
    for r in profiling.time_contexts(pair, spec, ctxs, dtype, _BATCH.value, _GEN.value):
      rows.append(r)
      print(f"ctx={r['ctx']:>7} {mode:>6}: {r['ms_per_step']:8.3f} ms/step "
            f"{r['accepted_per_step']:5.2f} tok/step {r['tokens_per_s']:9.1f} tok/s  "
            f"kernels/step={r['kernel_us']} us gap/step={r['host_gap_us']} us", flush=True)
      if out:
        out.write(json.dumps(dict(kind="throughput", **r)) + "\n")
        out.flush()
  if _PLOT.value:
    plot(rows, _PLOT.value)
  print(f"\n{'ctx':>7} {'mode':>6} {'ms/step':>9} {'tok/step':>8} {'tok/s':>9} {'gap us':>8}")
  for r in rows:
    gap = "-" if r["host_gap_us"] is None else f"{r['host_gap_us']:.1f}"
    print(f"{r['ctx']:>7} {r['mode']:>6} {r['ms_per_step']:9.3f} {r['accepted_per_step']:8.2f} "
          f"{r['tokens_per_s']:9.1f} {gap:>8}")


if __name__ == "__main__":
  app.run(main)
