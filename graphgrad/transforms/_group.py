"""Group transforms: rewrite all of one layer's parameter gradients at once.

A :class:`GroupTransform` sees the whole layer, ``[(grad, var), ...]``, and
returns one gradient per pair. It is declared like any other parameter
transform, with ``plan.transform_gradients(layer, t)``; it chains with plain
transforms in declaration order. ``None`` gradients keep their position and
stay ``None``; the group quantities (norms) are computed over the present
gradients only.
"""

from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient, gradient_values
from graphgrad.transforms import _validate
from graphgrad.transforms._transforms import TransformContext


def _rescale(g, factor):
  if isinstance(g, tf.IndexedSlices):
    return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype),
                            g.indices, g.dense_shape)
  return g * tf.cast(factor, g.dtype)


def global_norm(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
  """sqrt of the sum of squares of every element, in float32 or wider."""
  dtype = tf.float64 if any(t.dtype == tf.float64 for t in tensors) else (
      tf.float32)
  return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(t, dtype)))
                           for t in tensors]))


class GroupTransform:
  """Base class of transforms that see all of a layer's gradients at once.

  The contract of a user-written one: a subclass implements
  :meth:`apply_group`, which maps the layer's present ``(grad, var)`` pairs
  to one new gradient per pair, each of its pair's shape and dtype (the plan
  checks them). Calling the transform skips ``None`` gradients (they keep
  their position and stay ``None``) and opens a name scope (``name``). It is
  declared with ``plan.transform_gradients(layer, t)`` only: it has no
  meaning for one upstream or edge gradient. ``reads_global_step`` and
  ``context.resources`` work as for a :class:`Transform`.

  Example:
    >>> import tensorflow as tf
    >>> class ToNorm10(GroupTransform):
    ...   name = "to_norm_10"
    ...   def apply_group(self, grads_and_vars, context):
    ...     norm = global_norm([g for g, _ in grads_and_vars])
    ...     return [g * (10.0 / norm) for g, _ in grads_and_vars]
    >>> w, b = tf.Variable([[1.0]]), tf.Variable([1.0])
    >>> out = ToNorm10()([(tf.constant([[3.0]]), w), (None, None),
    ...                   (tf.constant([4.0]), b)])
    >>> [None if g is None else g.numpy().tolist() for g in out]
    [[[6.0]], None, [8.0]]
  """

  name = "group_transform"
  reads_global_step = False
  # A group transform is never ``c * g`` per gradient (see
  # ``Transform.linear_factor``): it sees all of them at once.
  linear_factor = None

  def apply_group(self, grads_and_vars: Sequence[Tuple[Gradient, tf.Variable]],
                  context: TransformContext) -> List[Gradient]:
    """Maps present ``(grad, var)`` pairs to new gradients, one per pair."""
    raise NotImplementedError

  def __call__(self, grads_and_vars: Sequence[Tuple[Gradient, tf.Variable]],
               context: Optional[TransformContext] = None) -> List[Gradient]:
    grads_and_vars = list(grads_and_vars)
    present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
    out: List[Gradient] = [None] * len(grads_and_vars)
    if not present:
      return out
    with tf.name_scope(self.name):
      context = context or TransformContext(role="gradients")
      new = list(self.apply_group([grads_and_vars[i] for i in present],
                                  context))
    if len(new) != len(present):
      raise _errors.IncompatibleGradientError(
          f"{self!r}: apply_group returned {len(new)} gradients for "
          f"{len(present)} (gradient, variable) pairs with a gradient. "
          f"Return one gradient per pair it receives, in order.")
    for i, g in zip(present, new):
      out[i] = g
    return out

  def __repr__(self) -> str:
    return f"{self.name}()"


class _ClipByGlobalNorm(GroupTransform):
  name = "clip_by_global_norm"

  def __init__(self, clip_norm):
    self.clip_norm = clip_norm

  def apply_group(self, grads_and_vars, context):
    grads = [g for g, _ in grads_and_vars]
    norm = global_norm([gradient_values(g) for g in grads])
    clip = tf.cast(self.clip_norm, norm.dtype)
    factor = clip / tf.maximum(norm, clip)
    return [_rescale(g, factor) for g in grads]

  def __repr__(self):
    return f"clip_by_global_norm({self.clip_norm!r})"


def clip_by_global_norm(clip_norm) -> GroupTransform:
  """Clips a layer's gradients jointly by their global norm.

  With ``G = sqrt(sum_i ||g_i||^2)`` over the layer's gradients, each
  ``g_i`` becomes ``g_i * clip_norm / max(G, clip_norm)``: unchanged when
  ``G <= clip_norm``, else rescaled so that the layer's global norm is
  ``clip_norm``. This is ``tf.clip_by_global_norm`` per layer. For a sparse
  gradient the norm is that of its ``.values``.

  Args:
    clip_norm: a positive finite Python number or a scalar tensor.

  Returns:
    A group transform, for ``plan.transform_gradients(layer, t)``.

  Raises:
    GraphGradError: if ``clip_norm`` is not a number or scalar tensor, is
      NaN or infinite, or is a number that is not positive.

  Example:
    >>> clip_by_global_norm(1.0)
    clip_by_global_norm(1.0)
  """
  _validate.number("clip_by_global_norm", "clip_norm", clip_norm,
                   what="positive", low=0.0, low_open=True,
                   fix="Use gg.transforms.zero() to drop gradients.")
  return _ClipByGlobalNorm(clip_norm)


class _TrustRatio(GroupTransform):
  name = "trust_ratio"

  def __init__(self, eta, epsilon):
    self.eta, self.epsilon = eta, epsilon

  def apply_group(self, grads_and_vars, context):
    grads = [g for g, _ in grads_and_vars]
    g_norm = global_norm([gradient_values(g) for g in grads])
    w_norm = global_norm([v.read_value() if hasattr(v, "read_value") else v
                          for _, v in grads_and_vars])
    eta = tf.cast(self.eta, g_norm.dtype)
    eps = tf.cast(self.epsilon, g_norm.dtype)
    ratio = eta * w_norm / (g_norm + eps)
    ok = tf.logical_and(w_norm > 0, g_norm > 0)
    ratio = tf.where(ok, ratio, tf.ones_like(ratio), name="ratio")
    return [_rescale(g, ratio) for g in grads]

  def __repr__(self):
    return f"trust_ratio({self.eta!r}, epsilon={self.epsilon!r})"


def trust_ratio(eta, epsilon: float = 1e-9) -> GroupTransform:
  """LARS layer-wise trust ratio (You et al., 2017, "Large Batch Training of
  Convolutional Networks").

  With ``||w||`` the global norm of the layer's variables that have a
  gradient and ``||g||`` that of their gradients, every gradient of the layer
  becomes

      g_i * eta * ||w|| / (||g|| + epsilon),

  and stays ``g_i`` when ``||w|| = 0`` or ``||g|| = 0`` (a freshly
  zero-initialised layer would otherwise never move), as TensorFlow's
  ``LARSOptimizer`` does. ``epsilon`` (default ``1e-9``) only guards the
  division; weight decay, which the paper adds to the denominator, belongs
  to the loss here. The optimizer's learning rate then acts as LARS's global
  rate. The norms are over the layer, not per variable; to get per-variable
  ratios, pass ``layers=`` to ``gg.analyze`` with one variable per layer.

  Args:
    eta: the trust coefficient (the paper uses 0.001), a Python number or a
      scalar tensor.
    epsilon: added to ``||g||`` in the denominator, a Python number or a
      scalar tensor.

  Returns:
    A group transform, for ``plan.transform_gradients(layer, t)``.

  Raises:
    GraphGradError: if an argument is not a number or scalar tensor, is NaN
      or infinite, ``eta`` is not positive or ``epsilon`` is negative.

  Example:
    >>> trust_ratio(0.001)
    trust_ratio(0.001, epsilon=1e-09)
  """
  _validate.number("trust_ratio", "eta", eta, what="positive", low=0.0,
                   low_open=True, fix="The paper uses eta=0.001.")
  _validate.number("trust_ratio", "epsilon", epsilon, what="non-negative",
                   low=0.0, fix="Pass e.g. epsilon=1e-9.")
  return _TrustRatio(eta, epsilon)
