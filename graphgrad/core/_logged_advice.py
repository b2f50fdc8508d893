"""Advice logged to the ``graphgrad`` logger, the same for both plans.

Each plan finds what to say from its own executor (``GradientPlan`` from
its tf.Graph, ``KerasPlan`` from its optimizer's class or a traced step's
``FuncGraph``) and says it here, once:

* a constant positive scale of a gradient changes little under an adaptive
  optimizer: Adam, RMSProp and Adagrad divide each parameter's step by a
  running estimate of that parameter's gradient magnitude, which scales by
  the same factor. Only epsilon and the first few steps still see it;
* variables the loss depends on that get no gradient (an op without one,
  ``tf.round``, lies between them and the loss), with the op and the
  declaration that passes a gradient through it.
"""

import logging
from typing import Iterable, List, Optional

import tensorflow as tf

from graphgrad.transforms._transforms import Transform

log = logging.getLogger("graphgrad")


def pure_scale(fns: Iterable[Transform]) -> Optional[float]:
  """The overall factor of transforms that only scale by positive numbers.

  Returns ``None`` when any transform does something else: a reversal
  (negative factor) or zero changes what the optimizer sees, and noise,
  clipping or a tensor-valued factor is not a constant scale.
  """
  factor = 1.0
  for t in fns:
    c = t.linear_factor  # None for group transforms
    if c is None or c <= 0:
      return None
    factor *= c
  return None if factor == 1.0 else factor


# What a person can do instead, in the terms of the optimizers they use.
_TF1_FIX = ("give them their own learning rate (a second optimizer on their "
            "var_list), or train with "
            "tf.compat.v1.train.GradientDescentOptimizer or MomentumOptimizer")
_KERAS_FIX = ("give them their own learning rate (a second optimizer that "
              "applies their gradients), or train with keras.optimizers.SGD "
              "(with or without momentum)")


def log_if_scaled(rules, optimizer_name: str, fix: str = _TF1_FIX) -> bool:
  """Logs the warning when ``rules`` (a plan's compiled declarations) only
  scale gradients, under the adaptive optimizer ``optimizer_name``; ``fix``
  says what to do instead, in the terms of the plan's optimizers.

  Returns:
    True when a warning was logged.
  """
  found = []
  declared = [("transform_gradients", layer, fns)
              for layer, fns in rules.own_parameters.items()]
  declared += [(kind, key, (fn,))
               for kind, key, fn in rules.backward_transforms]
  for kind, key, fns in declared:
    factor = pure_scale(fns)
    if factor is not None:
      where = (", ".join(map(repr, key)) if isinstance(key, tuple)
               else repr(key))
      found.append(f"{kind}({where}) scales by {factor:g}")
  if not found:
    return False
  if len(found) > 3:  # one readable line, however many layers
    found = found[:3] + [f"and {len(found) - 3} more"]
  log.warning(
      "%s under %s: an adaptive optimizer divides each parameter's step by a "
      "running estimate of its gradient's magnitude, so a constant scale "
      "largely cancels out. To make these parameters learn faster or slower, "
      "%s, where a scale acts like a learning-rate factor.",
      "; ".join(found), optimizer_name, fix)
  return True


# The Keras optimizers (Keras 3 and tf-keras, and their subclasses such as
# AdamW) whose update divides by a root of a running average of squared
# gradients.
_KERAS_ADAPTIVE = frozenset({"Adam", "RMSprop", "Adagrad", "Adamax",
                             "Adadelta", "Nadam"})


def is_adaptive_keras(optimizer) -> bool:
  """True for a Keras optimizer whose step each parameter's gradient
  magnitude normalises, read from its class (a Keras optimizer builds its
  update only when it first applies gradients); a loss-scale optimizer is
  read through the optimizer it wraps."""
  inner = getattr(optimizer, "inner_optimizer", None)
  if inner is not None and inner is not optimizer:
    return is_adaptive_keras(inner)
  return any(cls.__name__ in _KERAS_ADAPTIVE
             and cls.__module__.split(".")[0] in ("keras", "tf_keras")
             for cls in type(optimizer).__mro__)


def warn_if_keras_scale_cancels(rules, optimizer) -> bool:
  """:func:`warn_if_scale_cancels` for a Keras optimizer.

  Returns:
    True when a warning was logged.
  """
  if not is_adaptive_keras(optimizer):
    return False
  inner = getattr(optimizer, "inner_optimizer", None) or optimizer
  return log_if_scaled(rules, type(inner).__name__, _KERAS_FIX)


def log_without_gradient(layers: List[str], loss_name: str,
                         variables: List[str],
                         ops: List[tf.Operation],
                         through: Optional[str] = None) -> None:
  """Logs the warning of :func:`warn_without_gradient`, for either plan.

  Args:
    layers: the layers whose variables get no gradient.
    loss_name: the name of the loss tensor.
    variables: the names of those variables.
    ops: the ops without a gradient between them and the loss (may be
      empty).
    through: what ``straight_through`` takes to pass a gradient through
      the first op: its type (``GradientPlan``, the default) or the Keras
      layer that holds it (``KerasPlan``).
  """
  if ops:
    names = ", ".join(f"{op.name} ({op.type})" for op in ops[:4])
    first = ops[0]
    arg = first.type if through is None else through
    why = (f"the op(s) {names} between them and the loss have no gradient, "
           f"so nothing reaches below them. To train through "
           f"{first.name!r}, declare plan.straight_through({arg!r}) "
           f"(an identity backward pass) or "
           f"plan.override_gradient({arg!r}, fn)")
  else:
    why = ("no op between them and the loss passes a gradient. Give the op "
           "that blocks it a backward pass with plan.straight_through(op) or "
           "plan.override_gradient(op, fn)")
  log.warning(
      "layer(s) %s get no gradient from the loss %s (%d variable(s): %s): "
      "%s; otherwise apply_gradients skips these variables.",
      ", ".join(map(repr, layers)), loss_name, len(variables),
      ", ".join(variables[:4]), why)
