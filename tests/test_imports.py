"""The package's layering: no import cycles, and the config imports neither the engine nor the learner.

The import graph is read from the source (ast): every `import tunixlike...` and
`from tunixlike... import ...`, at module level or inside functions (a function-level import is
still an arrow between the two modules), except those under `if TYPE_CHECKING:` (annotations only).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tunixlike"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
          or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree: ast.AST, here: str, modules: set[str]) -> set[str]:
  """The package's modules `tree` imports, TYPE_CHECKING blocks left out."""
  out: set[str] = set()

  def resolve(name: str) -> str | None:
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name or None

  def visit(node: ast.AST):
    if isinstance(node, ast.If) and _is_type_checking(node.test):
      for child in node.orelse:
        visit(child)
      return
    if isinstance(node, ast.Import):
      out.update(filter(None, (resolve(a.name) for a in node.names if a.name.startswith("tunixlike"))))
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from . import x / from .a import b
        package = here.split(".")[: len(here.split(".")) - node.level + (here in _packages(modules))]
        base = ".".join(package + ([base] if base else []))
      if base.startswith("tunixlike"):
        for alias in node.names:
          target = resolve(f"{base}.{alias.name}")
          if target == base or target is None:
            target = resolve(base)
          if target:
            out.add(target)
    for child in ast.iter_child_nodes(node):
      visit(child)

  visit(tree)
  out.discard(here)
  return out


def _packages(modules: set[str]) -> set[str]:
  return {_module_name(p) for p in PACKAGE.rglob("__init__.py")}


def import_graph() -> dict[str, set[str]]:
  files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  modules = set(files)
  return {name: _imported(ast.parse(path.read_text(), str(path)), name, modules) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle (a list of modules, the first repeated at the end) per strongly connected component."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  components: list[set[str]] = []

  def strongconnect(v: str):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        strongconnect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.add(w)
        if w == v:
          break
      if len(component) > 1:
        components.append(component)

  sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
  for v in sorted(graph):
    if v not in index:
      strongconnect(v)
  out = []
  for component in components:  # a shortest path back to the start, for the message
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier and start not in [w for v in frontier for w in graph[v]]:
      nxt = []
      for v in frontier:
        for w in sorted(graph[v] & component):
          if w not in paths:
            paths[w] = paths[v] + [w]
            nxt.append(w)
      frontier = nxt
    end = next(v for v in frontier if start in graph[v])
    out.append(paths[end] + [start])
  return out


def test_the_cycle_finder_finds_cycles():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
  assert cycles(graph) == [["a", "b", "c", "a"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
  found = cycles(import_graph())
  assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


# The engine, the learner's train step, the async loop and what only they need.
HEAVY = ("flax", "optax", "tunixlike.learner.train_step", "tunixlike.sampler.engine", "tunixlike.sampler.driver",
         "tunixlike.models.transformer", "tunixlike.rl.runtime", "tunixlike.rl.policy", "tunixlike.rl.trainer")


def _imported_by(statement: str) -> set[str]:
  code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
  return set(proc.stdout.split())


def test_importing_the_config_imports_neither_the_engine_nor_the_learner():
  loaded = _imported_by("import tunixlike.config")
  assert "tunixlike.config" in loaded and "tunixlike.rl.config" in loaded
  assert not [m for m in HEAVY if m in loaded]


def test_importing_settings_or_the_package_imports_no_jax():
  for statement in ("import tunixlike.settings", "import tunixlike"):
    loaded = _imported_by(statement)
    assert "jax" not in loaded and not [m for m in HEAVY if m in loaded], statement


@pytest.mark.parametrize("package", ["tunixlike", "tunixlike.learner", "tunixlike.models", "tunixlike.sampler"])
def test_every_public_name_of_a_lazy_package_resolves(package):
  module = __import__(package, fromlist=["__all__"])
  for name in module.__all__:
    assert getattr(module, name) is not None, (package, name)
  with pytest.raises(AttributeError, match="no attribute 'bogus'"):
    getattr(module, "bogus")


EXITS = {("os", "_exit"), ("sys", "exit"), ("cli", "exit_now"), ("cli", "fail")}


def _exits(tree: ast.AST) -> list[int]:
  """Lines of `tree` that end the process (os._exit, sys.exit, cli.exit_now, cli.fail)."""
  return [node.lineno for node in ast.walk(tree)
          if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in EXITS]


def test_only_entry_points_end_the_process():
  """A library call raises or returns (`tunixlike.train()` inside a notebook must not kill it): only the
  `python -m` entry points (a module with a `__main__` block) and `cli`, which they share, exit."""
  found = []
  for path in PACKAGE.rglob("*.py"):
    source = path.read_text()
    if path.name == "cli.py" or 'if __name__ == "__main__"' in source:
      continue
    found += [f"{path.relative_to(PACKAGE.parent)}:{line}" for line in _exits(ast.parse(source, str(path)))]
  assert not found, "library code ends the process: " + ", ".join(found)
  assert _exits(ast.parse("import os\nos._exit(1)\ncli.exit_now('p', 'x', 1)")) == [2, 3]  # the finder finds them


def _package(module: str) -> str:
  """`tunixlike.rl.build` -> `rl`, `tunixlike.distributed` -> `distributed`."""
  return module.split(".")[1] if "." in module else module


def package_pairs(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
  """Pairs of packages (or top-level modules) that import each other, with the arrows of the pair."""
  arrows: dict[tuple[str, str], list[str]] = {}
  for a, targets in graph.items():
    for b in targets:
      if _package(a) != _package(b):
        arrows.setdefault((_package(a), _package(b)), []).append(f"{a} -> {b}")
  return {(a, b): arrows[(a, b)] + arrows[(b, a)] for a, b in arrows if a < b and (b, a) in arrows}


# Pairs still importing each other, each with why (docs/design.md#layers). A new pair fails; so does
# one that is gone, to be struck from this list.
KNOWN_PAIRS = {
    ("config", "multi_agent"),  # likewise `multi_agent/config.py`
    ("config", "rl"),  # the config tree is made of its sections, `rl/config.py` one of them
}


def test_packages_that_import_each_other_are_the_known_ones():
  pairs = package_pairs(import_graph())
  assert set(pairs) == KNOWN_PAIRS, "\n".join(f"{p}: {', '.join(arrows)}" for p, arrows in pairs.items()
                                              if p not in KNOWN_PAIRS) or f"gone: {KNOWN_PAIRS - set(pairs)}"
  assert package_pairs({"tunixlike.a.x": {"tunixlike.b"}, "tunixlike.b": {"tunixlike.a.y"}}) == {
      ("a", "b"): ["tunixlike.a.x -> tunixlike.b", "tunixlike.b -> tunixlike.a.y"]}
