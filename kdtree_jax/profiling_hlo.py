"""Launch structure of a compiled program, read from its optimised HLO text: which instructions
become kernels, which of them are matmuls, and which matmuls read the same input (launches that
one wider matmul could replace, e.g. MLA's q_a and kv_a projections of the same normed x).

Kernel-like instructions = `fusion`, `custom-call` and unfused `dot` instructions of the
computations that are not fusion bodies (a fusion body runs inside its fusion's kernel). A
matmul = an unfused dot, a fusion whose body holds a `dot`, or a custom call whose target names
a GEMM (cuBLAS).
"""

import collections
import dataclasses
import math
import os
import re
import shutil

_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OPERAND = re.compile(r"%([\w.\-]+)")
_BACKEND_KIND = re.compile(r'"fusion_backend_config":\{.*?"kind":"([^"]+)"')
_CUSTOM_FUSION_NAME = re.compile(r'"custom_fusion_config":\{.*?"name":"([^"]+)"')


@dataclasses.dataclass
class Instr:
  name: str
  type: str
  opcode: str
  operands: list
  attrs: str


def _split_rhs(rhs: str):
  """(type, opcode, operands text, attrs) of an instruction's right-hand side."""
  if rhs.startswith("("):  # tuple type: up to its matching parenthesis
    depth = 0
    for i, ch in enumerate(rhs):
      depth += (ch == "(") - (ch == ")")
      if depth == 0:
        break
    typ, rest = rhs[:i + 1], rhs[i + 1:].lstrip()
  else:
    typ, _, rest = rhs.partition(" ")
  opcode, _, rest = rest.partition("(")
  depth, i = 1, 0
  for i, ch in enumerate(rest):
    depth += (ch == "(") - (ch == ")")
    if depth == 0:
      break
  return typ, opcode.strip(), rest[:i], rest[i + 1:]


def parse(hlo_text: str) -> dict:
  """{computation name: [Instr]} of an HLO module's text."""
  comps, current = {}, None
  for line in hlo_text.splitlines():
    head = _HEADER.match(line)
    if head and " = " not in line.split("{")[0]:
      current = comps.setdefault(head.group(2), [])
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      typ, opcode, ops, attrs = _split_rhs(m.group(2))
      current.append(Instr(m.group(1), re.sub(r"\{[^}]*\}", "", typ), opcode,
                           _OPERAND.findall(ops), attrs))
  return comps


def _fusion_bodies(comps) -> set:
  return {c for instrs in comps.values() for i in instrs if i.opcode == "fusion"
          for c in _CALLS.findall(i.attrs)}


def _is_matmul(instr: Instr, comps) -> bool:
  if instr.opcode in ("dot", "convolution"):
    return True
  if instr.opcode == "custom-call":
    target = _TARGET.search(instr.attrs)
    return bool(target) and any(k in target.group(1).lower() for k in ("gemm", "matmul"))
  if instr.opcode == "fusion":
    return any(j.opcode in ("dot", "convolution") or _is_matmul(j, comps)
               for c in _CALLS.findall(instr.attrs) for j in comps.get(c, ()))
  return False


def launch_structure(hlo_text: str) -> dict:
  """{kernels: count of kernel-like instructions, by_kind: {fusion kind / custom-call target:
  count}, matmuls: count, shared: [(count, member result types, input)] of matmul groups that
  read one input, most frequent signature first}."""
  comps = parse(hlo_text)
  bodies = _fusion_bodies(comps)
  launches = [i for c, instrs in comps.items() if c not in bodies for i in instrs
              if i.opcode in ("fusion", "custom-call", "dot", "convolution")]
  kinds = collections.Counter(_kind(i) for i in launches)
  matmuls = [i for i in launches if _is_matmul(i, comps)]
  readers = collections.defaultdict(list)
  for m in matmuls:
    for op in dict.fromkeys(m.operands):
      readers[op].append(m)
  groups = collections.Counter()
  for op, members in readers.items():
    if len(members) > 1:
      groups[tuple(sorted(m.type for m in members))] += 1
  shared = [(n, list(sig)) for sig, n in groups.most_common()]
  return dict(kernels=len(launches), by_kind=dict(kinds.most_common()), matmuls=len(matmuls),
              shared=shared)


def _kind(instr: Instr) -> str:
  if instr.opcode in ("dot", "convolution"):
    return instr.opcode
  if instr.opcode == "custom-call":
    target = _TARGET.search(instr.attrs)
    return f"custom-call {target.group(1) if target else '?'}"
  kind = re.search(r"kind=(\w+)", instr.attrs)
  backend = _BACKEND_KIND.search(instr.attrs)  # kCustom: __triton_gemm, __custom_fusion, ...
  name = _CUSTOM_FUSION_NAME.search(instr.attrs)  # dynamic_address_computation, cutlass_gemm
  return " ".join([f"fusion {kind.group(1) if kind else '?'}"]
                  + [m.group(1) for m in (backend, name) if m])


def format_structure(s: dict, layers: int, title: str) -> str:
  """A few lines: kernels and matmuls per program and per layer, the matmul groups that share
  an input (candidates for one wider matmul)."""
  lines = [f"{title}: {s['kernels']} kernel-like instructions ({s['kernels'] / layers:.1f} per "
           f"layer), {s['matmuls']} matmuls ({s['matmuls'] / layers:.1f} per layer); by kind: "
           + ", ".join(f"{k} {n}" for k, n in list(s["by_kind"].items())[:8])]
  for n, types in s["shared"][:8]:
    lines.append(f"  {n} x matmuls reading one input, results {' + '.join(types)}: one wider "
                 f"matmul each would save {n * (len(types) - 1)} launches")
  if not s["shared"]:
    lines.append("  no matmuls share an input")
  return "\n".join(lines)


_CALLEES = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)|"
                      r"branch_computations=\{([^}]*)\}")
COMMAND_BUFFER_PREFIX = "command_buffer"  # the computations XLA outlines per CUDA graph
_LAUNCH_OPS = ("fusion", "custom-call", "dot", "convolution", "sort", "copy", "while",
               "conditional", "all-reduce", "all-gather", "dynamic-update-slice", "scatter")


def _callees(instr: Instr) -> list:
  out = []
  for one, many in _CALLEES.findall(instr.attrs):
    out += [one] if one else _OPERAND.findall(many)
  return out


def command_buffer_report(hlo_text: str) -> dict:
  """How much of each `while` loop runs inside XLA command buffers (CUDA graphs), from the
  optimised HLO: XLA outlines each captured sequence into a computation named
  `command_buffer*` and calls it. Per while loop: is it itself inside a command buffer, how many
  command-buffer calls one iteration makes (graph launches), and the launch-like instructions
  its body runs OUTSIDE any command buffer (each a host launch per iteration, and a point where
  one graph ends and the next begins), by kind / custom-call target.
  {command_buffers, whiles: [{while, computation, in_command_buffer, graph_calls, outside}]}."""
  comps = parse(hlo_text)
  graphs = {c for c in comps if c.startswith(COMMAND_BUFFER_PREFIX)}
  fusion_bodies = _fusion_bodies(comps)
  inside = set()
  stack = list(graphs)
  while stack:  # everything a command buffer calls runs in it
    c = stack.pop()
    for i in comps.get(c, ()):
      for callee in _callees(i):
        if callee not in inside:
          inside.add(callee)
          stack.append(callee)
  whiles = []
  for comp, instrs in comps.items():
    for w in (i for i in instrs if i.opcode == "while"):
      body = re.search(r"body=%([\w.\-]+)", w.attrs).group(1)
      graph_calls, outside, seen, todo = 0, collections.Counter(), set(), [body]
      while todo:  # the body and what it calls, outside fusions and command buffers
        c = todo.pop()
        if c in seen or c in fusion_bodies:
          continue
        seen.add(c)
        for i in comps.get(c, ()):
          callees = _callees(i)
          if i.opcode == "call" and any(x in graphs for x in callees):
            graph_calls += 1
            continue
          if i.opcode in _LAUNCH_OPS:
            outside[_kind(i) if i.opcode in ("fusion", "custom-call") else i.opcode] += 1
          if i.opcode != "fusion":
            todo += callees
      whiles.append(dict(name=w.name, computation=comp,
                         in_command_buffer=comp in graphs or comp in inside,
                         graph_calls=graph_calls, outside=dict(outside.most_common())))
  return dict(command_buffers=len(graphs), whiles=whiles)


HLO_BLIND = ("jax 0.11.2's XLA forms command buffers from the thunk sequence, after the HLO "
             "(CommandBufferConversionPass in GpuExecutable::Create): no command_buffer "
             "computation in the HLO says nothing about graphs; the thunk report does")


def format_command_buffers(report: dict, title: str) -> str:
  lines = [f"{title}: {report['command_buffers']} command-buffer computations in the HLO"]
  if not report["command_buffers"]:
    lines[0] += f" ({HLO_BLIND})"
  for w in report["whiles"]:
    where = ("inside a command buffer" if w["in_command_buffer"] else
             "host-driven" if report["command_buffers"] else "graphs not visible in the HLO")
    top = ", ".join(f"{k} {n}" for k, n in list(w["outside"].items())[:8]) or "none"
    lines.append(f"  while {w['name']} ({where}): per iteration {w['graph_calls']} graph "
                 f"launches; launch-like ops outside graphs: {top}")
  return "\n".join(lines)


# ---- which jax op a CUPTI kernel runs: its optimised-HLO instruction, op_name and source line --
_FRAME_TABLE = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SKIP_FUSED = {"parameter", "constant", "bitcast", "broadcast", "tuple", "get-tuple-element"}


def _frame_tables(hlo_text: str) -> dict:
  """{table name: {id: text}} of the module's stack-frame tables (FileNames, FunctionNames,
  FileLocations, StackFrames: XLA prints them after the module header)."""
  tables, current = {}, None
  for line in hlo_text.splitlines():
    if _FRAME_TABLE.match(line):
      current = tables.setdefault(line, {})
    elif current is not None and line.strip():
      ident, _, rest = line.partition(" ")
      if not ident.isdigit():
        current = None
        continue
      current[int(ident)] = rest.strip().strip('"')
    elif not line.strip():
      current = None
  return tables


def _sources(tables: dict) -> dict:
  """{stack frame id: 'file.py:line function <- caller.py:line function'} (the innermost frame
  and its caller; the printed parent_frame_id is the parent's id + 1, 0 = none)."""
  files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})
  field = lambda text, key: int(re.search(key + r"=(\d+)", text).group(1))
  loc = {}
  for i, text in tables.get("FileLocations", {}).items():
    path = files.get(field(text, "file_name_id"), "?").rsplit("/", 1)[-1]
    loc[i] = f"{path}:{field(text, 'line')} {funcs.get(field(text, 'function_name_id'), '?')}"
  frames = {i: (field(t, "file_location_id"), field(t, "parent_frame_id") - 1)
            for i, t in tables.get("StackFrames", {}).items()}
  out = {}
  for i, (where, parent) in frames.items():
    caller = loc.get(frames[parent][0]) if parent in frames and parent != i else None
    out[i] = loc.get(where, "?") + (f" <- {caller}" if caller else "")
  return out


class HloIndex:
  """One pass over an optimised HLO module's text: instructions by name, result types, fused
  computations' opcodes and each instruction's source (jax op_name, file:line)."""

  def __init__(self, hlo_text: str):
    self.comps = parse(hlo_text)
    self.instr = {i.name: i for instrs in self.comps.values() for i in instrs}
    self.sources = _sources(_frame_tables(hlo_text))

  def find(self, kernel_name: str):
    """The instruction a CUPTI kernel name comes from, or None (XLA:GPU names a fusion's
    kernel after the instruction with '.' -> '_': input_reduce_fusion.16 runs as
    input_reduce_fusion_16; Mosaic / cuBLAS kernels keep their own names)."""
    for name in (kernel_name, re.sub(r"_(\d+)$", r".\1", kernel_name)):
      if name in self.instr:
        return self.instr[name]
    return None

  def fused_ops(self, instr: Instr) -> str:
    """The distinct opcodes inside a fusion's computation, in order ('convert,multiply,reduce')."""
    ops = [j.opcode for c in _CALLS.findall(instr.attrs) for j in self.comps.get(c, ())]
    return ",".join(dict.fromkeys(o for o in ops if o not in _SKIP_FUSED))

  def describe(self, kernel_name: str) -> str:
    """'out <- operands (op_name) [fused ops] @ file:line function <- caller', or '' when the
    kernel has no instruction of its name."""
    instr = self.find(kernel_name)
    if instr is None:
      return ""
    ins = " ".join(self.instr[a].type if a in self.instr else "?" for a in instr.operands)
    op = _OP_NAME.search(instr.attrs)
    frame = _FRAME_ID.search(instr.attrs)
    inner = self.fused_ops(instr) if instr.opcode == "fusion" else ""
    where = self.sources.get(int(frame.group(1))) if frame else None
    return (f"{instr.type} <- {ins} ({op.group(1)[-60:] if op else ''})"
            + (f" [{inner}]" if inner else "") + (f" @ {where}" if where else ""))


def kernel_ops(hlo_text: str, kernels, top: int) -> dict:
  """{kernel name: HloIndex.describe} for the `top` first of [(name, launches, us)] (so a
  CUPTI name like gemm_fusion_dot_86 says which dot it is: bf16[1,16,4608] <- bf16[1,16,7168]
  bf16[7168,4608], and fusion_228 which ops it fuses and which source line made it)."""
  index = HloIndex(hlo_text)
  found = {name: index.describe(name) for name, _, _ in kernels[:top]}
  return {name: text for name, text in found.items() if text}


def kernel_listing(hlo_text: str, kernels, top: int = 40) -> list:
  """[(us per call, launches per call, kernel names, example name, description)] of
  [(kernel name, launches, us)] grouped by HloIndex.describe (the 61 layers' copies of one op
  are one row; kernels without an instruction are grouped by name), slowest first, `top`."""
  index = HloIndex(hlo_text)
  groups = {}
  for name, n, us in kernels:
    key = index.describe(name) or f"{name} (no HLO instruction of this name)"
    g = groups.setdefault(key, [0.0, 0.0, 0, name])
    g[0], g[1], g[2] = g[0] + us, g[1] + n, g[2] + 1
  rows = [(us, n, names, example, key) for key, (us, n, names, example) in groups.items()]
  return sorted(rows, key=lambda r: -r[0])[:top]


def format_listing(rows, title: str) -> str:
  lines = [f"{title}: us/call launches/call (instances) kernel: out <- operands (jax op_name) "
           "[fused HLO ops] @ source"]
  for us, n, names, example, key in rows:
    lines.append(f"  {us:9.1f} {n:6.1f} ({names:3d}) {example[:40]}: {key}")
  return "\n".join(lines)


# ---- a listing's kernels by what they do (notes/roadmap.md's table by kernel group) ----
KERNEL_GROUPS = ("experts", "dense dots", "split-K sums", "attention", "draft", "glue")
_DENSE_PREFIXES = ("gemm_fusion", "nvjet", "cutlass", "cublas", "sm90_xmma")
# the tree-verify kernels (named since 2026-12-07; before, Mosaic's default name `body`: our only
# unnamed Mosaic kernel then) and their Triton merge
_ATTENTION_PREFIXES = ("tree_verify", "body_mosaic_gpu_kernel", "_merge_kernel")
_SHAPE = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]")
_DTYPE_BYTES = {"pred": 1, "bf16": 2}
GEMV_MIN_BYTES = 1 << 20  # a reduce fusion reading an operand this big is a matmul (a GEMV)


def _operands(key: str) -> str:
  """The operand shapes of a listing description ('out <- operands (op_name) [...] @ ...')."""
  if " <- " not in key:
    return ""
  return key.split(" <- ", 1)[1].split(" (", 1)[0].split(" [", 1)[0]


def _operand_bytes(key: str) -> list[int]:
  """Bytes of each operand shape in a listing description."""
  sizes = []
  for dtype, dims in _SHAPE.findall(_operands(key)):
    item = _DTYPE_BYTES.get(dtype) or max(int(dtype[1:]) // 8, 1)
    sizes.append(item * math.prod(int(d) for d in dims.split(",") if d))
  return sizes


def _fused_ops(key: str) -> set[str]:
  m = re.search(r"\) \[([\w,\-]+)\]", key)
  return set(m.group(1).split(",")) if m else set()


def kernel_group(example: str, key: str) -> str:
  """The KERNEL_GROUPS entry of one listing row (its CUPTI kernel name and description): the
  INT4 / bf16 expert calls; XLA's GEMMs and the few-row dots XLA emits as reduce fusions (an
  operand >= GEMV_MIN_BYTES, no gather); the dots' split-K sums (a reduce fusion of f32
  partials that only reduces and converts); the tree-verify kernel, its merge and mask words;
  the draft's context attention; everything else (norms, routing, the pair layout, gathers,
  cache writes, SiLUs over split partials) is glue."""
  if example.startswith("gmm_"):
    return "experts"
  if example.startswith(_ATTENTION_PREFIXES) or "tree_mask_words" in key:
    return "attention"
  if example.startswith("draft_"):
    return "draft"
  if example.startswith(_DENSE_PREFIXES):
    return "dense dots"
  if "reduce_fusion" in example:
    if _fused_ops(key) <= {"reduce", "convert"} and _operands(key).startswith("f32["):
      return "split-K sums"
    lookup = _fused_ops(key) & {"gather", "dynamic-slice"}  # e.g. an embedding row + its norm
    if not lookup and any(b >= GEMV_MIN_BYTES for b in _operand_bytes(key)):
      return "dense dots"
  return "glue"


def group_totals(rows) -> dict:
  """{group: (us per call, launches per call)} of kernel_listing rows, in KERNEL_GROUPS order."""
  totals = {g: [0.0, 0.0] for g in KERNEL_GROUPS}
  for us, n, _, example, key in rows:
    t = totals[kernel_group(example, key)]
    t[0], t[1] = t[0] + us, t[1] + n
  return {g: tuple(v) for g, v in totals.items() if v[1]}


def format_groups(rows, title: str) -> str:
  """One line: the listing's ms and launches per call by group."""
  totals = group_totals(rows)
  parts = [f"{g} {us / 1e3:.3f} ({n:.0f})" for g, (us, n) in totals.items()]
  return f"{title}: ms (launches) " + ", ".join(parts)


# ---- XLA's thunk sequence after its command-buffer conversion (the dump of a GPU compile) ----
# `xla_dump_to` makes XLA:GPU write module_*.thunk_sequence.txt (the thunks as emitted) and, when
# its thunk passes changed anything (formed a command buffer), module_*.thunk_sequence_after_
# thunk_passes.txt: one line per thunk, '<indent>[NNN: ]kKind ...', nested thunks indented
# deeper, a while's 'condition:' / 'body:' sections (ThunkSequence / WhileThunk /
# CommandBufferThunk::ToString; jax 0.11.2 prints '001: kCustomKernel [source | next=002 (1)]
# loop_minimum_fusion grid: ...').
THUNK_DUMP_SUFFIX = "thunk_sequence_after_thunk_passes.txt"
THUNKS_AS_EMITTED_SUFFIX = "thunk_sequence.txt"
_THUNK_LINE = re.compile(r"^( *)(?:\d+: +)?(k[A-Z]\w*)\b(.*)$")
_NO_OP_THUNKS = {"kSequential", "kAsyncDone"}


@dataclasses.dataclass
class Thunk:
  kind: str
  indent: int
  details: str = ""
  sections: dict = dataclasses.field(default_factory=dict)  # "" | condition | body: [Thunk]
  section: str = ""

  def walk(self):
    for children in self.sections.values():
      for c in children:
        yield c
        yield from c.walk()


def thunk_dumps(folder: str, suffix: str = THUNK_DUMP_SUFFIX) -> list:
  """The thunk dumps of one kind XLA wrote into `folder` (after the conversion by default),
  largest first (a compile's own module before any small ones, e.g. autotuning's)."""
  if not folder or not os.path.isdir(folder):
    return []
  paths = [os.path.join(folder, f) for f in os.listdir(folder)
           if f.endswith("." + suffix)]
  return sorted(paths, key=os.path.getsize, reverse=True)


def collect_thunk_dump(folder: str, out_dir: str, label: str) -> dict | None:
  """`thunk_report` of the largest thunk dump in `folder`: the one after the conversion, else
  (XLA writes none when it formed no command buffer) the thunks as emitted, `converted` saying
  which; `dump` = its file name. That module's thunk files (both dumps, metadata) are copied into
  `out_dir` as thunks_<label>.<what>. None when XLA wrote no thunk dump (a cache hit, a CPU)."""
  paths, converted = thunk_dumps(folder), True
  if not paths:
    paths, converted = thunk_dumps(folder, THUNKS_AS_EMITTED_SUFFIX), False
  if not paths:
    return None
  with open(paths[0]) as f:
    report = thunk_report(f.read())
  module = os.path.basename(paths[0]).removesuffix(THUNK_DUMP_SUFFIX if converted
                                                   else THUNKS_AS_EMITTED_SUFFIX)
  for name in os.listdir(folder):
    if name.startswith(module) and "thunk" in name:
      shutil.copy(os.path.join(folder, name),
                  os.path.join(out_dir, f"thunks_{label}.{name.removeprefix(module)}"))
  return dict(report, dump=os.path.basename(paths[0]), converted=converted)


def parse_thunks(text: str) -> Thunk:
  """The thunk tree of XLA's thunk-sequence dump (a root kSequential holding the top level)."""
  root = Thunk("kSequential", -1)
  stack = [root]
  for line in text.splitlines():
    indent, word = len(line) - len(line.lstrip(" ")), line.strip()
    if word in ("condition:", "body:"):
      while word == "body:" and len(stack) > 1 and stack[-1].indent >= indent:
        stack.pop()
      stack[-1].section = word[:-1]
      continue
    m = _THUNK_LINE.match(line)
    if not m:
      continue
    while len(stack) > 1 and stack[-1].indent >= indent:
      stack.pop()
    node = Thunk(m.group(2), indent, m.group(3).strip())
    stack[-1].sections.setdefault(stack[-1].section, []).append(node)
    stack.append(node)
  return root


def _flat(thunks):
  """The thunks of a sequence with kSequential wrappers inlined."""
  for t in thunks:
    if t.kind == "kSequential":
      yield from _flat(t.sections.get("", []))
    else:
      yield t


def _section_report(thunks) -> dict:
  graphs = [t for t in _flat(thunks) if t.kind == "kCommandBuffer"]
  outside = collections.Counter(t.kind for t in _flat(thunks)
                                if t.kind != "kCommandBuffer" and t.kind not in _NO_OP_THUNKS)
  in_graphs = sum(1 for g in graphs for t in g.walk() if t.kind not in _NO_OP_THUNKS)
  return dict(graphs=len(graphs), thunks_in_graphs=in_graphs,
              outside=dict(outside.most_common()))


def thunk_report(text: str) -> dict:
  """From XLA's thunk dump after the command-buffer conversion: the top level (graphs and what
  runs outside them) and per while loop whether it runs inside a command buffer (on the device:
  one graph launch per call) or host-driven, and then per iteration the graphs its body
  launches and the thunks the host launches outside them (the ones that kept the loop out of a
  graph, and where one graph ends and the next begins), by thunk kind.
  {thunks, command_buffers, top: {graphs, thunks_in_graphs, outside}, whiles: [{depth,
  in_command_buffer, body: {...}, condition: {...}}]}."""
  root = parse_thunks(text)
  whiles = []

  def visit(node, in_graph, depth):
    for section, children in node.sections.items():
      for c in children:
        if c.kind == "kWhile":
          whiles.append(dict(depth=depth, in_command_buffer=in_graph,
                             body=_section_report(c.sections.get("body", [])),
                             condition=_section_report(c.sections.get("condition", []))))
        visit(c, in_graph or c.kind == "kCommandBuffer", depth + (c.kind == "kWhile"))

  visit(root, False, 0)
  every = list(root.walk())
  return dict(thunks=sum(t.kind not in _NO_OP_THUNKS for t in every),
              command_buffers=sum(t.kind == "kCommandBuffer" for t in every),
              top=_section_report(root.sections.get("", [])), whiles=whiles)


def _counts(d: dict) -> str:
  return ", ".join(f"{k} {n}" for k, n in list(d.items())[:8]) or "none"


def format_thunk_report(report: dict, title: str) -> str:
  top = report["top"]
  what = ("XLA's thunks after its command-buffer conversion" if report.get("converted", True)
          else "XLA formed NO command buffer: its thunks as emitted")
  lines = [f"{title}: {report['thunks']} thunks, {report['command_buffers']} command buffers "
           f"({what}); top level: {top['graphs']} graphs of {top['thunks_in_graphs']} thunks, "
           f"outside graphs: {_counts(top['outside'])}"]
  for w in report["whiles"]:
    b, head = w["body"], f"  while (nesting {w['depth']}"
    if w["in_command_buffer"]:
      lines.append(f"{head}, INSIDE a command buffer): the loop runs on the device (a CUDA "
                   f"graph conditional node), {sum(b['outside'].values())} thunks per "
                   f"iteration, no host launch per iteration")
      continue
    lines.append(f"{head}, host-driven): per iteration {b['graphs']} graph launches of "
                 f"{b['thunks_in_graphs']} thunks; host-launched outside graphs: "
                 f"{_counts(b['outside'])}; condition outside graphs: "
                 f"{_counts(w['condition']['outside'])}")
  return "\n".join(lines)
