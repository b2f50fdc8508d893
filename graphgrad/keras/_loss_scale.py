"""Keras mixed precision on a plan tape: ``plan.tape(loss_scale=...)``.

A loss-scale optimizer (Keras 3's or tf-keras') backpropagates ``S * loss``
and unscales the gradients itself, skipping the step when they are not
finite. A plan tape whose rules hold a loss scale computes the plan's
gradients of the scaled loss with ``S`` (:func:`scale_of`) active
(``graphgrad.transforms._scaled``): every non-linear transform sees
``g / S`` in float32, and the gradients it returns are scaled as a plain
tape's are, so the optimizer's unscaling and finiteness check are
unchanged. :func:`warn_unscaled` warns once when a float16 model
runs a non-linear plan in a custom loop without a loss scale.
"""

import logging
from typing import Optional

import tensorflow as tf

from graphgrad import _errors
from graphgrad.core._rules import PlanRules
from graphgrad.keras._layer_index import tf_variable

log = logging.getLogger("graphgrad")

def scale_of(loss_scale) -> Optional[tf.Tensor]:
  """The loss scale as a float32 scalar, or ``None`` for no scaling.

  Args:
    loss_scale: a Keras 3 or tf-keras loss-scale optimizer (or any Keras
      optimizer: without a scale, ``None``), a Python number or a scalar
      tensor or variable.

  Raises:
    GraphGradError: for anything else.
  """
  if loss_scale is None:
    return None
  if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
    return tf.constant(float(loss_scale), tf.float32)
  if tf.is_tensor(loss_scale) or isinstance(loss_scale, tf.Variable):
    return _scalar(loss_scale)
  if hasattr(loss_scale, "get_scaled_loss"):  # tf-keras loss-scale optimizer
    return _scalar(loss_scale.loss_scale)
  if hasattr(loss_scale, "dynamic_scale") or hasattr(loss_scale,
                                                     "initial_scale"):
    # Keras 3's LossScaleOptimizer scales by this value in scale_loss().
    if getattr(loss_scale, "built", False):
      return _scalar(loss_scale.dynamic_scale)
    return tf.constant(float(loss_scale.initial_scale), tf.float32)
  if hasattr(loss_scale, "apply_gradients"):  # any other optimizer
    factor = getattr(loss_scale, "loss_scale_factor", None)
    return None if factor is None else tf.constant(float(factor), tf.float32)
  raise _errors.GraphGradError(
      f"plan.tape: `loss_scale` must be a loss-scale optimizer (Keras 3's "
      f"keras.optimizers.LossScaleOptimizer or tf-keras' "
      f"mixed_precision.LossScaleOptimizer), a number or a scalar tensor; "
      f"got {type(loss_scale).__name__}. Pass the optimizer that applies "
      f"the gradients: plan.tape(loss_scale=optimizer).")


def _scalar(value) -> tf.Tensor:
  var = tf_variable(value)
  t = tf.convert_to_tensor(var if var is not None else value)
  if t.shape.rank not in (None, 0):
    raise _errors.GraphGradError(
        f"plan.tape: `loss_scale` must be a scalar; got a tensor of shape "
        f"{t.shape}. Pass the optimizer, or its scalar loss scale.")
  return tf.cast(t, tf.float32)


def float16_model(model) -> bool:
  """True when the model (or one of its layers) computes in float16."""
  layers = [model] + list(getattr(model, "layers", ()) or ())
  return any(str(getattr(l, "compute_dtype", "")) == "float16"
             for l in layers)


def nonlinear(rules: PlanRules) -> bool:
  """True when a rule's result depends on the gradient's scale."""
  fns = [fn for _, _, fn in rules.backward_transforms]
  fns += [r.transform for r in rules.parameters]
  if any(fn.linear_factor is None for fn in fns):
    return True
  if any(not fn.homogeneous for fn in rules.replacements.values()):
    return True
  tasks = list(rules.tasks.values())
  if rules.parameter_tasks is not None:
    tasks.append(rules.parameter_tasks)
  return any(not t.method.homogeneous for t in tasks)


def warn_unscaled(model, rules: PlanRules) -> bool:
  """Logs when a float16 model has a non-linear plan and no loss scale.

  Returns:
    True when it logged: the caller logs once per plan.
  """
  if not float16_model(model) or not nonlinear(rules):
    return False
  log.warning(
      "graphgrad KerasPlan on %s: the model computes in float16 and the "
      "plan has non-linear declarations, but the tape has no loss scale, so "
      "they see the loss-scaled gradients of a loss-scale optimizer. Pass "
      "it: `with plan.tape(loss_scale=optimizer) as tape:` (or the scale "
      "as a number).", model.name)
  return True
