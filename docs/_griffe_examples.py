"""A griffe extension: graphgrad's docstrings render as written.

- ``Example:`` section headings become ``Examples:``: griffe reads only
  ``Examples:`` as code examples and would render the doctests as prose.
- Sphinx cross-reference roles (``:class:`LayerGraph```, ``:func:`analyze```,
  ``:meth:`...```, ``:attr:`...```) become code spans; Markdown has no roles,
  and the page would show ``class: LayerGraph``.
"""

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):`~?([^`]+)`")


class ExampleSections(griffe.Extension):
  """Renames ``Example:`` headings and turns Sphinx roles into code spans."""

  def on_instance(self, *, obj, **kwargs):  # pylint: disable=unused-argument
    if obj.docstring is not None:
      value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
      obj.docstring.value = _ROLE.sub(r"`\1`", value)
