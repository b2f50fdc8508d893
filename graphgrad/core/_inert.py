"""What to say about a declaration that can change nothing.

Both plans warn once, through the ``graphgrad`` logger, about an upstream
transform on a layer with no layer below it: it rewrites only what the layer
passes below, and its own parameters see the unmodified upstream gradient.
The message names the layer and the likely intent.
"""

from typing import Sequence


def bottom_layer_advice(name: str, above: Sequence[str] = (),
                        method: str = "transform_upstream") -> str:
  """The warning for ``method(name)`` with nothing below: a transform of
  what passes through the layer (``transform_upstream``,
  ``transform_inputs``).

  Args:
    name: the layer.
    above: the layers that consume its output, where known.
    method: the declaration.

  Example:
    >>> print(bottom_layer_advice("l1", ["l2"]))
    transform_upstream('l1') changes nothing: no layer with trainable
    variables lies below 'l1', and its own parameters get the unmodified
    upstream gradient. For l1's parameter gradients declare
    transform_gradients('l1', fn); for what l1 receives from the layer
    above, declare transform_upstream on that layer: transform_upstream('l2',
    fn).
  """
  if above:
    upper = " or ".join(f"transform_upstream({u!r}, fn)" for u in above)
  else:
    upper = "transform_upstream(<the layer that consumes its output>, fn)"
  return (f"{method}({name!r}) changes nothing: no layer with "
          f"trainable variables lies below {name!r}, and its own parameters "
          f"get the unmodified upstream gradient. For {name}'s parameter "
          f"gradients declare transform_gradients({name!r}, fn); for what "
          f"{name} receives from the layer above, declare transform_upstream "
          f"on that layer: {upper}.")
