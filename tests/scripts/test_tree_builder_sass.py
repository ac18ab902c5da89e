"""scripts/tree_builder_sass.py on this CPU (needs the deviceless jax-cuda13 wheels in
.deviceless; skipped without them): one small builder program compiled for an H200, the `_kernel`
cubin found in XLA's kernel cache with its registers, frame and SASS counts."""

import os
import subprocess
import sys

import pytest

from kdtree_jax import deviceless

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.skipif(not os.path.isdir(os.path.join(deviceless.DEFAULT_PLUGIN_DIR, "jax_plugins")),
                    reason="no deviceless jax-cuda13 wheels in .deviceless")
def test_tree_builder_sass_rows():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "tree_builder_sass.py"), "--budgets", "3",
         "--num_warps", "4", "--depths", "3"]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["3"]]
  assert [r[:3] for r in rows] == [["3", "8", "4"]]                 # budget, Cp, warps
  regs, frame = int(rows[0][3]), int(rows[0][4])
  assert 0 < regs <= 255 and frame == 0
  if os.path.exists(os.path.join(deviceless.DEFAULT_PLUGIN_DIR, "nvidia")):
    assert int(rows[0][5]) > 100                                   # SASS instructions
