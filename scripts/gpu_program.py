"""The H200's decode-loop program, compiled on a machine WITHOUT a GPU (kdtree_jax.deviceless):
kernels per step, by source line, and what became CUDA graphs, before any device time is spent.

For each mode, bench_k26_full's device loop (`loop.steps_device`, the program the throughput rows
time) is lowered on abstract weights for a compile-only H200 and compiled by XLA:GPU's own
compiler. Printed per mode: the kernel-like instructions of one loop iteration (= CUPTI's kernels
per step on the H200 up to autotuning's GEMM choices), their kinds, and the kernels grouped by the
source line that made them (one row per op of a layer: `x61` = once per target layer). With
`--layers A,B` (B > A, both >= 2) each mode is compiled at both depths and the per-layer
difference is printed too. Use it to check a change removes the kernels it means to (and that a
new GPU part compiles) before a GPU A/B:

  pip install --no-deps --target .deviceless jax-cuda13-pjrt==0.11.2 jax-cuda13-plugin==0.11.2
  python scripts/gpu_program.py --modes ar,ddtree --layers 3,4
  python scripts/gpu_program.py --modes ar --layers 3,4 --target_fields fold_norm_weights=true
  python scripts/gpu_program.py --modes ar --options xla_gpu_command_buffer_scheduling_mode=LHS

Compile on 2 CPU cores: ~10-20 s per program at 3-4 layers, ~40-60 s at 61.
"""

import collections
import json
import os
import re
import sys
import tempfile
import time

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kdtree_jax import deviceless  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "bench_k26_full.py"),
    "Bench config (any field: --config.bench.tree_impl=pallas, as in every script).")
_MODES = flags.DEFINE_list("modes", ["ar", "ddtree"], "Loop modes (ddtree at --budget).")
_BUDGET = flags.DEFINE_integer("budget", None, "DDTree budget (default: the config's bench.budget).")
_LAYERS = flags.DEFINE_list("layers", [], "Target depths to compile (default: the config's); two "
                            "depths A < B print the per-layer difference (B - A) / (B - A).")
_FIELDS = flags.DEFINE_list("target_fields", [], "TargetConfig fields 'name=value' set on the "
                            "packed target (pack-time fields applied, pack.apply_pack_fields: "
                            "fold_norm_weights=true folds, int4_k_interleaved=true pair-packs "
                            "the experts).")
_OPTIONS = flags.DEFINE_list("options", [], "XLA compiler options 'name=value' added to the "
                             "run's command-buffer options.")
_NO_GRAPHS = flags.DEFINE_bool("no_command_buffers", False, "Compile without command buffers.")
_TOP = flags.DEFINE_integer("top", 30, "Rows of the by-source listing.")
_JSON = flags.DEFINE_string("json_out", None, "Writes one JSON line per (mode, depth) here.")
_DUMP = flags.DEFINE_string("dump_dir", None, "Keep XLA's dumps (HLO, thunk sequences) here, "
                            "one folder per mode and depth (default: a temporary folder).")
_PLUGIN = flags.DEFINE_string("plugin_dir", deviceless.DEFAULT_PLUGIN_DIR, "Where the "
                              "jax-cuda13 wheels are installed (pip --target).")


def _value(text):
  """An XLA option's value: bool, int, float or the text."""
  low = text.lower()
  if low in ("true", "false"):
    return low == "true"
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return text


def _config(layers):
  """The run config (command-line overrides applied) at `layers` target layers if given."""
  c = _CONFIG.value.copy_and_resolve_references()
  if layers:
    c.target.layers = int(layers)
  return c


def _compiler_options(dump):
  from kdtree_jax import runtime  # pylint: disable=import-outside-toplevel
  opts = {"xla_dump_to": dump} if _NO_GRAPHS.value else runtime.command_buffer_options(dump)
  for item in _OPTIONS.value:
    name, _, text = item.partition("=")
    opts[name] = _value(text)
  opts.setdefault("xla_gpu_autotune_level", 0)  # nothing to autotune on
  return opts


def compile_loop(target, c, mode, dump):
  """(compiled loop executable, seconds to lower, seconds to compile) of one mode."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from kdtree_jax.bench_setup import bench_spec, load_bench_pair  # pylint: disable=import-outside-toplevel
  from kdtree_jax.bench_state import bench_state  # pylint: disable=import-outside-toplevel
  from kdtree_jax.decoding import loop  # pylint: disable=import-outside-toplevel
  from kdtree_jax.loader import DTYPES  # pylint: disable=import-outside-toplevel
  from kdtree_jax.pair import Pair  # pylint: disable=import-outside-toplevel
  from kdtree_jax import throughput  # pylint: disable=import-outside-toplevel
  from kdtree_jax.config_overrides import with_overrides  # pylint: disable=import-outside-toplevel
  from kdtree_jax.target.pack import apply_pack_fields  # pylint: disable=import-outside-toplevel
  dtype = DTYPES[c.dtype]
  spec = bench_spec(c, mode, _BUDGET.value)
  t0 = time.time()
  with deviceless.gpu_kernels():
    tcfg, tp, dcfg, dp = load_bench_pair(c, dtype, abstract=True)
    if _FIELDS.value:
      tcfg = with_overrides(tcfg, _FIELDS.value, "--target_fields")
      tp = jax.eval_shape(lambda p: apply_pack_fields(tcfg, p), tp)
    state = jax.eval_shape(lambda: bench_state(
        tcfg, dcfg, spec, 1, max(c.bench.ctxs), dtype,
        steps=throughput.loop_state_steps(c.bench.gen)))
    pair = Pair(tcfg, deviceless.on(target, tp), dcfg, deviceless.on(target, dp))
    lowered = loop.steps_device.lower(pair, deviceless.on(target, state),
                                      deviceless.on(target, jnp.int32(0)), spec=spec)
  t1 = time.time()
  exe = lowered.compile(compiler_options=_compiler_options(dump))
  return exe, t1 - t0, time.time() - t1, tcfg.num_hidden_layers


_NUMBERED = re.compile(r"[._]\d+\b")


def by_source(hlo_text, top):
  """[(count, description)] of the loop body's kernel-like instructions grouped by what they
  are and where they come from (HloIndex.describe without instruction numbers)."""
  from kdtree_jax import profiling_hlo  # pylint: disable=import-outside-toplevel
  index = profiling_hlo.HloIndex(hlo_text)
  body = _loop_body(index)
  counts = collections.Counter()
  for instr in index.comps.get(body, ()):
    if instr.opcode in ("fusion", "custom-call", "dot", "convolution", "sort", "copy"):
      text = index.describe(instr.name) or f"{instr.opcode} {instr.type}"
      counts[_NUMBERED.sub("", text)] += 1
  return counts.most_common(top), sum(counts.values())


def _loop_body(index):
  """The largest while body (the decode loop's)."""
  bodies = [m.group(1) for i in index.instr.values() if i.opcode == "while"
            for m in [re.search(r"body=%([\w.\-]+)", i.attrs)] if m]
  if not bodies:
    raise ValueError("the compiled program has no while loop")
  return max(bodies, key=lambda b: len(index.comps.get(b, ())))


def report(mode, layers, exe, lower_s, compile_s, dump):
  """Prints and returns one compiled loop's kernels per iteration, its graphs (from XLA's thunk
  dump) and the kernels by source."""
  from kdtree_jax import profiling_hlo  # pylint: disable=import-outside-toplevel
  rows, per_iter = by_source(exe.as_text(), _TOP.value)
  print(f"\n== {mode} at {layers} layers (H200, deviceless): lower {lower_s:.1f} s, compile "
        f"{compile_s:.1f} s; {per_iter} kernel-like instructions per loop iteration "
        f"({per_iter / layers:.1f} per target layer)", flush=True)
  with tempfile.TemporaryDirectory() as keep:
    thunks = profiling_hlo.collect_thunk_dump(dump, keep, mode)
  if thunks:
    print(profiling_hlo.format_thunk_report(thunks, f"{mode} loop"))
  print(f"  count  kernel: out <- operands (jax op) [fused ops] @ source (per iteration; "
        f"{layers} = once per target layer)")
  for text, n in rows:
    print(f"  {n:5d}  {text[:220]}")
  return dict(mode=mode, layers=layers, kernels_per_iteration=per_iter, lower_s=lower_s,
              compile_s=compile_s, thunks=thunks, by_source=rows)


def main(_):
  try:
    target = deviceless.h200(_PLUGIN.value)
  except deviceless.DevicelessUnavailable as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  depths = _LAYERS.value or [None]
  results = []
  for mode in _MODES.value:
    for depth in depths:
      c = _config(depth)
      with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(_DUMP.value or tmp, f"{mode}_{depth}")
        exe, lower_s, compile_s, layers = compile_loop(target, c, mode, dump)
        results.append(report(mode, layers, exe, lower_s, compile_s, dump))
    if len(depths) == 2:
      a, b = results[-2], results[-1]
      per_layer = (b["kernels_per_iteration"] - a["kernels_per_iteration"]) / (
          b["layers"] - a["layers"])
      print(f"\n{mode}: {per_layer:.1f} kernels per target layer ({b['layers']} - "
            f"{a['layers']} layers)")
      results[-1]["kernels_per_layer"] = per_layer
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      for r in results:
        f.write(json.dumps(r) + "\n")
  return 0


if __name__ == "__main__":
  app.run(main)
