"""The package's layout: import floors, no import circles, unique names.

Every module of ``graphgrad/`` is parsed with ``ast``; its imports, at the
top and inside functions, relative and absolute, make the module import
graph that the floors are checked on.
"""

import ast
import collections
import pathlib
from typing import Dict, List, Set

import networkx as nx
import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "graphgrad"

_MAX_DOCSTRING_LINES = 15


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Dict[str, pathlib.Path]:
  return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _parse(name: str) -> ast.Module:
  path = MODULES[name]
  return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _is_package(name: str) -> bool:
  return MODULES[name].name == "__init__.py"


def _existing(dotted: str) -> str:
  """The longest prefix of ``dotted`` that is a graphgrad module."""
  parts = dotted.split(".")
  while parts and ".".join(parts) not in MODULES:
    parts.pop()
  return ".".join(parts)


def _imported(name: str) -> Set[str]:
  """The graphgrad modules that module ``name`` imports anywhere in it."""
  package = name if _is_package(name) else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(_parse(name)):
    targets: List[str] = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                 for a in node.names]
    for t in targets:
      if t == "graphgrad" or t.startswith("graphgrad."):
        found.add(_existing(t))
  found.discard(name)
  return found


def _import_graph() -> nx.DiGraph:
  g = nx.DiGraph()
  g.add_nodes_from(MODULES)
  for name in MODULES:
    g.add_edges_from((name, t) for t in _imported(name))
  return g


GRAPH = _import_graph()


def _in(folder: str, name: str) -> bool:
  return (name == f"graphgrad.{folder}"
          or name.startswith(f"graphgrad.{folder}."))


def _floor_violations(lower: str, uppers) -> List[str]:
  return sorted(f"{a} -> {b}" for a, b in GRAPH.edges
                if _in(lower, a) and any(_in(u, b) for u in uppers))


def test_the_import_graph_is_read_from_every_module():
  assert "graphgrad.plan._gradient_plan" in MODULES
  assert "graphgrad.analysis._layer_graph" in _imported(
      "graphgrad.plan._gradient_plan")
  # A function-level import counts: the command line imports the package
  # inside its commands.
  assert "graphgrad" in _imported("graphgrad.cli._main")


def test_every_graphgrad_import_names_a_module_that_exists():
  missing = []
  for name in MODULES:
    for node in ast.walk(_parse(name)):
      if isinstance(node, ast.ImportFrom) and not node.level and (
          node.module or "").startswith("graphgrad"):
        if node.module not in MODULES:
          missing.append(f"{name}: from {node.module} import ...")
      elif isinstance(node, ast.Import):
        missing += [f"{name}: import {a.name}" for a in node.names
                    if a.name.startswith("graphgrad") and a.name not in MODULES]
  assert not missing


def test_no_import_circle():
  cycles = sorted(" -> ".join(c) for c in nx.simple_cycles(GRAPH))
  assert not cycles


def test_the_package_root_does_not_reach_the_command_line():
  reached = nx.descendants(GRAPH, "graphgrad")
  assert not sorted(m for m in reached if _in("cli", m))


def test_analysis_imports_no_executor_and_no_command_line():
  assert not _floor_violations("analysis", ("plan", "keras", "cli"))


# The floors of docs/contributing.md: a module imports only from its own
# folder and from lower floors.
_FLOORS = {
    "_errors": 0, "_startup": 0, "_installed": 0, "_types": 1, "_compat": 1,
    "analysis": 2, "transforms": 2, "methods": 3, "core": 4, "plan": 5,
    "keras": 5, "distributed": 6, "__init__": 8, "cli": 9, "__main__": 10}
_PUBLIC_FLOOR = 7  # the public modules: backward, mtl, dp, cluster, demo


def _folder(name: str) -> str:
  parts = name.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def _floor(name: str) -> int:
  return _FLOORS.get(_folder(name), _PUBLIC_FLOOR)


def test_every_import_goes_to_its_own_folder_or_a_lower_floor():
  wrong = sorted(
      f"{a} -> {b}" for a, b in GRAPH.edges
      if _folder(a) != _folder(b) and _floor(b) >= _floor(a)
      and not (_folder(a) == "keras" and _folder(b) == "plan"))
  assert not wrong


def test_keras_does_not_import_plan():
  assert not _floor_violations("keras", ("plan",))


def _duplicates(names_of) -> Dict[str, List[str]]:
  found = collections.defaultdict(list)
  for name in MODULES:
    for n in names_of(name):
      found[n].append(name)
  return {n: sorted(ms) for n, ms in found.items() if len(ms) > 1}


def _file_names(name: str) -> List[str]:
  return [] if _is_package(name) else [MODULES[name].stem]


def _class_names(name: str) -> List[str]:
  return [n.name for n in _parse(name).body if isinstance(n, ast.ClassDef)]


@pytest.mark.parametrize("names_of", [_file_names, _class_names],
                         ids=["module file", "top-level class"])
def test_names_are_unique(names_of):
  assert not _duplicates(names_of)


def _long_docstrings(names) -> Dict[str, int]:
  found = {}
  for name in names:
    doc = ast.get_docstring(_parse(name)) or ""
    if len(doc.splitlines()) > _MAX_DOCSTRING_LINES:
      found[name] = len(doc.splitlines())
  return found


def test_every_module_docstring_fits_on_fifteen_lines():
  assert not _long_docstrings(MODULES)
