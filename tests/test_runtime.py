"""runtime: command buffers on by default (XLA_FLAGS says so, the minimum graph size 1), off by config; the per-program
option set that turns them on is one XLA accepts."""
import os
import subprocess
import sys

import jax
import pytest
import jax.numpy as jnp

from kdtree_jax import runtime

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def test_default_is_on_and_replaces_an_earlier_value():
  assert runtime.RuntimeConfig().command_buffers is True
  flags = runtime.xla_flags_with("--xla_foo=1 --xla_gpu_enable_command_buffer=FUSION", False)
  assert flags.split() == ["--xla_foo=1", "--xla_gpu_enable_command_buffer="]
  on = runtime.xla_flags_with("--xla_gpu_graph_min_graph_size=5 "
                              "--xla_gpu_command_buffer_scheduling_mode=LHS", True).split()
  assert on == [f"--xla_gpu_enable_command_buffer={runtime.COMMAND_BUFFER_TYPES}",
                "--xla_gpu_graph_min_graph_size=1",
                "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"]
  assert runtime.xla_flags_with("", True, "LHS").split()[-1] == (
      "--xla_gpu_command_buffer_scheduling_mode=LHS")


def test_scheduling_mode_is_checked():
  assert runtime.RuntimeConfig().command_buffer_scheduling == "CONCURRENT"
  with pytest.raises(ValueError, match="command_buffer_scheduling"):
    runtime.RuntimeConfig(command_buffer_scheduling="concurrent")


def _setup_in_a_fresh_process(*args):
  code = ("import os; from absl import app; from kdtree_jax import runtime\n"
          "runtime.define_flags()\n"
          "def main(_):\n"
          "  print(os.environ['XLA_FLAGS'], runtime.command_buffers_on())\n"
          "app.run(main)\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  out = subprocess.run([sys.executable, "-c", code, "--compile_cache_dir=", *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120, check=True)
  return out.stdout.split()


def test_scripts_default_to_command_buffers():
  on = [f"--xla_gpu_enable_command_buffer={runtime.COMMAND_BUFFER_TYPES}",
        "--xla_gpu_graph_min_graph_size=1", "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT",
        "True"]
  assert _setup_in_a_fresh_process() == on
  assert _setup_in_a_fresh_process("--command_buffers") == on
  lhs = _setup_in_a_fresh_process("--command_buffer_scheduling=LHS")
  assert lhs == on[:2] + ["--xla_gpu_command_buffer_scheduling_mode=LHS", "True"]
  assert _setup_in_a_fresh_process("--nocommand_buffers") == [
      "--xla_gpu_enable_command_buffer=", "False"]


def test_command_buffer_options_compile():
  lowered = jax.jit(lambda x: 2 * x).lower(jnp.ones(3))
  exe = lowered.compile(compiler_options=runtime.COMMAND_BUFFER_OPTIONS)
  assert float(exe(jnp.ones(3))[0]) == 2.0


def test_command_buffer_options_with_a_dump_folder(tmp_path):
  """The A/B option set with XLA's dump: the same command-buffer types, and XLA writes the
  compile's files into the folder (on a GPU among them the thunk sequence after the
  command-buffer conversion; a CPU compile has no thunk dump, and reading one finds none)."""
  from kdtree_jax import profiling_hlo  # pylint: disable=import-outside-toplevel
  opts = runtime.command_buffer_options(str(tmp_path))
  assert opts == dict(runtime.COMMAND_BUFFER_OPTIONS, xla_dump_to=str(tmp_path))
  assert runtime.command_buffer_options() == runtime.COMMAND_BUFFER_OPTIONS
  lowered = jax.jit(lambda x: 3 * x).lower(jnp.ones(3))
  exe = lowered.compile(compiler_options=opts)
  assert float(exe(jnp.ones(3))[0]) == 3.0
  assert any(f.endswith("after_optimizations.txt") for f in os.listdir(tmp_path))
  assert profiling_hlo.thunk_dumps(str(tmp_path)) == []
