"""Every mistake a first-time user makes ends in one `error:` line naming the flag / field / file,
exit status 2 (usage) or 1 (data), and no traceback; every run says why it stopped."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from kdtree_jax import cli
from kdtree_jax.decoding import loop, memory_bound
from kdtree_jax.decoding.spec_config import SpecConfig
from kdtree_jax.tokenizer import ByteTokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DECODE = os.path.join(ROOT, "scripts", "decode.py")
TINY = os.path.join(ROOT, "configs", "tiny.py")
SHIPPED_DRAFT = os.path.join(ROOT, "checkpoints", "k2tiny", "draft")


def decode(*args, timeout=240):
  """scripts/decode.py on one CPU device; (exit status, stdout, stderr)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, DECODE, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)
  return proc.returncode, proc.stdout, proc.stderr


def assert_one_line_error(result, status, named):
  """Exit status, no traceback, and the last stderr line is `error: ...` naming `named`."""
  code, _, err = result
  last = err.strip().splitlines()[-1]
  assert code == status, err[-2000:]
  assert "Traceback" not in err, err[-2000:]
  assert last.startswith("error: ") and named in last, last


@pytest.mark.parametrize("args,named", [
    (["--config.budget=0"], "--config.budget"),
    (["--config.budget=abc"], "--config.budget"),
    (["--config.mode=tree"], "--config.mode"),
    (["--config.top_p=1.5"], "--config.top_p"),
    (["--config.top_p=abc"], "--config.top_p"),
    (["--config.max_new_tokens=0"], "--config.max_new_tokens"),
    (["--config.bugdet=3"], "--config.bugdet"),
    (["--bugdet", "3"], "bugdet"),
    (["--config.mesh=tensor=3"], "--config.mesh"),
    (["import os"], "import os"),
])
def test_flag_values(args, named):
  assert_one_line_error(decode("--config", TINY, *args), 2, named)


def test_config_file():
  assert_one_line_error(decode("--config", "configs/no_such.py"), 2, "configs/no_such.py")


@pytest.mark.parametrize("args,named", [
    (["--config.ckpt=x"], "--config.ckpt"),
    (["--config", TINY, "--config.target.chekpoint=x"], "--config.target.chekpoint"),
    (["--config", TINY, "--config.dtype=float16"], "--config.dtype"),
    (["--config.max_len=4"], "--config.max_len"),
])
def test_config_field(args, named):
  assert_one_line_error(decode(*args), 2, named)


def test_checkpoint_file(tmp_path):
  """A truncated draft safetensors file is named, with what is wrong."""
  bad = tmp_path / "draft"
  bad.mkdir()
  shutil.copy(os.path.join(SHIPPED_DRAFT, "config.json"), bad / "config.json")
  with open(os.path.join(SHIPPED_DRAFT, "model.safetensors"), "rb") as f:
    (bad / "model.safetensors").write_bytes(f.read(5000))
  result = decode(f"--config.draft.checkpoint={bad}")
  assert_one_line_error(result, 1, str(bad / "model.safetensors"))
  assert "truncated" in result[2].splitlines()[-1]


@pytest.mark.parametrize("content", ["empty", "missing", "no_weights"])
def test_checkpoint_directory(tmp_path, content):
  path = tmp_path / "ckpt"
  if content != "missing":
    path.mkdir()
  if content == "no_weights":
    shutil.copy(os.path.join(SHIPPED_DRAFT, "config.json"), path / "config.json")
  result = decode(f"--config.draft.checkpoint={path}")
  assert_one_line_error(result, 1, str(path))
  assert "--config.draft.checkpoint" in result[2].splitlines()[-1]
  assert "tokenizer" not in result[2].splitlines()[-1]


def test_memory_bound_before_compiling():
  """budget 4096 needs 0.31 GB for one attention-score tensor [1, 4097, 4, 4672] f32: refused
  before compiling under a 0.2 GB limit (budget 100000 needs 161 GB: WORKSPACE.md)."""
  result = decode("--config.budget=4096", "--config.max_new_tokens=4",
                  "--config.memory_limit_gb=0.2")
  assert_one_line_error(result, 2, "--config.budget")
  last = result[2].splitlines()[-1]
  assert "GB per device" in last and "--config.memory_limit_gb is 0.20 GB" in last, last
  assert "compiling" not in result[2]


def test_stop_reason(tmp_path):
  """32 new tokens asked, the cache (max_len 40) fills first: said on screen and in the JSON;
  the budget given to an ar run is not recorded as if used."""
  max_len, reason = 40, "max_len"
  out = tmp_path / "out.json"
  code, stdout, err = decode("--config.mode=ar", "--config.budget=8", "--config.max_new_tokens=32",
                             f"--config.max_len={max_len}", "--json_out", str(out))
  assert code == 0 and "Traceback" not in err, err[-2000:]
  summary = json.loads(out.read_text())
  assert summary["stop_reason"] == reason
  assert f"stop_reason={reason}" in stdout.strip().splitlines()[-1]
  prompt_len = len(ByteTokenizer().encode(summary["prompt"]))
  # max_len cache rows hold the prompt and every new token but the last (emitted, not cached)
  assert len(summary["tokens"]) == max_len - prompt_len + 1
  assert summary["budget"] is None and summary["temperature"] == 0.0  # every setting recorded
  assert "warning:" in err and "--config.max_len 40" in err  # warned before decoding
  assert "--config.budget applies to --config.mode=ddtree only" in err  # a field it ignores


def test_stop_reason_and_capped_accepts_rules():
  eos = 7
  assert loop.stop_reason([1, 2, eos], eos, 8, 10, 100) == "eos"
  assert loop.stop_reason([1, 2, 3], eos, 3, 10, 100) == "max_new_tokens"
  assert loop.stop_reason([1, 2], eos, 8, 100, 100) == "max_len"
  # 1 token from the prefill, then steps of 5, 5, 5 accepted but only 8 more emitted
  assert loop.capped_accepts([5, 5, 5], 9) == [5, 3]
  assert loop.capped_accepts([2, 3], 6) == [2, 3]


def test_memory_bound_counts_the_largest_intermediate():
  def f(x_nd):
    s_nn = x_nd @ x_nd.T  # the largest intermediate: 300 x 300 f32 = 360 kB
    return s_nn.sum(axis=1)

  x = jnp.ones((300, 8), jnp.float32)
  bound = memory_bound.bound_of(jax.jit(f).trace(x), devices=1)
  assert bound.largest == 300 * 300 * 4
  assert bound.inputs == 300 * 8 * 4 and bound.outputs == 300 * 4
  assert bound.per_device == 300 * 8 * 4 + 300 * 300 * 4
  with pytest.raises(ValueError, match="budget"):
    memory_bound.check_fits(jax.jit(f).trace(x), 1, limit_gb=100e3 / 1e9, field="budget")


def test_memory_bound_counts_int4_packed_and_keys():
  """INT4 as XLA stores it on the GPU (two per byte: K2.6's experts), bf16 2 bytes, an odd INT4
  count rounded up, PRNG keys by their own itemsize."""
  leaves = [jax.ShapeDtypeStruct((48, 2048, 7168), jnp.int4),
            jax.ShapeDtypeStruct((3,), jnp.int4), jnp.zeros((5, 7), jnp.bfloat16),
            jax.random.key(0)]
  assert memory_bound.tree_bytes(leaves) == 48 * 2048 * 7168 // 2 + 2 + 5 * 7 * 2 + 8


def test_weights_that_cannot_fit_fail_before_allocating():
  weights = {"w": jax.ShapeDtypeStruct((1000, 1000), jnp.bfloat16)}  # 2 MB
  assert memory_bound.check_weights_fit(weights, "x", "y", limit_gb=1.0) == 2e6
  with pytest.raises(SystemExit, match=r"K2\.6 share needs 0\.002 GB .* is 0\.001 GB; use an H200"):
    memory_bound.check_weights_fit(weights, "the K2.6 share", "use an H200", limit_gb=1e-3)


def test_bench_pair_too_big_for_the_device_stops_before_allocating(monkeypatch):
  """K2.6's 61-layer one-GPU share (INT4 experts packed) on an H100's default 75% XLA pool: the
  error names the 77.7 GB it needs (target 76.2 + draft 1.4, counted here independently of the
  loader: 60 MoE layers x 48 experts x 3 INT4 [2048, 7168] matrices alone are 63.4 GB)."""
  from kdtree_jax import bench_setup  # pylint: disable=import-outside-toplevel
  c = cli.load_config_file(str(pathlib.Path(__file__).parents[2] / "configs" /
                               "bench_k26_full.py"))
  assert 60 * 48 * 3 * 2048 * 7168 / 2 / 1e9 == pytest.approx(63.4, abs=0.05)
  monkeypatch.setattr(memory_bound, "device_memory_bytes",
                      lambda limit_gb=0.0: (0.75 * 79.6e9, "NVIDIA H100 80GB HBM3 memory"))
  with pytest.raises(SystemExit, match=r"61-layer target \+ draft\) needs 77\.7 GB of weights "
                     r"alone, but NVIDIA H100 80GB HBM3 memory is 59\.7 GB; .*H200"):
    bench_setup.load_bench_pair(c, jnp.bfloat16, abstract=False)


def test_length_warnings_name_the_limit():
  """Past max_len (stops early) and past the trained positions (poor text): both said up front."""
  tcfg = type("Cfg", (), {"max_position_embeddings": 2048})()
  spec = SpecConfig(mode="ar", max_new_tokens=600)
  prompt = [[1] * 20]
  assert loop.length_warnings(tcfg, SpecConfig(mode="ar", max_new_tokens=100), prompt, 512,
                              512) == []
  (early,) = loop.length_warnings(tcfg, spec, prompt, 512, 0)
  assert "--config.max_len 512" in early and "at most 493 tokens" in early
  (past,) = loop.length_warnings(tcfg, spec, prompt, 1024, 512)
  assert "--config.trained_positions" in past and "positions up to 619" in past
  assert loop.length_warnings(tcfg, spec, prompt, 1024, 0) == []  # 619 <= the 2048 of config.json


def test_training_output_never_lands_in_shipped_checkpoints():
  shipped = os.path.join(ROOT, "checkpoints", "k2tiny", "target")
  with pytest.raises(ValueError, match="--write_checkpoints"):
    cli.refuse_shipped_output(shipped, "out_dir", "--write_checkpoints", allowed=False)
  cli.refuse_shipped_output(shipped, "out_dir", "--write_checkpoints", allowed=True)
  cli.refuse_shipped_output(os.path.join(ROOT, "runs", "k2tiny", "hf", "target"), "out_dir",
                            "--write_checkpoints", allowed=False)
  for preset in ("", ":cpu"):  # the shipped training configs write elsewhere
    train = cli.load_config_file(os.path.join(ROOT, "configs", f"k2tiny.py{preset}")).train
    for name, config in (("target", train.target), ("draft", train.draft)):
      assert not os.path.realpath(os.path.join(ROOT, config.out_dir)).startswith(
          os.path.join(ROOT, "checkpoints")), (preset, name)


@pytest.mark.slow
def test_budget_auto_says_which_program_ran(tmp_path):
  """budget=auto on the shipped pair: the summary line and the JSON name the program that ran
  (here chain: configs/k2tiny.step_cost.json, measured on the H200, charges chain 0.41 ms per
  step for 3.98 tokens, ~1.7x the modelled tok/s of any DDTree program) and the tokens are the
  `ar` run's (f32)."""
  out, ref = tmp_path / "auto.json", tmp_path / "ar.json"
  code, stdout, err = decode("--config.budget=auto", "--config.max_new_tokens=16",
                             "--json_out", str(out))
  assert code == 0 and "Traceback" not in err, err[-2000:]
  assert "budget=auto (ran chain)" in stdout.strip().splitlines()[-1]
  summary = json.loads(out.read_text())
  assert summary["program"] == "chain"
  code, _, err = decode("--config.mode=ar", "--config.max_new_tokens=16", "--json_out", str(ref))
  assert code == 0, err[-2000:]
  assert summary["tokens"] == json.loads(ref.read_text())["tokens"]
