"""Advice logged to the ``graphgrad`` logger about plans that defeat themselves.

A constant positive scale of a gradient changes little under an adaptive
optimizer: Adam, RMSProp and Adagrad divide each parameter's step by a running
estimate of that parameter's gradient magnitude, which scales by the same
factor. Only epsilon and the first few steps still see it.
"""

import logging
from typing import Iterable, Optional, Sequence

import tensorflow as tf

from graphgrad.analysis import _graph_util
from graphgrad.transforms._transforms import Transform

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
  found = []
  edges = {k: e.transform for k, e in rules.edges.items()}
  for kind, table in (("transform_gradients", rules.own_parameters),
                      ("transform_upstream", rules.upstream),
                      ("transform_edge", edges)):
    for key, fns in table.items():
      factor = pure_scale(fns if isinstance(fns, tuple) else (fns,))
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
      "give them their own learning rate (a second optimizer on their "
      "var_list), or train with tf.compat.v1.train.GradientDescentOptimizer "
      "or MomentumOptimizer, where a scale acts like a learning-rate factor.",
      "; ".join(found), type(optimizer).__name__)
  return True
