"""Parameter transforms, applied once for both executors.

:func:`transform_parameters` applies a plan's compiled
:class:`~graphgrad.core._rules.ParameterRule` s, in their order (each layer's
own in declaration order, then the group transforms), to a list of
``(gradient, variable)`` pairs. A per-tensor transform sees each gradient of
its layers' variables with a context naming the variable's layer; a group
transform sees all of its layers' pairs at once. Each executor says which
layers hold a variable; the backward pass (``core._layer_step``) gives the
contexts, records what each transform did in the plan's trace, and carries
the loss scale, under which every transform sees the unscaled gradients
(``transforms._scaled``).
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple

from graphgrad._types import Gradient
from graphgrad.core._layer_step import BackwardPass
from graphgrad.core._rules import ParameterRule
from graphgrad.transforms import _checks
from graphgrad.transforms._group import GroupTransform


def transform_parameters(
    rules: Sequence[ParameterRule], pairs: Sequence[Tuple[Gradient, Any]],
    layer_of: Callable[[Any, Tuple[str, ...]], Optional[str]],
    step: BackwardPass) -> List[Gradient]:
  """The gradients of ``pairs`` after the parameter transforms ``rules``.

  Args:
    rules: the plan's parameter rules, in the order they act.
    pairs: ``(gradient, variable)`` pairs; ``variable`` is ``None`` for a
      source that is no variable (a tensor given to ``tape.gradient``).
    layer_of: ``(variable, layers) -> name``: the layer among ``layers``
      that holds the variable (a Keras layer holds its nested layers'
      variables too), or ``None``.
    step: the backward pass: its contexts, its trace (every gradient a
      transform changed, a group transform's included) and its loss scale.

  Returns:
    One gradient per pair.

  Raises:
    GraphGradError: naming the declaration, for an exception a transform
      raised; IncompatibleGradientError: for a result of another shape or
      dtype.
  """
  grads = [g for g, _ in pairs]
  for rule in rules:
    idx = [i for i, (_, v) in enumerate(pairs)
           if v is not None and layer_of(v, rule.layers) is not None]
    layers, fn = rule.layers, rule.transform
    named = layers[0] if len(layers) == 1 else list(layers)  # for messages
    if isinstance(fn, GroupTransform):
      new = _checks.checked_group(
          fn, [(grads[i], pairs[i][1]) for i in idx],
          step.context(", ".join(layers), "gradients"),
          f"transform_gradients({named!r}, {fn!r})", step.scale)
      for i, g in zip(idx, new):
        v = pairs[i][1]
        where = f"transform_gradients({named!r}, {fn!r}) on {v.name}"
        g = _checks.check_result(grads[i], g, where)
        if grads[i] is not None:
          step.record(step.context(layer_of(v, layers) or "", "gradients",
                                   variable=v), grads[i], g)
        grads[i] = g
      continue
    for i in idx:
      v = pairs[i][1]
      if grads[i] is not None:
        ctx = step.context(layer_of(v, layers) or "", "gradients",
                           variable=v)
        grads[i] = step.apply(fn, grads[i], ctx,
                              f"transform_gradients({named!r}) on {v.name}")
  return grads
