"""A griffe extension: a plan's mixin methods return the plan, on the page.

Some declaring methods of ``GradientPlan`` and ``KerasPlan`` live in mixins
(``Declaring``, shared by both, ``OpOverriding``, ``TrainingMethods``,
``LayerOverriding``), typed ``def m(self: _P, ...) -> _P`` so that a chain
of declarations keeps the plan's type. The API reference lists them among
the plan's members, and their return type reads as the plan that inherits
the mixin (``GradientPlan``, linked), not as ``_P``.
"""

import copy

import griffe


class MixinSelfTypes(griffe.Extension):
  """``-> _P``, the type of ``self``, reads as the class using the mixin."""

  def on_package(self, *, pkg, **kwargs):  # pylint: disable=unused-argument
    classes = list(_classes(pkg))
    bases = {base.path for cls in classes for base in cls.resolved_bases}
    for cls in classes:
      if cls.path in bases:  # a mixin, or a base of another class
        continue
      for name, alias in cls.inherited_members.items():
        member = alias.final_target
        if member.is_function and _returns_self(member):
          # The class's own copy, so that each plan reads its own type.
          own = copy.copy(member)
          own.returns = griffe.ExprName(cls.name, parent=cls.parent)
          if member.docstring is not None:  # whose Returns reads the type
            own.docstring = copy.copy(member.docstring)
            own.docstring.parent = own
          cls.set_member(name, own)


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
