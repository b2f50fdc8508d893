"""The graphgrad error hierarchy.

Every error graphgrad raises on bad input is a :class:`GraphGradError`. Where a
builtin exception fits as well, the error also derives from it, so callers that
already catch ``KeyError`` or ``ValueError`` keep working.

Messages follow one pattern: the argument, what was expected, what was
received, and how to fix it.
"""


class GraphGradError(Exception):
  """Base class of every error graphgrad raises on purpose."""

  # Inside tf.function, AutoGraph re-raises an error with the user's
  # traceback only when it can rebuild it from a message: when its
  # ``__init__`` is ``Exception.__init__``. ValueError's is not, so without
  # this the subclasses below would surface as a generic StagingError.
  __init__ = Exception.__init__


class LayerNotFoundError(GraphGradError, KeyError):
  """A layer name that the analysed graph does not contain."""

  def __str__(self) -> str:
    # KeyError.__str__ wraps the message in quotes; keep it readable.
    return str(self.args[0]) if self.args else ""


class NotConnectedError(GraphGradError, ValueError):
  """A layer, variable or tensor that the loss does not depend on."""


class IncompatibleGradientError(GraphGradError, ValueError):
  """A transform returned a gradient of another shape or dtype."""


class UnsupportedGraphError(GraphGradError, ValueError):
  """A graph shape graphgrad cannot transform without a wrong gradient."""


def layer_not_found(name: str, known) -> LayerNotFoundError:
  """Builds the error for an unknown layer name, listing the known ones."""
  names = ", ".join(known) if known else "(none)"
  return LayerNotFoundError(
      f"no layer named {name!r}; known layers: {names}. "
      "Use one of these names, or pass `layers=` to gg.analyze to group "
      "variables differently.")
