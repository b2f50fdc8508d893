"""Whether a GradientPlan's optimizer is adaptive, read from its update.

A constant positive scale of a gradient changes little under an adaptive
optimizer: Adam, RMSProp and Adagrad divide each parameter's step by a running
estimate of that parameter's gradient magnitude, which scales by the same
factor. The warning itself is shared with KerasPlan (``core._logged_advice``).
"""

import logging
from typing import Sequence

import tensorflow as tf

from graphgrad.analysis import _graph_util
from graphgrad.core._logged_advice import log_if_scaled

log = logging.getLogger("graphgrad")

# The update rules that divide by a root of a running average of squared
# gradients: TensorFlow's fused kernels (also as Resource* and Sparse*), and
# the square roots an optimizer written out by hand (BERT's
# AdamWeightDecayOptimizer) takes of a gradient's moments.
_ADAPTIVE_KERNELS = frozenset({
    "ApplyAdam", "ApplyAdamWithAmsgrad", "ApplyAdaMax", "ApplyAdadelta",
    "ApplyAdagrad", "ApplyAdagradV2", "ApplyAdagradDA", "ApplyRMSProp",
    "ApplyCenteredRMSProp"})
_ROOTS = frozenset({"Sqrt", "Rsqrt"})


def _normalizes(op_type: str) -> bool:
  return (op_type in _ROOTS or
          op_type.replace("Resource", "").replace("Sparse", "")
          in _ADAPTIVE_KERNELS)


def is_adaptive(update_ops: Sequence[tf.Operation], grads) -> bool:
  """True when the optimizer's update normalises each parameter's step.

  Read from its update rule, not its class: among ``update_ops`` (the ops
  its ``apply_gradients`` added, in creation order), a fused adaptive kernel
  or a square root that depends on one of ``grads``. An update inside a
  ``tf.function`` or a v2 cond (a Keras optimizer, ``apply_if_finite``) is
  read from the function's body.
  """
  tainted = {(g.values if isinstance(g, tf.IndexedSlices) else g).op
             for g in grads if g is not None}
  calls = []
  for op in update_ops:
    if any(a.func.name for a in op.node_def.attr.values()):
      calls.append(op)  # a tf.function's call, a v2 cond (apply_if_finite)
    if any(t.op in tainted for t in op.inputs):
      tainted.add(op)
      if _normalizes(op.type):
        return True
  return _graph_util.calls_node(calls, _normalizes)


def warn_if_scale_cancels(rules, optimizer,
                          update_ops: Sequence[tf.Operation], grads) -> bool:
  """Logs one warning when a plan's compiled ``rules`` only scale
  gradients under ``optimizer``, whose update (``update_ops``, applying
  ``grads``) is adaptive (:func:`is_adaptive`).

  Returns:
    True when a warning was logged.
  """
  if not is_adaptive(update_ops, grads):
    return False
  return log_if_scaled(rules, type(optimizer).__name__)
