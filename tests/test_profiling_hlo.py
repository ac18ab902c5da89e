"""Launch structure from optimised HLO: two matmuls of one input are found as one group (the
q_a / kv_a pattern); a matmul of another input is not in it."""

import jax
import jax.numpy as jnp

from kdtree_jax import profiling_hlo


def _hlo():
  def f(x, a, b, c):
    y = jnp.sin(x)
    return jnp.tanh(y @ a) @ c, y @ b
  shapes = [(16, 64), (64, 32), (64, 8), (32, 4)]
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  return jax.jit(f).lower(*args).compile().as_text()


def test_matmuls_sharing_an_input_are_grouped():
  s = profiling_hlo.launch_structure(_hlo())
  assert s["matmuls"] == 3 and s["kernels"] >= 3
  assert s["shared"] == [(1, ["f32[16,32]", "f32[16,8]"])]
  text = profiling_hlo.format_structure(s, 1, "f")
  assert "save 1 launches" in text


def test_parse_reads_tuple_types_and_operands():
  hlo = """HloModule m

ENTRY %main (p: f32[4]) -> (f32[4], s8[0]) {
  %p = f32[4]{0} parameter(0)
  ROOT %cc = (f32[4]{0}, s8[0]{0}) custom-call(%p, %p), custom_call_target="__cublas$gemm"
}
"""
  comps = profiling_hlo.parse(hlo)
  cc = comps["main"][1]
  assert (cc.name, cc.opcode, cc.operands) == ("cc", "custom-call", ["p", "p"])
  assert cc.type == "(f32[4], s8[0])"
  s = profiling_hlo.launch_structure(hlo)
  assert s["matmuls"] == 1 and s["shared"] == []
