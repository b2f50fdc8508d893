"""What a plan tape reports about a traced step, through the ``graphgrad`` log.

A variable of the model that the loss depends on but that gets no gradient
(a ``tf.round`` in a ``Lambda`` or custom layer lies between it and the
loss) is reported once per model, with the op and the layer to declare
``straight_through`` on: the message is ``GradientPlan``'s
(``core._logged_advice.log_without_gradient``). The op is found in the
traced step's ``FuncGraph`` (``fit``, ``tf.function``); an eager step has no
op graph to search, and is not checked.
"""

import re
import weakref
from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

from graphgrad.analysis import _no_gradient
from graphgrad.core._logged_advice import log_without_gradient
from graphgrad.keras._layer_index import tf_variable

# The models already warned about: one warning per model, however many
# steps are traced.
_WARNED: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _owner(plan, var: tf.Variable) -> Optional[str]:
  """The innermost layer path whose variables include ``var``."""
  found = [(len(vs), path) for path in plan.layer_names
           for vs in [[tf_variable(v) for v in plan.own_variables(path)]]
           if any(v is var for v in vs)]
  return min(found)[1] if found else None


def _holder(plan, op: tf.Operation) -> Optional[str]:
  """The layer whose name scope holds ``op``, innermost first."""
  scopes = op.name.split("/")[:-1]
  paths = {p.split("/")[-1]: p for p in plan.layer_names}
  for scope in reversed(scopes):
    # A traced call's scope may carry a uniquifying suffix: quant_1.
    base = re.sub(r"_\d+$", "", scope)
    for name in (scope, base):
      if name in paths:
        return paths[name]
  return None


@tf.autograph.experimental.do_not_convert
def warn_without_gradient(plan, target, sources: Sequence,
                          grads: Sequence) -> bool:
  """Logs once per model when variables the loss depends on get no gradient.

  Args:
    plan: the tape's ``PlanView``.
    target: the differentiated loss (a structure of tensors).
    sources: the flat sources of the gradient.
    grads: their flat gradients.

  Returns:
    True when a warning was logged.
  """
  tensors = [t for t in tf.nest.flatten(target) if tf.is_tensor(t)]
  if (not tensors or tf.executing_eagerly()
      or all(g is not None for g in grads)
      or not hasattr(tensors[0], "graph") or plan.model in _WARNED):
    return False
  graph = tensors[0].graph
  captured: Dict[int, tf.Tensor] = {
      id(outer): inner for outer, inner in graph.captures}
  missing: List[tuple] = []  # (layer, variable, captured handle)
  for s, g in zip(sources, grads):
    var = tf_variable(s)
    if g is not None or var is None or id(var.handle) not in captured:
      continue
    layer = _owner(plan, var)
    handle = captured[id(var.handle)]
    if layer is not None and _no_gradient.ops_on_path(tensors, [handle]):
      missing.append((layer, var, handle))
  if not missing:
    return False
  _WARNED[plan.model] = True
  ops = _no_gradient.ops_with_zero_gradient(
      tensors, [h for _, _, h in missing])
  holder = _holder(plan, ops[0]) if ops else None
  log_without_gradient(
      list(dict.fromkeys(layer for layer, _, _ in missing)),
      tensors[0].name, [v.name.split(":")[0] for _, v, _ in missing], ops,
      through=holder or (ops[0].type if ops else None))
  return True
