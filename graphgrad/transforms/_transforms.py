"""Gradient transforms: small values that map one gradient to another.

A transform is made by a lowercase factory (``scale(0.5)``), composes with
``chain``, and is applied by a plan to an upstream gradient at a layer's
outputs, to a layer's parameter gradients, or to the gradient along one
layer-graph edge. Every transform passes ``None`` through, keeps
``tf.IndexedSlices`` sparse by acting on ``.values``, keeps shape and dtype
(hyperparameters are cast to the gradient's dtype), and opens a name scope.

A transform receives a :class:`TransformContext` that says where it is being
applied. Stateless transforms ignore it; annealed noise reads its global step,
and a stateful transform keeps what it creates in its ``resources``.
"""

from typing import Any, Callable, Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.transforms import _validate
from graphgrad.transforms._context import TransformContext


class Transform:
  """Base class of gradient transforms; the contract of a user-written one.

  A subclass implements :meth:`apply_dense`, which maps a dense gradient
  tensor to a tensor of the same shape and dtype. Calling the transform
  passes ``None`` through, applies :meth:`apply_dense` to the ``.values`` of
  a ``tf.IndexedSlices`` and opens a name scope (the class's ``name``). The
  plan checks the result's shape and dtype. A subclass that reads
  ``context.global_step`` sets ``reads_global_step = True``: the plan's
  ``apply_gradients`` then advances the global step. One that creates
  variables or other state keeps them in ``context.resources`` (created once
  per plan, see :class:`Resources`).

  Example:
    >>> import tensorflow as tf
    >>> class Halve(Transform):
    ...   name = "halve"
    ...   def apply_dense(self, grad, context):
    ...     return 0.5 * grad
    >>> Halve()(tf.constant([2.0, -4.0])).numpy().tolist()
    [1.0, -2.0]
    >>> sparse = Halve()(tf.IndexedSlices(tf.constant([[2.0]]),
    ...                                   tf.constant([1])))
    >>> sparse.values.numpy().tolist(), Halve()(None)
    ([[1.0]], None)
  """

  name = "transform"
  reads_global_step = False

  def apply_dense(self, grad: tf.Tensor,
                  context: TransformContext) -> tf.Tensor:
    raise NotImplementedError

  @property
  def parts(self) -> Tuple["Transform", ...]:
    """The transforms this one applies in order: ``(self,)``, or a chain's."""
    return (self,)

  @property
  def linear_factor(self) -> Optional[float]:
    """``c`` when the transform is ``g -> c * g`` for a known number ``c``.

    ``scale(c)`` gives ``c``, ``reverse(lam)`` ``-lam``, ``zero()`` 0,
    ``identity()`` 1, a chain the product of its parts' factors; ``None``
    for anything else (noise, clipping, a tensor factor, a user callable
    not declared with ``gg.transforms.linear``). A plan backpropagates a
    layer with a linear upstream or edge rewrite once and weights what
    passes through it by ``c``, instead of a second backward pass with
    ``f(g)``.

    Example:
      >>> scale(0.5).linear_factor, clip_by_norm(1.0).linear_factor
      (0.5, None)
    """
    return None

  def __call__(self, grad: Gradient,
               context: Optional[TransformContext] = None) -> Gradient:
    if grad is None:
      return None
    context = context or TransformContext()
    with tf.name_scope(self.name):
      if isinstance(grad, tf.IndexedSlices):
        values = self.apply_dense(grad.values, context)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
      return self.apply_dense(tf.convert_to_tensor(grad), context)

  def __repr__(self) -> str:
    return f"{self.name}()"


class _Fn(Transform):
  """Wraps a plain callable ``g -> g`` as a transform."""

  def __init__(self, fn: Callable[[tf.Tensor], tf.Tensor]):
    self.fn = fn
    self.name = getattr(fn, "__name__", "fn")
    if not self.name.isidentifier():  # "<lambda>" is not a valid scope name
      self.name = "fn"

  def apply_dense(self, grad, context):
    return self.fn(grad)

  def __repr__(self):
    return f"as_transform({self.fn!r})"


def as_transform(fn: Any) -> Transform:
  """Returns ``fn`` as a :class:`Transform`.

  Args:
    fn: a :class:`Transform`, or any callable mapping a gradient tensor to a
      tensor of the same shape and dtype. A plain callable is applied to the
      ``.values`` of sparse gradients.

  Returns:
    A transform.

  Raises:
    GraphGradError: if ``fn`` is not callable, or is a group transform.

  Example:
    >>> t = as_transform(lambda g: 2.0 * g)
    >>> isinstance(t, Transform)
    True
  """
  if isinstance(fn, Transform):
    return fn
  if callable(getattr(fn, "apply_group", None)):
    raise _errors.GraphGradError(
        f"`fn` is the group transform {fn!r}, which rewrites all of a "
        f"layer's parameter gradients together, not one gradient. Pass it on "
        f"its own to GradientPlan.transform_gradients(layer, {fn!r}), not "
        f"inside chain() or to a per-gradient declaration.")
  if not callable(fn):
    raise _errors.GraphGradError(
        f"`fn` must be a callable that maps a gradient tensor to a tensor of "
        f"the same shape and dtype, or a gg.transforms object; got "
        f"{type(fn).__name__} {fn!r}. Pass e.g. gg.transforms.scale(0.5) or "
        f"`lambda g: 0.5 * g`.")
  return _Fn(fn)


def cast_like(value, grad: tf.Tensor) -> tf.Tensor:
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    # tf.cast would first make a float32 tensor of a Python float, rounding
    # it before a float64 gradient ever sees it.
    return tf.constant(value, dtype=grad.dtype)
  return tf.cast(value, grad.dtype)


class _Scale(Transform):
  name = "scale"

  def __init__(self, c):
    self.c = c

  @property
  def linear_factor(self):
    if isinstance(self.c, (int, float)) and not isinstance(self.c, bool):
      return self.c
    return None

  def apply_dense(self, grad, context):
    # Neutral values as Sonnet's scale_gradient does: no multiply at all.
    if isinstance(self.c, (int, float)) and self.c == 1:
      return tf.identity(grad)
    if isinstance(self.c, (int, float)) and self.c == 0:
      return tf.zeros_like(grad)
    return grad * cast_like(self.c, grad)

  def __repr__(self):
    return f"scale({self.c!r})"


def scale(c) -> Transform:
  """Multiplies the gradient by ``c``.

  Args:
    c: a finite Python number or a scalar tensor.

  Returns:
    A transform computing ``c * g``.

  Raises:
    GraphGradError: if ``c`` is not a number or scalar tensor, or is NaN or
      infinite.

  Example:
    >>> scale(0.5)
    scale(0.5)
  """
  _validate.number("scale", "c", c, what="a finite factor",
                   fix="Pass e.g. scale(0.5).")
  return _Scale(c)


class _ClipByValue(Transform):
  name = "clip_by_value"

  def __init__(self, lo, hi):
    self.lo, self.hi = lo, hi

  def apply_dense(self, grad, context):
    return tf.clip_by_value(grad, cast_like(self.lo, grad),
                            cast_like(self.hi, grad))

  def __repr__(self):
    return f"clip_by_value({self.lo!r}, {self.hi!r})"


def clip_by_value(lo, hi) -> Transform:
  """Clips every element of the gradient to ``[lo, hi]``.

  Args:
    lo: the lower bound, a finite Python number or a scalar tensor.
    hi: the upper bound, a finite Python number or a scalar tensor.

  Returns:
    A transform.

  Raises:
    GraphGradError: if a bound is not a number or scalar tensor, is NaN or
      infinite, or both bounds are numbers and ``lo > hi``.

  Example:
    >>> clip_by_value(-1.0, 1.0)
    clip_by_value(-1.0, 1.0)
  """
  for arg, value in (("lo", lo), ("hi", hi)):
    _validate.number("clip_by_value", arg, value, what="a finite bound",
                     fix="Pass e.g. clip_by_value(-1.0, 1.0).")
  if not tf.is_tensor(lo) and not tf.is_tensor(hi) and lo > hi:
    raise _errors.GraphGradError(
        f"clip_by_value: `lo` must not exceed `hi`; got lo={lo}, hi={hi}. "
        "Swap the bounds.")
  return _ClipByValue(lo, hi)


class _ClipByNorm(Transform):
  name = "clip_by_norm"

  def __init__(self, c):
    self.c = c

  def apply_dense(self, grad, context):
    return tf.clip_by_norm(grad, cast_like(self.c, grad))

  def __repr__(self):
    return f"clip_by_norm({self.c!r})"


def clip_by_norm(c) -> Transform:
  """Rescales the gradient so that its L2 norm is at most ``c``.

  For a sparse gradient the norm is that of its ``.values``.

  Args:
    c: the norm bound, a positive finite Python number or a scalar tensor.

  Returns:
    A transform.

  Raises:
    GraphGradError: if ``c`` is not a number or scalar tensor, is NaN or
      infinite, or is a number that is not positive.

  Example:
    >>> clip_by_norm(1.0)
    clip_by_norm(1.0)
  """
  _validate.number("clip_by_norm", "c", c, what="a positive norm bound",
                   low=0.0, low_open=True,
                   fix="Use gg.transforms.zero() to drop a gradient.")
  return _ClipByNorm(c)


def reverse(lam=1.0) -> Transform:
  """Reverses the gradient and scales it by ``lam``: ``-lam * g``.

  On an edge this is a gradient reversal layer (Ganin & Lempitsky, 2015).

  Args:
    lam: a finite Python number or a scalar tensor.

  Returns:
    A transform computing ``-lam * g``.

  Raises:
    GraphGradError: if ``lam`` is not a number or scalar tensor, or is NaN
      or infinite.

  Example:
    >>> reverse(0.3)
    scale(-0.3)
  """
  _validate.number("reverse", "lam", lam, what="a finite factor",
                   fix="Pass e.g. reverse(1.0).")
  if not tf.is_tensor(lam):
    return _Scale(-lam)
  return _Scale(-tf.convert_to_tensor(lam))


def zero() -> Transform:
  """Replaces the gradient by zeros of the same shape.

  Example:
    >>> zero()
    scale(0)
  """
  return _Scale(0)


def identity() -> Transform:
  """Leaves the gradient as it is.

  Example:
    >>> identity()
    scale(1)
  """
  return _Scale(1)


class _Chain(Transform):
  name = "chain"

  def __init__(self, transforms):
    self.transforms = tuple(transforms)

  @property
  def parts(self):
    return tuple(p for t in self.transforms for p in t.parts)

  @property
  def reads_global_step(self):
    return any(t.reads_global_step for t in self.transforms)

  @property
  def linear_factor(self):
    factor = 1
    for t in self.transforms:
      if t.linear_factor is None:
        return None
      factor *= t.linear_factor
    return factor

  def __call__(self, grad, context=None):
    with tf.name_scope(self.name):
      for t in self.transforms:
        grad = t(grad, context)
    return grad

  def __repr__(self):
    return "chain(" + ", ".join(map(repr, self.transforms)) + ")"


def chain(*transforms) -> Transform:
  """Applies transforms one after another, first to last.

  Args:
    *transforms: transforms or plain callables.

  Returns:
    A transform.

  Raises:
    GraphGradError: if an argument is not callable, or is a group transform.

  Example:
    >>> chain(scale(2.0), clip_by_norm(1.0))
    chain(scale(2.0), clip_by_norm(1.0))
  """
  out = []
  for i, t in enumerate(transforms):
    try:
      out.append(as_transform(t))
    except _errors.GraphGradError as e:
      raise _errors.GraphGradError(f"chain: argument {i}: {e}") from None
  return _Chain(out)


def compose(fns: Sequence[Transform]) -> Transform:
  """One transform applying ``fns`` in order (the one itself if alone)."""
  return fns[0] if len(fns) == 1 else chain(*fns)


def is_identity(transform: Transform) -> bool:
  """True when ``transform`` is known to leave every gradient unchanged."""
  if isinstance(transform, _Scale):
    return isinstance(transform.c, (int, float)) and transform.c == 1
  if isinstance(transform, _Chain):
    return all(is_identity(t) for t in transform.transforms)
  return False
