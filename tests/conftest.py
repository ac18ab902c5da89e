"""Test setup: 8 simulated CPU devices (multi-device code is tested on CPU) and f32 matmuls."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_addoption(parser):
  parser.addoption("--gpu-full-grid", action="store_true", default=False,
                   help="tree-verify kernel: also run the full (N, H, L) GPU grid")
