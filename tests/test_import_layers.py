"""The package's import graph, one node per subpackage (or top-level module), has no cycles.

Read from the source with `ast` (nothing imported): an edge A -> B for every `import` in A's
files naming B, function-level imports included. The root `kdtree_jax/__init__.py` re-exports
and is left out (nothing imports the root itself).
"""

import ast
import pathlib

import kdtree_jax

ROOT = pathlib.Path(kdtree_jax.__file__).parent


def _node(module: str) -> str | None:
  """kdtree_jax.a.b.c -> 'a' (a subpackage or a top-level module); None outside the package."""
  parts = module.split(".")
  if parts[0] != "kdtree_jax" or len(parts) < 2:
    return None
  return parts[1]


def _imported(tree: ast.AST):
  for n in ast.walk(tree):
    if isinstance(n, ast.Import):
      yield from (a.name for a in n.names)
    elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
      yield n.module
      yield from (f"{n.module}.{a.name}" for a in n.names)


def import_graph() -> dict[str, set[str]]:
  graph: dict[str, set[str]] = {}
  for path in ROOT.rglob("*.py"):
    rel = path.relative_to(ROOT.parent).with_suffix("")
    if rel.parts == ("kdtree_jax", "__init__"):
      continue
    src = _node(".".join(rel.parts))
    for name in _imported(ast.parse(path.read_text())):
      dst = _node(name)
      if dst and dst != src and ((ROOT / dst).is_dir() or (ROOT / f"{dst}.py").exists()):
        graph.setdefault(src, set()).add(dst)
  return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one node (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in list(graph):
    if v not in index:
      visit(v)
  return out


def test_cycle_finder_finds_a_planted_cycle():
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_packages():
  assert cycles(import_graph()) == []
