"""``linear``: a user callable declared to compute ``c * g``.

A plan backpropagates a layer whose upstream (or edge) rewrite is linear
once, weighting the share below by ``c``; an undeclared callable costs a
second backward pass, since nothing tells the plan what it computes.
"""

from typing import Callable

import tensorflow as tf

from graphgrad.transforms import _validate
from graphgrad.transforms._transforms import Transform, as_transform


class _Linear(Transform):
  """A callable ``g -> factor * g`` with its declared factor."""

  def __init__(self, fn: Callable[[tf.Tensor], tf.Tensor], factor: float):
    self.fn = fn
    self.factor = factor
    self.name = getattr(fn, "__name__", "fn")
    if not self.name.isidentifier():  # "<lambda>" is not a valid scope name
      self.name = "fn"

  @property
  def linear_factor(self) -> float:
    return self.factor

  def apply_dense(self, grad, context):
    return self.fn(grad)

  def __repr__(self):
    return f"linear({self.fn!r}, {self.factor!r})"


def linear(fn: Callable[[tf.Tensor], tf.Tensor], factor) -> Transform:
  """Declares that the callable ``fn`` computes ``factor * g``.

  A plan then backpropagates through a layer with this upstream (or edge)
  rewrite once, weighting the share below by ``factor``, where an undeclared
  callable costs a second backward pass. ``fn`` still runs where the plan
  needs the rewritten gradient itself (summaries, a backward replacement).
  Declaring a factor that ``fn`` does not compute gives wrong gradients.

  Args:
    fn: a callable mapping a gradient tensor to ``factor`` times it.
    factor: a finite Python number. A tensor's value is unknown when the
      plan is built, so a tensor factor (as in ``scale(tensor)``) is not
      declared linear: the layer is cut.

  Returns:
    A transform whose ``linear_factor`` is ``factor``.

  Raises:
    GraphGradError: if ``fn`` is not callable (or is a group transform), or
      ``factor`` is not a finite Python number.

  Example:
    >>> t = linear(lambda g: 0.25 * g, 0.25)
    >>> t.linear_factor, float(t(tf.constant(2.0)))
    (0.25, 0.5)
  """
  _validate.number("linear", "factor", factor, what="the c of fn(g) = c * g",
                   tensor=False, fix="Pass e.g. gg.transforms.linear(fn, 0.5).")
  as_transform(fn)  # refuses what is not callable
  return _Linear(fn, factor)
