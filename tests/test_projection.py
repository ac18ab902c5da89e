"""The 8-GPU projection: the share's step read from a bench_k26_full.jsonl, the sum of parts."""

import json

from kdtree_jax import projection


def test_share_steps_reads_only_finished_cupti_step_rows(tmp_path):
  rows = [dict(kind="phases", mode="ar", budget=None, status="ok",
               rows=[dict(phase="verify", ms=9.0, timer="cupti"),
                     dict(phase="step", ms=12.0, timer="cupti")]),
          dict(kind="phases", mode="ddtree", budget=15, status="timeout", rows=[]),
          dict(kind="phases", mode="ddtree", budget=31, status="ok",
               rows=[dict(phase="step", ms=20.0, timer="wall")]),
          dict(kind="compile", mode="ar", seconds=30.0)]
  path = tmp_path / "bench.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  assert projection.share_steps(str(path)) == {("ar", None): 12.0}


def test_projected_step_adds_every_collective_at_the_measured_latency():
  p = projection.Projection("ddtree", 15, share_step_ms=10.0, collectives=141,
                            allreduce_us=20.0, gpus=2)
  assert abs(p.step_ms - (10.0 + 141 * 0.020)) < 1e-12
  assert "| ddtree | 15 | 10.00 | 141 | 20.0 (2) | 2.82 | 12.82 |" in projection.table([p])


def test_ddtree_pays_the_draft_collectives_once_per_step():
  ar = projection.collectives_per_step("ar", 61, 6)
  assert ar == 2 * 61 + 3
  assert projection.collectives_per_step("ddtree", 61, 6) - ar == 4 + 2 * 6
