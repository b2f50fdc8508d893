"""The API reference, docs/api.md, lists every public name of graphgrad.

A public name is one in ``__all__`` of ``graphgrad`` or of a public module
that ``graphgrad.__all__`` holds (``gg.transforms``, ``gg.backward``,
``gg.mtl``, ``gg.cluster``, ``gg.demo``, and any module added later). A name
is listed when the page has an mkdocstrings entry ``::: graphgrad.mod.name``
or names it in backticks (the ``GATE_*`` constants, which have no
docstring of their own).

``import graphgrad`` imports no TensorFlow: each public name is imported on
first use, and resolves to the object its module defines.
"""

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
import types

import pytest

import graphgrad

_API = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs",
                    "api.md")
_ENTRY = re.compile(r"^::: (\S+)\s*$", re.MULTILINE)


def _api_text():
  with open(_API, encoding="utf-8") as f:
    return f.read()


def _public_modules():
  modules = [graphgrad]
  for name in graphgrad.__all__:
    value = getattr(graphgrad, name)
    if isinstance(value, types.ModuleType):
      modules.append(value)
  return modules


def _public_names():
  names = []
  for module in _public_modules():
    names.extend(f"{module.__name__}.{name}" for name in module.__all__)
  return names


def _listed(full_name, text):
  entries = set(_ENTRY.findall(text))
  return full_name in entries or f"`{full_name}`" in text


def test_public_modules_are_the_documented_ones():
  names = {m.__name__ for m in _public_modules()}
  assert {"graphgrad.transforms", "graphgrad.backward", "graphgrad.mtl",
          "graphgrad.cluster", "graphgrad.demo"} <= names


def test_every_public_name_is_in_the_api_reference():
  text = _api_text()
  missing = [name for name in _public_names() if not _listed(name, text)]
  assert not missing, (
      f"docs/api.md has no entry for {missing}; add '::: <name>' lines")


def test_every_entry_names_an_existing_object():
  unknown = []
  for entry in _ENTRY.findall(_api_text()):
    module_name, _, attribute = entry.rpartition(".")
    try:
      module = importlib.import_module(entry)
      continue
    except ImportError:
      pass
    module = importlib.import_module(module_name)
    if not hasattr(module, attribute):
      unknown.append(entry)
  assert not unknown, f"docs/api.md names objects that do not exist: {unknown}"


def test_a_name_left_out_is_found_missing():
  text = _api_text().replace("::: graphgrad.thaw\n", "")
  assert not _listed("graphgrad.thaw", text)
  assert _listed("graphgrad.thaw", _api_text())


_OPTIONS = re.compile(r"^::: (\S+)\n    options:\n((?:      .*\n)+)",
                      re.MULTILINE)


def _options(text):
  """``{entry: {option: value}}``; a list value may wrap onto more lines."""
  return {entry: dict(re.findall(r"^      (\w+): (\[[^\]]*\]|.*)$", block,
                                 re.MULTILINE))
          for entry, block in _OPTIONS.findall(text)}


def _names(value):
  return re.findall(r"\w+", value)


def _class(entry):
  module_name, _, name = entry.rpartition(".")
  return getattr(importlib.import_module(module_name), name)


def _public_members(cls):
  """The public attributes graphgrad defines on ``cls`` and its bases."""
  return {name for c in cls.__mro__ if c.__module__.startswith("graphgrad.")
          for name in vars(c) if not name.startswith("_")}


def _inherited(cls):
  """The public members ``cls`` takes from graphgrad's mixins."""
  return _public_members(cls) - {n for n in vars(cls) if not n.startswith("_")}


def test_a_members_list_names_every_public_member():
  # A list orders a class's members with its mixins'; it must miss none.
  lists = {entry: _names(options["members"])
           for entry, options in _options(_api_text()).items()
           if options.get("members", "").startswith("[")}
  assert "graphgrad.GradientPlan" in lists
  for entry, listed in lists.items():
    assert len(listed) == len(set(listed)), entry
    assert set(listed) == _public_members(_class(entry)), entry


def test_the_members_of_mixins_are_on_the_page():
  # mkdocstrings leaves inherited members out unless told.
  options = _options(_api_text())
  assert _inherited(graphgrad.GradientPlan) and _inherited(graphgrad.KerasPlan)
  for entry in _ENTRY.findall(_api_text()):
    obj = _class(entry)
    if not isinstance(obj, type) or not _inherited(obj):
      continue
    shown = options.get(entry, {}).get("inherited_members", "false")
    assert shown == "true" or _inherited(obj) <= set(_names(shown)), entry


def test_a_member_left_out_of_a_members_list_is_found_missing():
  text = _api_text().replace(" override_gradient,", "")
  listed = _names(_options(text)["graphgrad.GradientPlan"]["members"])
  assert "override_gradient" not in listed
  assert set(listed) != _public_members(graphgrad.GradientPlan)


def _typed_imports():
  """``(module, name)`` of each import in the package's TYPE_CHECKING block,
  which type checkers and the API reference read instead of the runtime
  lookup."""
  tree = ast.parse(inspect.getsource(graphgrad))
  block = next(n for n in tree.body if isinstance(n, ast.If)
               and getattr(n.test, "id", None) == "TYPE_CHECKING")
  found = []
  for node in block.body:
    assert isinstance(node, ast.ImportFrom), ast.dump(node)
    found += [(node.module, a.name) for a in node.names]
  return found


def test_every_public_name_resolves_to_its_definition():
  typed = _typed_imports()
  assert sorted(name for _, name in typed) == sorted(graphgrad.__all__)
  for module, name in typed:
    try:  # a public module
      expected = importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
      expected = getattr(importlib.import_module(module), name)
    assert getattr(graphgrad, name) is expected, name
  assert len(graphgrad.__all__) == len(set(graphgrad.__all__))


def test_dir_lists_the_public_names():
  assert set(graphgrad.__all__) <= set(dir(graphgrad))
  assert "__version__" in dir(graphgrad)
  assert "importlib" not in dir(graphgrad)


def test_an_unknown_name_is_an_attribute_error():
  with pytest.raises(AttributeError, match="has no attribute 'analyse'"):
    graphgrad.analyse  # noqa: B018  pylint: disable=pointless-statement
  assert not hasattr(graphgrad, "_no_such_module")


_FRESH = """
import sys
import graphgrad
import graphgrad.cli._main
assert graphgrad.__version__
imported = sorted(m for m in sys.modules
                  if m == "tensorflow" or m.startswith("tensorflow."))
print(len(imported))
graphgrad.GraphGradError
print(int("tensorflow" in sys.modules))
graphgrad.analyze
print(int("tensorflow" in sys.modules))
"""


def test_import_graphgrad_imports_no_tensorflow():
  """In a fresh process: TensorFlow comes with the first name that needs
  it, not with ``import graphgrad`` (nor with the command line's module)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="3")
  done = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True,
                        text=True, env=env, cwd=root, timeout=300,
                        check=False)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == ["0", "0", "1"]
