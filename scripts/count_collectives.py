"""Collectives per step of the compiled decode loop on 8 simulated CPU devices (small config).

Compiles the loop of models of 2 and 4 target layers (the first dense, the rest MoE) for each
mesh and mode; (count(4) - count(2)) / 2 is the per-target-layer count (the once-per-step part
-- embedding, sampling, the draft -- cancels), and prints where each collective comes from.

  .venv/bin/python scripts/count_collectives.py "tensor=8" "tensor=2,expert=4"
"""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))

from test_collectives import breakdown, decode_loop_hlo, loop_total  # noqa: E402


def main(mesh_specs):
  for mesh_spec in mesh_specs:
    for mode in ("ar", "ddtree"):
      deep, shallow = (decode_loop_hlo(mesh_spec, mode, n) for n in (4, 2))
      a, b = loop_total(deep), loop_total(shallow)
      print(f"{mesh_spec} {mode}: loop {a} at 4 target layers, {b} at 2 -> {(a - b) / 2} per "
            f"target layer\n  kind          source                       4L  2L\n"
            f"{breakdown(deep, shallow)}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:] or ["tensor=8", "tensor=2,expert=4"])
