"""Launch structure from optimised HLO: two matmuls of one input are found as one group (the
q_a / kv_a pattern); a matmul of another input is not in it."""

import inspect
import os

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


_LOOP_HLO = """HloModule m

%fused_neg (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%command_buffer (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %f = f32[4]{0} fusion(%p0), kind=kLoop, calls=%fused_neg
}

%command_buffer.1 (p1: f32[4]) -> f32[4] {
  %p1 = f32[4]{0} parameter(0)
  ROOT %f1 = f32[4]{0} fusion(%p1), kind=kLoop, calls=%fused_neg
}

%body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%s), index=1
  %c = f32[4]{0} call(%x), to_apply=%command_buffer
  %k = f32[4]{0} custom-call(%c), custom_call_target="mosaic_gpu_v2"
  %k2 = f32[4]{0} custom-call(%k), custom_call_target="mosaic_gpu_v2"
  %c2 = f32[4]{0} call(%k2), to_apply=%command_buffer.1
  %i = s32[] get-tuple-element(%s), index=0
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %c2)
}

%cond (s2: (s32[], f32[4])) -> pred[] {
  %s2 = (s32[], f32[4]{0}) parameter(0)
  %i2 = s32[] get-tuple-element(%s2), index=0
  %lim = s32[] constant(4)
  ROOT %lt = pred[] compare(%i2, %lim), direction=LT
}

ENTRY %main (a: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = (s32[], f32[4]{0}) parameter(0)
  ROOT %w = (s32[], f32[4]{0}) while(%a), condition=%cond, body=%body
}
"""


def test_command_buffer_report_host_driven_loop():
  """A loop whose body is two graphs split by two Mosaic custom calls: host-driven, 2 graph
  launches per iteration, the custom calls named as what runs outside the graphs."""
  rep = profiling_hlo.command_buffer_report(_LOOP_HLO)
  assert rep["command_buffers"] == 2
  (w,) = rep["whiles"]
  assert w["name"] == "w" and not w["in_command_buffer"]
  assert w["graph_calls"] == 2 and w["outside"] == {"custom-call mosaic_gpu_v2": 2}
  assert "host-driven" in profiling_hlo.format_command_buffers(rep, "loop")


def test_command_buffer_report_loop_inside_a_graph():
  """The same loop moved into a command buffer (XLA's WHILE command): reported as captured."""
  text = _LOOP_HLO.replace("ENTRY %main", "%command_buffer.2").replace(
      "ROOT %w", "ROOT %w") + """
ENTRY %main2 (a2: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a2 = (s32[], f32[4]{0}) parameter(0)
  ROOT %cw = (s32[], f32[4]{0}) call(%a2), to_apply=%command_buffer.2
}
"""
  (w,) = profiling_hlo.command_buffer_report(text)["whiles"]
  assert w["in_command_buffer"]


def _concat_program(x, y):
  z = jnp.concatenate([jnp.sin(x), y], axis=-1)
  return z * 2  # the fusion's root: the line its kernel is named after


def test_kernel_ops_names_the_fusion_its_ops_and_source_line():
  """A CPU-compiled program: a kernel name's instruction (XLA:GPU's '_N' for '.N' too) is
  described by its result <- operand types, jax op_name, fused ops and the source line."""
  x = jnp.ones((4, 3), jnp.float32)
  text = jax.jit(_concat_program).lower(x, x).compile().as_text()
  line = inspect.getsourcelines(_concat_program)[1] + 2
  (name,) = [n for n, i in profiling_hlo.HloIndex(text).instr.items() if i.opcode == "fusion"]
  got = profiling_hlo.kernel_ops(text, [(name, 1.0, 5.0)], top=1)[name]
  assert got.startswith("f32[4,6] <- f32[4,3] f32[4,3] (jit(_concat_program)/mul)"), got
  assert "[sine,concatenate,multiply]" in got, got
  caller = "test_kernel_ops_names_the_fusion_its_ops_and_source_line"  # the frame above it
  assert f"@ test_profiling_hlo.py:{line} _concat_program <- test_profiling_hlo.py:" in got, got
  assert got.endswith(caller), got
  rows = profiling_hlo.kernel_listing(text, [(name, 1.0, 5.0), ("body_mosaic_gpu_kernel", 61.0,
                                                                900.0)])
  assert [r[:4] for r in rows] == [(900.0, 61.0, 1, "body_mosaic_gpu_kernel"),
                                   (5.0, 1.0, 1, name)]
  assert "_concat_program" in profiling_hlo.format_listing(rows, "verify")


def test_kernel_listing_groups_the_layers_copies_of_one_op():
  """Two instances with the same description (one per layer in a real model) are one row."""
  text = _hlo()
  index = profiling_hlo.HloIndex(text)
  name = next(n for n, i in index.instr.items() if i.opcode in ("dot", "fusion"))
  rows = profiling_hlo.kernel_listing(text, [(name, 1.0, 2.0), (name, 1.0, 3.0)])
  assert [r[:3] for r in rows] == [(5.0, 2.0, 2)]


# ---- thunk_report: XLA's thunk dump, printed here by the rules of XLA's ToString methods ----
def _seq(thunks, indent, ids=True):
  """SequentialThunk::ToString: '<indent>NNN: kKind<pad>\\t<thunk's ToString(indent + 1)>\\n'
  (ThunkSequence's older form has no 'NNN: ' ids)."""
  width = max(len(t[0]) for t in thunks)
  out = ""
  for i, t in enumerate(thunks):
    out += "  " * indent + (f"{i:03d}: " if ids else "") + t[0].ljust(width) + "\t"
    out += _thunk(t, indent + 1, ids) + "\n"
  return out


def _thunk(t, indent, ids):
  kind = t[0]
  if kind == "kCommandBuffer":  # CommandBufferThunk::ToString: "\n" + thunks->ToString(+1)
    return "\n" + _seq(t[1], indent + 1, ids)
  if kind == "kWhile":  # WhileThunk::ToString
    pad = "  " * indent
    return (pad + "\ncondition:\n" + _seq(t[1], indent + 1, ids) + pad + "body:\n"
            + _seq(t[2], indent + 1, ids))
  if kind == "kKernel":
    return "kernel=loop_fusion_1, launch dimensions=blocks: {1, 1, 1}, cluster_dim=nullopt"
  return ""


K, CC = ("kKernel",), ("kCustomCall",)


def test_thunk_report_host_driven_loop_split_by_unconvertible_thunks():
  """The body's graphs end at a custom call and a memset; the loop itself stays on the host."""
  loop = ("kWhile", [K], [("kCommandBuffer", [K] * 5), CC,
                          ("kCommandBuffer", [K, K, ("kCopy",)]), ("kMemzero",), K])
  for ids in (True, False):
    text = _seq([("kCommandBuffer", [K] * 3), loop], 0, ids)
    rep = profiling_hlo.thunk_report(text)
    assert rep["command_buffers"] == 3 and rep["thunks"] == 19, rep  # 3 graphs, 1 while, 15 ops
    assert rep["top"] == dict(graphs=1, thunks_in_graphs=3, outside={"kWhile": 1})
    (w,) = rep["whiles"]
    assert not w["in_command_buffer"] and w["depth"] == 0
    assert w["body"] == dict(graphs=2, thunks_in_graphs=8,
                             outside={"kCustomCall": 1, "kMemzero": 1, "kKernel": 1})
    assert w["condition"]["outside"] == {"kKernel": 1}
    text = profiling_hlo.format_thunk_report(rep, "ddtree_cmdbuf loop")
    assert "host-driven): per iteration 2 graph launches of 8 thunks" in text, text
    assert "kCustomCall 1, kMemzero 1, kKernel 1" in text, text


def test_thunk_report_loop_inside_one_graph():
  """XLA's WHILE command: the whole loop under one kCommandBuffer, nothing per iteration."""
  loop = ("kWhile", [K], [K, CC, ("kWhile", [K], [K])])
  rep = profiling_hlo.thunk_report(_seq([("kCommandBuffer", [K, loop])], 0))
  assert rep["command_buffers"] == 1 and rep["top"]["outside"] == {}
  assert [(w["depth"], w["in_command_buffer"]) for w in rep["whiles"]] == [(0, True), (1, True)]
  assert "INSIDE a command buffer" in profiling_hlo.format_thunk_report(rep, "loop")


def test_hlo_without_command_buffers_says_it_cannot_tell():
  """An optimised HLO with no command_buffer computation (all jax 0.11.2 gives): no verdict."""
  rep = profiling_hlo.command_buffer_report(_LOOP_HLO.replace("%command_buffer", "%cb"))
  assert rep["command_buffers"] == 0
  text = profiling_hlo.format_command_buffers(rep, "loop")
  assert "host-driven" not in text and "not visible in the HLO" in text, text


def test_collect_thunk_dump_reads_the_loop_module_and_keeps_its_files(tmp_path):
  """The largest after-conversion dump is the compile's own module (autotuning's are small);
  its thunk files are copied out under the label, other modules' and other dumps are not."""
  dump, out = tmp_path / "dump", tmp_path / "out"
  dump.mkdir()
  out.mkdir()
  loop = ("kWhile", [K], [("kCommandBuffer", [K] * 5), CC, K])
  big = _seq([("kCommandBuffer", [K] * 3), loop], 0)
  (dump / f"module_0042.jit_steps.{profiling_hlo.THUNK_DUMP_SUFFIX}").write_text(big)
  (dump / "module_0042.jit_steps.thunk_sequence.txt").write_text("before")
  (dump / "module_0042.jit_steps.after_optimizations.txt").write_text("HLO")
  (dump / f"module_0007.jit_small.{profiling_hlo.THUNK_DUMP_SUFFIX}").write_text(_seq([K], 0))
  rep = profiling_hlo.collect_thunk_dump(str(dump), str(out), "ddtree_cmdbuf")
  assert rep["dump"].startswith("module_0042") and rep["whiles"][0]["body"]["graphs"] == 1
  assert sorted(os.listdir(out)) == [
      "thunks_ddtree_cmdbuf.thunk_sequence.txt",
      f"thunks_ddtree_cmdbuf.{profiling_hlo.THUNK_DUMP_SUFFIX}"]
  assert profiling_hlo.collect_thunk_dump(str(out / "none"), str(out), "x") is None


def test_collect_thunk_dump_without_a_conversion_reads_the_thunks_as_emitted(tmp_path):
  """XLA writes no after-conversion dump when it formed no command buffer (e.g. a program of a
  kernel and a while: 2 thunks, under xla_gpu_graph_min_graph_size): the thunks as emitted are
  read instead, reported as not converted, the loop host-driven."""
  loop = ("kWhile", [K], [K, CC, ("kCopy",)])
  (tmp_path / "module_0001.jit_steps.thunk_sequence.txt").write_text(_seq([K, loop], 0))
  rep = profiling_hlo.collect_thunk_dump(str(tmp_path), str(tmp_path), "ar_cmdbuf")
  assert not rep["converted"] and rep["command_buffers"] == 0
  assert rep["whiles"][0]["body"]["outside"] == {"kKernel": 1, "kCustomCall": 1, "kCopy": 1}
  assert "XLA formed NO command buffer" in profiling_hlo.format_thunk_report(rep, "ar_cmdbuf")
  assert (tmp_path / "thunks_ar_cmdbuf.thunk_sequence.txt").exists()


# jax 0.11.2's XLA:GPU prints thunks this way (the layout of a deviceless compile's dump of the
# decode loop, shortened): ids, kind, the dependency columns, then the kernel.
_JAX_0_11_2_DUMP = """000: kCommandBuffer [source | sink] 
    001: kCustomKernel [source       | next=002 (1)] loop_minimum_fusion grid: [1, 1, 1]
    002: kWhile        [prev=001 (1) | sink        ]       
condition:
        003: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1]
      body:
        004: kCustomKernel [source         | next=005 (1) ] gemm_fusion_dot_49 grid: [7168, 1, 1]
        005: kCustomCall   [prev=004 (1)   | next=006 (1) ] 
        006: kCopy         [prev=005 (1)   | sink         ] kCopy
"""


def test_thunk_report_reads_jax_0_11_2_dump_layout():
  rep = profiling_hlo.thunk_report(_JAX_0_11_2_DUMP)
  assert rep["command_buffers"] == 1 and rep["top"]["thunks_in_graphs"] == 6
  (w,) = rep["whiles"]
  assert w["in_command_buffer"] and w["condition"]["outside"] == {"kCustomKernel": 1}
  assert w["body"]["outside"] == {"kCustomKernel": 1, "kCustomCall": 1, "kCopy": 1}


# Rows of real listings (H100, s26_k26_core.log: the DDTree 15 and ar verify of a 32-layer
# K2.6 share), each with the group a reader gives it from its shapes, ops and source line.
_LISTING_ROWS = [
    ("gmm_int4_gated_mosaic_gpu_kernel", "gmm_int4_gated_mosaic_gpu_kernel (no HLO instruction "
     "of this name)", "experts"),
    ("body_mosaic_gpu_kernel", "body_mosaic_gpu_kernel (no HLO instruction of this name)",
     "attention"),
    ("tree_verify_swap_mosaic_gpu_kernel", "tree_verify_swap_mosaic_gpu_kernel (no HLO "
     "instruction of this name)", "attention"),
    ("_merge_kernel_loads_first", "_merge_kernel_loads_first (no HLO instruction of this name)",
     "attention"),
    ("input_reduce_fusion_32", "u32[3,128] <- pred[1,16,16] (jit(_verify)/jit(tree_verify_"
     "attention_mgpu)/reduce_sum) [pad,convert,transpose,iota,shift-left,reduce] @ masks.py:37 "
     "tree_mask_words <- api.py:84 tree_verify_attention_mgpu", "attention"),
    ("gemm_fusion_dot_291", "f32[8,16,2112] <- bf16[16,8,896] bf16[2112,8,896] "
     "(jit(_verify)/dot_general) [dot] @ pack.py:140 dot_t <- mla.py:40 input_dots", "dense dots"),
    ("nvjet_sm90_tst_192x8_64x8_4x1_v_bz_NNT", "nvjet_sm90_tst_192x8_64x8_4x1_v_bz_NNT (no HLO "
     "instruction of this name)", "dense dots"),
    ("input_reduce_fusion_160", "bf16[7168] <- bf16[7168,1024] bf16[8,128] (jit(_verify)/"
     "dot_general) [multiply,convert,reduce] @ pack.py:140 dot_t <- mla.py:165 out_proj",
     "dense dots"),
    ("loop_reduce_fusion_32", "bf16[16,2112] <- f32[8,16,2112] (jit(_verify)/dot_general) "
     "[reduce,convert] @ pack.py:140 dot_t <- mla.py:40 input_dots", "split-K sums"),
    ("loop_reduce_fusion_31", "bf16[1,2112] <- f32[8,1,2112] () [reduce,convert]",
     "split-K sums"),
    ("input_reduce_fusion_93", "f32[] <- bf16[7168] bf16[1,7168] bf16[7168] bf16[20480,7168] "
     "s32[1] (jit(_verify)/reduce_sum) [compare,add,select,dynamic-slice,convert,multiply,"
     "reduce] @ norm.py:19 inv_rms <- norm.py:10 rms_norm", "glue"),
    ("input_reduce_fusion_63", "s32[224] <- s32[16,8] (jit(_verify)/reduce_sum) [compare,and,"
     "select,multiply,iota,add,concatenate,convert,reduce] @ experts.py:68 _pair_counts", "glue"),
    ("loop_convert_fusion", "bf16[128,2048] <- bf16[2,128,2048] bf16[2,128,2048] "
     "bf16[2,128,2048] bf16[2,128,2048] s32[224] (jit(_verify)/convert_element_type) [convert,"
     "add,iota,slice,compare,select,gather,negate,exponential,divide,multiply]", "glue"),
    ("_route_kernel", "_route_kernel (no HLO instruction of this name)", "glue"),
    ("draft_ctx_attention", "draft_ctx_attention (no HLO instruction of this name)", "draft"),
]


def test_kernel_group_of_real_listing_rows():
  for example, key, group in _LISTING_ROWS:
    assert profiling_hlo.kernel_group(example, key) == group, (example, key)


def test_group_totals_sum_the_listing_by_group():
  rows = [(10.0 * (i + 1), 2.0, 1, example, key) for i, (example, key, _) in
          enumerate(_LISTING_ROWS)]
  totals = profiling_hlo.group_totals(rows)
  want = {}
  for (us, n, _, _, _), (_, _, group) in zip(rows, _LISTING_ROWS):
    want[group] = (want.get(group, (0.0, 0.0))[0] + us, want.get(group, (0.0, 0.0))[1] + n)
  assert totals == want
  assert list(totals) == [g for g in profiling_hlo.KERNEL_GROUPS if g in want]
  line = profiling_hlo.format_groups(rows, "kernels of verify by group")
  assert line.startswith("kernels of verify by group: ms (launches) experts 0.010 (2), ")
