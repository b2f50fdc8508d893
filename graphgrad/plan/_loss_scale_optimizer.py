"""Loss scaling for TF1's MixedPrecisionLossScaleOptimizer in a GradientPlan.

A plan made with ``loss_scale=`` that optimizer (or first applied with it)
builds what its ``minimize()`` does: the plan backpropagates ``loss * S``
(its seed is the loss scale ``S``), the parameter gradients are multiplied
by ``1 / S`` as the optimizer's own unscaling does, and the optimizer's
``apply_gradients`` skips a non-finite step and updates a dynamic scale. In
between, every transform sees the unscaled gradient, in float32 where the
gradient is float16 (``graphgrad.transforms._scaled``, as in a KerasPlan's
tape). TensorFlow's loss scales are powers of two, so both multiplications
are exact and a transform's result reaches the optimizer unchanged; task
combinations and backward replacements follow the compiled rules' one
policy (``graphgrad.core._rules``).
"""

from typing import Any, Callable, Optional

import tensorflow as tf

from graphgrad import _errors

_MPLSO = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer


def is_loss_scale_optimizer(optimizer) -> bool:
  """True for a TF1 ``MixedPrecisionLossScaleOptimizer``."""
  return isinstance(optimizer, _MPLSO)


def loss_scale_of(optimizer, what: str = "apply_gradients: `optimizer`"
                  ) -> Optional[Callable[[], Any]]:
  """The loss scale of a TF1 loss-scale optimizer, else ``None``.

  Returns the ``LossScale`` object; calling it gives the current scale as a
  tensor, the very object ``minimize()`` reads. The optimizer has no
  accessor of its own for it; it tracks it as its checkpoint dependency
  ``loss_scale``, which the public ``tf.train.TrackableView`` lists.

  Raises:
    GraphGradError: if the optimizer tracks no callable ``loss_scale``.
  """
  if not isinstance(optimizer, _MPLSO):
    return None
  scale = dict(tf.train.TrackableView(optimizer).children(optimizer)).get(
      "loss_scale")
  if not callable(scale):
    raise _errors.GraphGradError(
        f"{what}: the MixedPrecisionLossScaleOptimizer {optimizer!r} "
        f"tracks no callable `loss_scale` dependency (got {scale!r}), so its "
        f"loss scale cannot be read on this TensorFlow "
        f"{tf.__version__}. Apply the plan with the optimizer it wraps, or "
        f"with a Keras LossScaleOptimizer inside a KerasPlan.")
  return scale


def unscale(scale: tf.Tensor, grads_and_vars):
  """``(g * (1 / S), v)`` pairs: the optimizer's own unscaling arithmetic."""
  reciprocal = 1 / scale
  out = []
  for g, v in grads_and_vars:
    if isinstance(g, tf.IndexedSlices):
      g = tf.IndexedSlices(g.values * reciprocal, g.indices, g.dense_shape)
    elif g is not None:
      g = g * reciprocal
    out.append((g, v))
  return out


def seed(loss: tf.Tensor, scale) -> tf.Tensor:
  """The gradient of the loss when ``loss * S`` is backpropagated."""
  return tf.ones_like(loss) * tf.cast(scale, loss.dtype)
