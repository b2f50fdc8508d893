"""``per_example(fn)``: a transform applied to each example's slice alone.

A gradient at a layer's outputs or inputs has one row per example (axis 0).
``per_example(clip_by_norm(1.0))`` clips each row to norm 1 where
``clip_by_norm(1.0)`` clips the whole batch's gradient at once. The slices
are mapped with ``tf.vectorized_map``, which falls back to a
``tf.while_loop`` for an op it cannot vectorize.
"""

from typing import Optional

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.transforms._context import TransformContext
from graphgrad.transforms._transforms import Transform, as_transform


class _PerExample(Transform):
  name = "per_example"

  def __init__(self, fn: Transform):
    self.fn = fn
    self.reads_global_step = fn.reads_global_step

  @property
  def parts(self):
    # Its own and those it applies to each slice: a plan then checks the
    # result's shape at run time when one of them is a user's callable.
    return (self,) + self.fn.parts

  @property
  def linear_factor(self) -> Optional[float]:
    return self.fn.linear_factor  # c * g row by row is c * g

  def __call__(self, grad: Gradient,
               context: Optional[TransformContext] = None) -> Gradient:
    if isinstance(grad, tf.IndexedSlices):
      raise _errors.GraphGradError(
          f"per_example({self.fn!r}): the gradient is a tf.IndexedSlices "
          f"(a sparse gradient, e.g. of an embedding table), whose rows are "
          f"rows of a variable, not examples. Apply per_example to a "
          f"gradient with one row per example: with transform_upstream, "
          f"transform_inputs or transform_edge.")
    return super().__call__(grad, context)

  def apply_dense(self, grad, context):
    if grad.shape.rank == 0:
      raise _errors.GraphGradError(
          f"per_example({self.fn!r}): the gradient is a scalar (shape "
          f"[]), which has no example axis; axis 0 must index the "
          f"examples. Apply it to a gradient with one row per example, "
          f"or use {self.fn!r} alone.")
    checks = []
    if grad.shape.rank is None:
      checks.append(tf.debugging.assert_rank_at_least(
          grad, 1, message=f"per_example({self.fn!r}): the gradient is a "
          f"scalar, which has no example axis"))
    with tf.control_dependencies(checks):
      return tf.vectorized_map(lambda g: self.fn(g, context), grad)

  def __repr__(self) -> str:
    return f"per_example({self.fn!r})"


def per_example(fn) -> Transform:
  """Applies ``fn`` to each example's slice of the gradient separately.

  Axis 0 of the gradient indexes the examples: the result's row ``i`` is
  ``fn`` applied to row ``i`` alone (a slice of shape ``shape[1:]``). It is
  meant for the gradients that have one row per example, at a layer's
  outputs or inputs and along edges (``transform_upstream``,
  ``transform_inputs``, ``transform_edge``); a parameter gradient has none.
  Linear exactly when ``fn`` is, with ``fn``'s factor.

  Args:
    fn: a transform, or a callable ``g -> g`` keeping shape and dtype.

  Returns:
    A transform; it passes ``None`` through and keeps shape and dtype.

  Raises:
    GraphGradError: if ``fn`` is not callable or is a group transform; when
      applied, to a ``tf.IndexedSlices`` (its rows are not examples) or a
      gradient of rank 0.

  Example:
    >>> import tensorflow as tf, graphgrad as gg
    >>> clip = gg.transforms.per_example(gg.transforms.clip_by_norm(1.0))
    >>> g = tf.constant([[3.0, 4.0], [0.3, 0.4]], tf.float64)
    >>> clip(g).numpy().round(2).tolist()  # row 0 to norm 1, row 1 kept
    [[0.6, 0.8], [0.3, 0.4]]
  """
  try:
    return _PerExample(as_transform(fn))
  except _errors.GraphGradError as e:
    raise _errors.GraphGradError(f"per_example: {e}") from None
