"""The results readers behind the notebooks' plots."""

import json

from kdtree_jax import plots


def test_read_jsonl_drops_measurements_that_did_not_complete(tmp_path):
  """A throughput row cut by its time box (status 'timeout', no ctx) is not a data point; ok
  rows and rows without a status are kept."""
  rows = [dict(kind="throughput", mode="ar", budget=None, status="timeout", seconds=6.7),
          dict(kind="throughput", mode="ddtree", ctx=46000, tokens_per_s=153.6, status="ok"),
          dict(kind="throughput", mode="chain", ctx=4096, tokens_per_s=200.0)]
  path = tmp_path / "run.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  got = plots.load([str(path)])["throughput"]
  assert [r["mode"] for r in got] == ["ddtree", "chain"]
