"""Programmatic dependent launch (PDL) hooks of our Mosaic GPU kernels (`Tuning.pdl`).

A kernel body that calls `griddepcontrol.wait` gets Pallas' PDL effect, so its Mosaic module
carries `mosaic_gpu.uses_pdl` and XLA:GPU launches it with programmatic serialization (in the
decode loop's CUDA graph: programmatic edges from its kernel predecessors): its CTAs may start
while the previous kernel still runs. Everything a kernel reads that an earlier kernel of the
step produced must therefore come after `wait_for_producers`, which returns once every
prerequisite grid has completed and its memory operations are visible. `release_dependents`
lets the NEXT kernel launch early (during our epilogue); that is safe only because a kernel
launched with programmatic serialization waits in its own griddepcontrol.wait before reading
our outputs (notes/runtime.md, "PDL: who waits").

The GPU interpreter has no lowering for either instruction (jax 0.11.2: "MLIR translation rule
for primitive 'griddepcontrol_wait' not found for platform cpu"): in interpret mode both are
no-ops, so `pdl` changes nothing there (the interpreter runs kernels one after another).

The model turns it on by config (`TargetConfig.mosaic_pdl`): `transformer.decode` traces its
layers inside `model_default(cfg.mosaic_pdl)`, and the kernel APIs give a call whose tuning they
pick themselves (tuning=None) `pdl=True` there (`with_model_default`). It is read at trace time,
outside the kernels' jits (their Tuning is a static argument, so the jit caches key on it).
"""

import contextlib
import contextvars
import dataclasses

from jax.experimental.pallas import mosaic_gpu as plgpu

_MODEL_DEFAULT = contextvars.ContextVar("pallas_kernels_pdl_model_default", default=False)


@contextlib.contextmanager
def model_default(enabled: bool):
  """Within: kernel calls with an API-picked tuning get pdl=enabled (TargetConfig.mosaic_pdl)."""
  token = _MODEL_DEFAULT.set(bool(enabled))
  try:
    yield
  finally:
    _MODEL_DEFAULT.reset(token)


def model_default_on() -> bool:
  """Whether the innermost `model_default` scope turned pdl on (False outside any)."""
  return _MODEL_DEFAULT.get()


def with_model_default(tuning):
  """An API-picked tuning with pdl=True inside model_default(True), else unchanged."""
  return dataclasses.replace(tuning, pdl=True) if model_default_on() else tuning


def wait_for_producers(enabled: bool, interpret: bool):
  """griddepcontrol.wait where enabled (not in interpret mode): call before the first read of
  anything an earlier kernel produced."""
  if enabled and not interpret:
    plgpu.griddepcontrol_wait()


def release_dependents(enabled: bool, interpret: bool):
  """griddepcontrol.launch_dependents where enabled (not in interpret mode): call once the last
  input load is issued. The dependent grid launches when every CTA has called it or exited;
  repeated calls in one CTA are harmless (PTX ISA, griddepcontrol)."""
  if enabled and not interpret:
    plgpu.griddepcontrol_launch_dependents()
