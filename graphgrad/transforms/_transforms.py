"""Gradient transforms: small values that map one gradient to another.

A transform is made by a lowercase factory (``scale(0.5)``), composes with
``chain``, and is applied by a :class:`~graphgrad.GradientPlan` to either an
upstream gradient at a layer boundary, a layer's parameter gradients, or the
gradient that flows along one layer-graph edge.

Every transform

* passes ``None`` through (a variable without a gradient stays without one),
* keeps ``tf.IndexedSlices`` sparse by acting on ``.values``,
* keeps shape and dtype (hyperparameters are cast to the gradient's dtype),
* opens a name scope, so its ops group under one node in TensorBoard.

A transform receives a :class:`TransformContext` that says where it is being
applied. Stateless transforms ignore it; stateful transforms (a step counter,
annealed noise) and transforms that see a whole layer read it.
"""

import dataclasses
import zlib
from typing import Any, Callable, Dict, Optional, Tuple, Union

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient

# The c of a linear transform c * g: a Python number or a scalar tensor.
Factor = Union[int, float, tf.Tensor]

# Keys of TransformContext.state that the plan reads after building.
USES_GLOBAL_STEP = "uses_global_step"  # True: increment the global step
EXTRA_GRADS_AND_VARS = "extra_grads_and_vars"  # (grad, var) of own variables


@dataclasses.dataclass(frozen=True)
class TransformContext:
  """Where a transform is applied.

  Attributes:
    layer: name of the layer the gradient belongs to or flows out of.
    role: ``"upstream"``, ``"gradients"`` or ``"edge"``.
    variable: the variable, for a parameter gradient; else ``None``.
    edge: ``(lower, upper)`` for an edge transform; else ``None``.
    tensor: the forward tensor whose gradient this is, when there is one.
    global_step: the plan's global step tensor, when one is known.
    state: a per-plan dictionary where stateful transforms keep what they
      create, so that it is created once per plan. Two keys are read by the
      plan: ``"uses_global_step"`` (true: ``apply_gradients`` increments the
      global step when given none) and ``"extra_grads_and_vars"`` (``(grad,
      var)`` pairs of variables a transform owns, such as a synthetic
      gradient module, appended to ``compute_gradients()``).
  """
  layer: Optional[str] = None
  role: str = "upstream"
  variable: Optional[tf.Variable] = None
  edge: Optional[Tuple[str, str]] = None
  tensor: Optional[tf.Tensor] = None
  global_step: Optional[tf.Tensor] = None
  state: Dict[str, Any] = dataclasses.field(default_factory=dict)


class Transform:
  """Base class of gradient transforms.

  Subclasses implement :meth:`apply_dense`, which maps a dense tensor to a
  tensor of the same shape and dtype. Calling the transform handles ``None``
  and ``IndexedSlices`` and opens the name scope.
  """

  name = "transform"

  @property
  def linear_factor(self) -> Optional[Factor]:
    """``c`` when this transform is known to compute ``c * g``; else ``None``.

    A plan backpropagates a linear rewrite once and weights what passes
    through it by ``c``, instead of a second backward pass with ``f(g)``.
    User callables are ``None`` unless declared with :func:`linear`.

    Example:
      >>> scale(0.5).linear_factor, clip_by_norm(1.0).linear_factor
      (0.5, None)
    """
    return None

  def apply_dense(self, grad: tf.Tensor,
                  context: TransformContext) -> tf.Tensor:
    raise NotImplementedError

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

  def __init__(self, fn: Callable[[tf.Tensor], tf.Tensor],
               factor: Optional[Factor] = None):
    self.fn = fn
    self._factor = factor
    self.name = getattr(fn, "__name__", "fn")
    if not self.name.isidentifier():  # "<lambda>" is not a valid scope name
      self.name = "fn"

  @property
  def linear_factor(self) -> Optional[Factor]:
    return self._factor

  def apply_dense(self, grad, context):
    return self.fn(grad)

  def __repr__(self):
    if self._factor is not None:
      return f"linear({self.fn!r}, {self._factor!r})"
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
    GraphGradError: if ``fn`` is not callable.

  Example:
    >>> t = as_transform(lambda g: 2.0 * g)
    >>> isinstance(t, Transform)
    True
  """
  if isinstance(fn, Transform):
    return fn
  if not callable(fn):
    raise _errors.GraphGradError(
        f"`fn` must be a callable that maps a gradient tensor to a tensor of "
        f"the same shape and dtype, or a gg.transforms object; got "
        f"{type(fn).__name__} {fn!r}. Pass e.g. gg.transforms.scale(0.5) or "
        f"`lambda g: 0.5 * g`.")
  return _Fn(fn)


def _cast(value, grad: tf.Tensor) -> tf.Tensor:
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
  def linear_factor(self) -> Optional[Factor]:
    return self.c

  def apply_dense(self, grad, context):
    # Neutral values as Sonnet's scale_gradient does: no multiply at all.
    if isinstance(self.c, (int, float)) and self.c == 1:
      return tf.identity(grad)
    if isinstance(self.c, (int, float)) and self.c == 0:
      return tf.zeros_like(grad)
    return grad * _cast(self.c, grad)

  def __repr__(self):
    return f"scale({self.c!r})"


def scale(c) -> Transform:
  """Multiplies the gradient by ``c``.

  Args:
    c: a Python number or a scalar tensor.

  Returns:
    A transform computing ``c * g``.

  Example:
    >>> scale(0.5)
    scale(0.5)
  """
  return _Scale(c)


class _AddNoise(Transform):
  name = "add_noise"

  def __init__(self, stddev, seed, eta=None, gamma=None):
    self.stddev = stddev
    self.seed = seed
    self.eta = eta
    self.gamma = gamma

  def _stddev(self, grad, context):
    if self.eta is None:
      return _cast(self.stddev, grad)
    step = context.global_step
    if step is None:
      raise _errors.GraphGradError(
          f"add_noise(eta={self.eta!r}, gamma={self.gamma!r}) anneals with "
          f"the global step, but the graph has none when the plan is built. "
          f"Create it before building the plan: "
          f"`step = tf.compat.v1.train.get_or_create_global_step()`; the "
          f"plan's apply_gradients then increments it.")
    context.state[USES_GLOBAL_STEP] = True
    t = tf.cast(step, grad.dtype)
    variance = _cast(self.eta, grad) / tf.pow(1 + t, _cast(self.gamma, grad))
    return tf.sqrt(variance, name="stddev")

  def apply_dense(self, grad, context):
    seed = self.seed
    if seed is not None and context.tensor is not None:
      # One seed per transformed tensor: equal seeds on two random ops of the
      # same shape would draw the same noise.
      seed = (seed + zlib.crc32(context.tensor.name.encode())) % (2**31 - 1)
    stddev = self._stddev(grad, context)
    noise = tf.random.normal(tf.shape(grad), stddev=1.0, dtype=grad.dtype,
                             seed=seed)
    return grad + stddev * noise

  def __repr__(self):
    if self.eta is not None:
      return (f"add_noise(eta={self.eta!r}, gamma={self.gamma!r}, "
              f"seed={self.seed!r})")
    return f"add_noise({self.stddev!r}, seed={self.seed!r})"


def add_noise(stddev=None, seed: Optional[int] = None, *, eta=None,
              gamma=0.55) -> Transform:
  """Adds Gaussian noise to the gradient: constant or annealed.

  Two forms, told apart by keyword:

  * ``add_noise(stddev)``: constant noise, ``g + stddev * n`` with
    ``n ~ N(0, 1)``.
  * ``add_noise(eta=eta, gamma=0.55)``: annealed noise (Neelakantan et al.,
    2015, "Adding Gradient Noise Improves Learning for Very Deep Networks"),
    ``g + sigma_t * n`` with variance

        sigma_t^2 = eta / (1 + t)^gamma,

    where ``t`` is the graph's global step
    (``tf.compat.v1.train.get_global_step()``) read when the plan is built.
    The paper uses ``eta`` in {0.01, 0.3, 1.0} and ``gamma = 0.55``. The
    global step must exist before the plan is built; the plan's
    ``apply_gradients`` increments it when no other ``global_step`` is
    passed, so that ``t`` counts training steps.

  Args:
    stddev: standard deviation of constant noise. Give it, or ``eta``.
    seed: op-level seed. With a graph-level seed set, the noise is repeatable;
      each transformed tensor derives its own seed from it.
    eta: keyword only; the variance at step 0 of annealed noise.
    gamma: keyword only; the annealing exponent of annealed noise.

  Returns:
    A transform adding the noise.

  Raises:
    GraphGradError: if both or neither of ``stddev`` and ``eta`` are given,
      or a number among them is negative; when applied, for annealed noise in
      a graph without a global step.

  Example:
    >>> add_noise(0.01, seed=1)
    add_noise(0.01, seed=1)
    >>> add_noise(eta=0.3, gamma=0.55)
    add_noise(eta=0.3, gamma=0.55, seed=None)
  """
  if (stddev is None) == (eta is None):
    raise _errors.GraphGradError(
        f"add_noise: give exactly one of `stddev` (constant noise) and `eta` "
        f"(annealed noise, variance eta / (1 + t)^gamma); got stddev="
        f"{stddev!r}, eta={eta!r}. Use add_noise(0.01) or "
        f"add_noise(eta=0.3, gamma=0.55).")
  for arg, value in (("stddev", stddev), ("eta", eta), ("gamma", gamma)):
    if isinstance(value, (int, float)) and value < 0:
      raise _errors.GraphGradError(
          f"add_noise: `{arg}` must be non-negative; got {value}.")
  if eta is None:
    return _AddNoise(stddev, seed)
  return _AddNoise(None, seed, eta=eta, gamma=gamma)


class _ClipByValue(Transform):
  name = "clip_by_value"

  def __init__(self, lo, hi):
    self.lo, self.hi = lo, hi

  def apply_dense(self, grad, context):
    return tf.clip_by_value(grad, _cast(self.lo, grad), _cast(self.hi, grad))

  def __repr__(self):
    return f"clip_by_value({self.lo!r}, {self.hi!r})"


def clip_by_value(lo, hi) -> Transform:
  """Clips every element of the gradient to ``[lo, hi]``.

  Raises:
    GraphGradError: if both bounds are numbers and ``lo > hi``.

  Example:
    >>> clip_by_value(-1.0, 1.0)
    clip_by_value(-1.0, 1.0)
  """
  if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo > hi:
    raise _errors.GraphGradError(
        f"clip_by_value: `lo` must not exceed `hi`; got lo={lo}, hi={hi}. "
        "Swap the bounds.")
  return _ClipByValue(lo, hi)


class _ClipByNorm(Transform):
  name = "clip_by_norm"

  def __init__(self, c):
    self.c = c

  def apply_dense(self, grad, context):
    return tf.clip_by_norm(grad, _cast(self.c, grad))

  def __repr__(self):
    return f"clip_by_norm({self.c!r})"


def clip_by_norm(c) -> Transform:
  """Rescales the gradient so that its L2 norm is at most ``c``.

  For a sparse gradient the norm is that of its ``.values``.

  Raises:
    GraphGradError: if ``c`` is a number that is not positive.

  Example:
    >>> clip_by_norm(1.0)
    clip_by_norm(1.0)
  """
  if isinstance(c, (int, float)) and c <= 0:
    raise _errors.GraphGradError(
        f"clip_by_norm: `c` must be a positive norm bound; got {c}. "
        "Use gg.transforms.zero() to drop a gradient.")
  return _ClipByNorm(c)


def reverse(lam=1.0) -> Transform:
  """Reverses the gradient and scales it by ``lam``: ``-lam * g``.

  On an edge this is a gradient reversal layer (Ganin & Lempitsky, 2015).

  Example:
    >>> reverse(0.3)
    scale(-0.3)
  """
  if isinstance(lam, (int, float)):
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
  def linear_factor(self) -> Optional[Factor]:
    factor: Factor = 1
    for t in self.transforms:
      c = t.linear_factor
      if c is None:
        return None
      factor = factor * c
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
    GraphGradError: if an argument is not callable.

  Example:
    >>> chain(scale(2.0), clip_by_norm(1.0))
    chain(scale(2.0), clip_by_norm(1.0))
  """
  return _Chain(as_transform(t) for t in transforms)


def linear(fn: Callable[[tf.Tensor], tf.Tensor], factor) -> Transform:
  """Declares that the callable ``fn`` computes ``factor * g``.

  A plan then backpropagates through a layer with this upstream (or edge)
  rewrite once, weighting the share below by ``factor``, where an undeclared
  callable costs a second backward pass. ``fn`` still runs where the plan
  needs the rewritten gradient itself (summaries, a backward replacement).
  Declaring a factor that ``fn`` does not compute gives wrong gradients.

  Args:
    fn: a callable mapping a gradient tensor to ``factor`` times it.
    factor: a Python number or a scalar tensor.

  Returns:
    A transform whose :attr:`Transform.linear_factor` is ``factor``.

  Raises:
    GraphGradError: if ``fn`` is not callable, or ``factor`` is neither a
      number nor a tensor.

  Example:
    >>> t = linear(lambda g: 0.25 * g, 0.25)
    >>> t.linear_factor, float(t(tf.constant(2.0)))
    (0.25, 0.5)
  """
  if isinstance(factor, bool) or not (isinstance(factor, (int, float))
                                      or tf.is_tensor(factor)):
    raise _errors.GraphGradError(
        f"linear: `factor` must be a Python number or a scalar tensor, the "
        f"c of fn(g) = c * g; got {type(factor).__name__} {factor!r}. Pass "
        f"e.g. gg.transforms.linear(fn, 0.5).")
  as_transform(fn)  # refuses what is not callable
  return _Fn(fn, factor)


def is_identity(transform: Transform) -> bool:
  """True when ``transform`` is known to leave every gradient unchanged."""
  if isinstance(transform, _Scale):
    return isinstance(transform.c, (int, float)) and transform.c == 1
  if isinstance(transform, _Chain):
    return all(is_identity(t) for t in transform.transforms)
  return False
