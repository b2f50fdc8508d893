"""A griffe extension: a plan's mixin methods return the plan, on the page.

Some declaring methods of ``GradientPlan`` and ``KerasPlan`` live in mixins
(``OpOverriding``, ``TrainingMethods``, ``LayerOverriding``), typed
``def m(self: _P, ...) -> _P`` so that a chain of declarations keeps the
plan's type. The API reference lists them among the plan's members, and
their return type reads as the one class of the package that inherits the
mixin (``GradientPlan``, linked), not as ``_P``.
"""

import griffe


class MixinSelfTypes(griffe.Extension):
  """``-> _P``, the type of ``self``, reads as the class using the mixin."""

  def on_package(self, *, pkg, **kwargs):  # pylint: disable=unused-argument
    users = {}
    for cls in _classes(pkg):
      for base in cls.resolved_bases:
        users.setdefault(base.path, (base, []))[1].append(cls)
    for base, classes in users.values():
      if len(classes) != 1:  # a mixin of several classes keeps its type
        continue
      (cls,) = classes
      for member in base.members.values():
        if not member.is_alias and member.is_function and _returns_self(
            member):
          member.returns = griffe.ExprName(cls.name, parent=cls.parent)


def _returns_self(func) -> bool:
  params = list(func.parameters)
  return bool(params) and params[0].annotation is not None and str(
      params[0].annotation) == str(func.returns)


def _classes(obj):
  for member in obj.members.values():
    if member.is_alias:
      continue
    if member.is_class:
      yield member
    if member.is_module or member.is_class:
      yield from _classes(member)
