"""A griffe extension: graphgrad's ``Example:`` sections render as examples.

graphgrad's Google-style docstrings head their doctests ``Example:``; griffe
reads only ``Examples:`` as code examples and would render the doctests as
Markdown prose.
"""

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
  """Renames ``Example:`` section headings to ``Examples:``."""

  def on_instance(self, *, obj, **kwargs):  # pylint: disable=unused-argument
    if obj.docstring is not None:
      obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
