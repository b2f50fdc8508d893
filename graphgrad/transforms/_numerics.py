"""Numerical checks on gradients: fail loudly, or skip a non-finite update.

Two tools for the gradients that training code hopes never to see:

* :func:`check_numerics` is a transform that stops the step with an
  ``InvalidArgumentError`` naming the layer (and the variable or tensor) as
  soon as a gradient holds a NaN or an infinity; tensorpack's
  ``CheckGradient`` does this per variable.
* :func:`apply_if_finite` wraps an optimizer so that a step whose gradients
  are not all finite changes nothing: no variable, no slot, no global step.
  optax's ``apply_if_finite`` does this for JAX.

tensorpack's third filter, ``FilterNoneGrad``, needs no counterpart: a plan's
``apply_gradients`` already skips variables without a gradient.
"""

from typing import Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.transforms._transforms import Transform, TransformContext


def _where(context: TransformContext) -> str:
  """Names where a gradient is: layer, role, and variable or tensor."""
  parts = []
  if context.layer is not None:
    parts.append(f"layer {context.layer}")
  if context.edge is not None:
    parts.append(f"edge {context.edge[0]} -> {context.edge[1]}")
  elif context.role:
    parts.append(context.role)
  if context.variable is not None:
    parts.append(f"variable {context.variable.op.name}")
  elif context.tensor is not None:
    parts.append(f"tensor {context.tensor.name}")
  return ", ".join(parts) or "a gradient"


class _CheckNumerics(Transform):
  name = "check_numerics"

  def __init__(self, message: Optional[str]):
    self.message = message

  def apply_dense(self, grad, context):
    text = f"graphgrad check_numerics: non-finite gradient at {_where(context)}"
    if self.message:
      text += f" ({self.message})"
    return tf.debugging.check_numerics(grad, text)

  def __repr__(self):
    return ("check_numerics()" if self.message is None
            else f"check_numerics({self.message!r})")


def check_numerics(message: Optional[str] = None) -> Transform:
  """Fails the step when a gradient holds a NaN or an infinity.

  The gradient passes unchanged; running it raises
  ``tf.errors.InvalidArgumentError`` whose message names the layer, the role
  (``gradients``, ``upstream`` or the edge) and the variable or boundary
  tensor, followed by ``message``. This is tensorpack's ``CheckGradient``,
  declared where the check belongs: ``plan.transform_gradients(layer,
  check_numerics())`` checks a layer's parameter gradients,
  ``plan.transform_upstream(layer, check_numerics())`` the gradient it
  sends below.

  Args:
    message: optional text appended to the error message.

  Returns:
    A transform.

  Raises:
    GraphGradError: if ``message`` is not a string or ``None``.

  Example:
    >>> import tensorflow as tf
    >>> t = check_numerics()
    >>> ctx = TransformContext(layer="l2", role="gradients")
    >>> t(tf.constant([1.0, 2.0]), ctx).numpy().tolist()
    [1.0, 2.0]
    >>> try:
    ...   t(tf.constant([1.0, float("nan")]), ctx)
    ... except tf.errors.InvalidArgumentError as e:
    ...   print("at layer l2, gradients" in e.message)
    True
  """
  if message is not None and not isinstance(message, str):
    raise _errors.GraphGradError(
        f"check_numerics: `message` must be a string or None; got "
        f"{type(message).__name__} {message!r}. Pass e.g. "
        f"check_numerics('after the attention block').")
  return _CheckNumerics(message)


def _values(g: Gradient) -> tf.Tensor:
  return g.values if isinstance(g, tf.IndexedSlices) else g


def all_finite(grads: Sequence[Gradient]) -> tf.Tensor:
  """A scalar bool tensor: every element of every present gradient is finite.

  Example:
    >>> import tensorflow as tf
    >>> bool(all_finite([tf.constant([1.0]), None]))
    True
    >>> bool(all_finite([tf.constant([1.0, float("inf")])]))
    False
  """
  checks = [tf.reduce_all(tf.math.is_finite(_values(g)))
            for g in grads if g is not None]
  if not checks:
    return tf.constant(True)
  return tf.reduce_all(tf.stack(checks), name="all_finite")


class ApplyIfFinite:
  """An optimizer whose step is skipped when a gradient is not finite.

  Made by :func:`apply_if_finite`; pass it wherever an optimizer goes
  (``plan.apply_gradients(gg.transforms.apply_if_finite(opt))``).

  Attributes:
    optimizer: the wrapped optimizer.
  """

  def __init__(self, optimizer):
    self.optimizer = optimizer

  def compute_gradients(self, *args, **kwargs):
    """The wrapped optimizer's ``compute_gradients``."""
    return self.optimizer.compute_gradients(*args, **kwargs)

  def apply_gradients(self,
                      grads_and_vars: Sequence[Tuple[Gradient, tf.Variable]],
                      global_step=None, name: Optional[str] = None):
    """Applies the gradients only when all of them are finite.

    Args:
      grads_and_vars: ``(gradient, variable)`` pairs.
      global_step: optional variable incremented by the applied step only.
      name: name of the returned op.

    Returns:
      An op that runs the wrapped optimizer's update when every gradient is
      finite and does nothing otherwise.
    """
    grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
    with tf.name_scope(name or "apply_if_finite"):
      finite = all_finite([g for g, _ in grads_and_vars])

      def apply():
        with tf.control_dependencies([self.optimizer.apply_gradients(
            grads_and_vars, global_step=global_step)]):
          return tf.constant(True)

      applied = tf.cond(finite, apply, lambda: tf.constant(False),
                        name="applied")
      return applied.op

  def __repr__(self) -> str:
    return f"apply_if_finite({type(self.optimizer).__name__})"


def apply_if_finite(optimizer) -> ApplyIfFinite:
  """Wraps ``optimizer`` so that a step with a NaN or infinity is skipped.

  When every gradient of the step is finite the wrapped optimizer applies
  them as usual. Otherwise nothing changes: no variable, no optimizer slot
  (Adam's moments), and not the global step. This is optax's
  ``apply_if_finite`` for a ``tf.compat.v1`` optimizer. The optimizer's slot
  variables are created inside a ``tf.cond`` branch, which needs control
  flow v2 (the default in TensorFlow 2).

  Args:
    optimizer: a ``tf.compat.v1.train.Optimizer`` (anything with
      ``apply_gradients(grads_and_vars, global_step=None)``).

  Returns:
    An :class:`ApplyIfFinite` optimizer.

  Raises:
    GraphGradError: if ``optimizer`` has no ``apply_gradients``.

  Example:
    >>> import tensorflow as tf
    >>> opt = apply_if_finite(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    >>> opt
    apply_if_finite(GradientDescentOptimizer)
  """
  if not callable(getattr(optimizer, "apply_gradients", None)):
    raise _errors.GraphGradError(
        f"apply_if_finite: `optimizer` must have an apply_gradients("
        f"grads_and_vars, global_step) method, like "
        f"tf.compat.v1.train.AdamOptimizer(1e-3); got "
        f"{type(optimizer).__name__}.")
  return ApplyIfFinite(optimizer)
