"""scripts/gmm_ptxas_rows.py --variants, where the deviceless jax-cuda13 wheels are installed
(pip --target .deviceless): each given row compiles for an H200 and prints ptxas' register count
of both expert kernels; a down call with one accumulator chain needs fewer registers than with
two (the second chain's accumulators and dequantised chunks stay live beside the first's)."""

import os
import re
import subprocess
import sys

import pytest

from kdtree_jax import deviceless

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gmm_ptxas_rows.py")
HAVE_PLUGIN = os.path.isdir(os.path.join(deviceless.DEFAULT_PLUGIN_DIR, "jax_plugins"))
GATED = "once+ismem+p2c4+s2+cat+kpi+il+a2+r8"
DOWN = "once+ismem+cat+kpi+n128+s2+r8+w4"


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_PLUGIN, reason="jax-cuda13 wheels not installed in .deviceless")
def test_variants_print_both_kernels_registers():
  rows = [f"{GATED}|{DOWN}+a2", f"{GATED}|{DOWN}"]
  out = subprocess.run([sys.executable, SCRIPT, "--cases=16", f"--variants={','.join(rows)}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  regs = []
  for row in rows:
    line = next(l for l in out.stdout.splitlines() if l.startswith(f"T=16 {row}:"))
    found = dict(re.findall(r"(gmm_int4(?:_gated)?): (\d+)", line))
    assert set(found) == {"gmm_int4_gated", "gmm_int4"}, line
    regs.append({k: int(v) for k, v in found.items()})
  assert all(24 <= v <= 255 for r in regs for v in r.values()), regs
  assert regs[0]["gmm_int4_gated"] == regs[1]["gmm_int4_gated"]  # the same gated kernel
  assert regs[1]["gmm_int4"] < regs[0]["gmm_int4"], regs
