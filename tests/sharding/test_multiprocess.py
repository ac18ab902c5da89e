"""Two processes on this machine (4 CPU devices each, gloo collectives) form one 8-device mesh
through jax.distributed, the same way hosts of a multi-host GPU job do; decode.py must produce the
same tokens as one process with 8 devices and as one device (f32, trained pair, ddtree)."""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DECODE = os.path.join(ROOT, "scripts", "decode.py")
ARGS = ["--config.mode=ddtree", "--config.budget=16", "--config.max_new_tokens=24",
        "--config.dtype=float32"]


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(devices, **extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env.update(extra)
  return env


def _tokens(path):
  with open(path) as f:
    return json.load(f)["tokens"]


@pytest.mark.slow
def test_two_processes_decode_like_one(tmp_path):
  port = _free_port()
  procs = []
  for rank in range(2):
    env = _env(4, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(rank))
    cmd = [sys.executable, DECODE, *ARGS, "--config.mesh=tensor=2,expert=4",
           "--json_out", str(tmp_path / f"rank{rank}.json")]
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  for p in procs:
    log = p.communicate(timeout=900)[0]
    assert p.returncode == 0, log[-3000:]
    assert "8 devices in 2 process(es)" in log, log[-3000:]
  for name, devices, mesh in (("one_process", 8, ["--config.mesh=tensor=2,expert=4"]),
                              ("one_device", 1, ["--config.mesh="])):
    cmd = [sys.executable, DECODE, *ARGS, *mesh, "--json_out", str(tmp_path / f"{name}.json")]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(devices), capture_output=True, text=True,
                       timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
  want = _tokens(tmp_path / "one_device.json")
  assert len(want) == 24
  for name in ("rank0", "rank1", "one_process"):
    assert _tokens(tmp_path / f"{name}.json") == want, name
