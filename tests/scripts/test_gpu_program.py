"""scripts/gpu_program.py and kdtree_jax.deviceless: what runs without the jax-cuda13 wheels (the
clear error), and, where the wheels are installed (pip --target .deviceless), the H200 program of
a 2- and 3-layer K2.6 share: the per-layer kernel count the tool prints matches an independent
count of the compiled while body's launch-like instructions."""

import os
import subprocess
import sys

import pytest

from kdtree_jax import deviceless

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_program.py")
HAVE_PLUGIN = os.path.isdir(os.path.join(deviceless.DEFAULT_PLUGIN_DIR, "jax_plugins"))


def test_missing_plugin_names_the_install_command(tmp_path):
  with pytest.raises(deviceless.DevicelessUnavailable, match="pip install --no-deps --target"):
    deviceless.h200(str(tmp_path))
  out = subprocess.run([sys.executable, SCRIPT, f"--plugin_dir={tmp_path}", "--modes=ar"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert out.returncode == 1, out.stderr[-2000:]
  assert "error: no jax-cuda13 plugin" in out.stderr and "jax-cuda13-pjrt==0.11.2" in out.stderr


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_PLUGIN, reason="jax-cuda13 wheels not installed in .deviceless")
def test_h200_ar_loop_kernels_per_layer(tmp_path):
  out_json = tmp_path / "k.jsonl"
  out = subprocess.run([sys.executable, SCRIPT, "--modes=ar", "--layers=2,3",
                        f"--json_out={out_json}", f"--dump_dir={tmp_path / 'dump'}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [__import__("json").loads(line) for line in out_json.read_text().splitlines()]
  assert [r["layers"] for r in rows] == [2, 3]
  # independent count: launch-like instructions of the largest while body in the dumped HLO
  counts = []
  for depth in (2, 3):
    folder = tmp_path / "dump" / f"ar_{depth}"
    hlo = max((p for p in folder.iterdir() if p.name.endswith("after_optimizations.txt")),
              key=lambda p: p.stat().st_size).read_text()
    counts.append(_body_launches(hlo))
  assert [r["kernels_per_iteration"] for r in rows] == counts
  assert rows[1]["kernels_per_layer"] == counts[1] - counts[0]
  assert "INSIDE a command buffer" in out.stdout  # the whole loop one CUDA graph


def _body_launches(hlo):
  """Launch-like instructions (fusion, custom-call, dot, sort, copy) in the largest computation
  that some while names as its body, read with plain string matching."""
  import re  # pylint: disable=import-outside-toplevel
  bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))
  best = 0
  for block in hlo.split("\n\n"):
    head = block.lstrip().split(" ", 1)[0].lstrip("%")
    if head in bodies:
      n = len(re.findall(r"= [^=]*? (fusion|custom-call|dot|convolution|sort|copy)\(", block))
      best = max(best, n)
  return best
