"""The API reference, docs/api.md, lists every public name of graphgrad.

A public name is one in ``__all__`` of ``graphgrad`` or of a public module
that ``graphgrad.__all__`` holds (``gg.transforms``, ``gg.backward``,
``gg.mtl``, ``gg.cluster``, ``gg.demo``, and any module added later). A name
is listed when the page has an mkdocstrings entry ``::: graphgrad.mod.name``
or names it in backticks (the ``GATE_*`` constants, which have no
docstring of their own).
"""

import importlib
import os
import re
import types

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


_MEMBERS = re.compile(r"^::: (\S+)\n    options:\n(?:      .*\n)*?      "
                      r"members: \[([^\]]*)\]", re.MULTILINE)


def _members_lists(text):
  """``{entry: [member, ...]}`` of the entries that list their members."""
  return {entry: [m.strip() for m in listed.split(",")]
          for entry, listed in _MEMBERS.findall(text)}


def _public_members(cls):
  """The public attributes graphgrad defines on ``cls`` and its bases."""
  return {name for c in cls.__mro__ if c.__module__.startswith("graphgrad.")
          for name in vars(c) if not name.startswith("_")}


def test_a_members_list_names_every_public_member():
  # A list orders a class's members with its mixins'; it must miss none.
  lists = _members_lists(_api_text())
  assert "graphgrad.GradientPlan" in lists
  for entry, listed in lists.items():
    module_name, _, name = entry.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    assert len(listed) == len(set(listed)), entry
    assert set(listed) == _public_members(cls), entry


def test_a_member_left_out_of_a_members_list_is_found_missing():
  text = _api_text().replace(" override_gradient,", "")
  listed = _members_lists(text)["graphgrad.GradientPlan"]
  assert "override_gradient" not in listed
  assert set(listed) != _public_members(graphgrad.GradientPlan)
