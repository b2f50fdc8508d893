"""Parameter transforms, applied once for both executors.

:func:`transform_parameters` applies a plan's compiled
:class:`~graphgrad.core._rules.ParameterRule` s, in their order (each layer's
own in declaration order, then the group transforms), to a list of
``(gradient, variable)`` pairs. A per-tensor transform sees each gradient of
its layers' variables with a context naming the variable's layer; a group
transform sees all of its layers' pairs at once. Each executor says which
layers hold a variable and records what each transform did in its plan's
trace; under a loss scale (``transforms._scaled``)
every transform sees the unscaled gradients.
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple

from graphgrad._types import Gradient
from graphgrad.core._rules import ParameterRule
from graphgrad.transforms import _checks
from graphgrad.transforms._context import TransformContext
from graphgrad.transforms._group import GroupTransform

# (context, before, after): how an executor records a transform in its
# plan's trace (``core._trace``).
Record = Callable[[TransformContext, Gradient, Gradient], None]


def transform_parameters(
    rules: Sequence[ParameterRule], pairs: Sequence[Tuple[Gradient, Any]],
    layer_of: Callable[[Any, Tuple[str, ...]], Optional[str]],
    context: Callable[..., TransformContext],
    record: Optional[Record] = None) -> List[Gradient]:
  """The gradients of ``pairs`` after the parameter transforms ``rules``.

  Args:
    rules: the plan's parameter rules, in the order they act.
    pairs: ``(gradient, variable)`` pairs; ``variable`` is ``None`` for a
      source that is no variable (a tensor given to ``tape.gradient``).
    layer_of: ``(variable, layers) -> name``: the layer among ``layers``
      that holds the variable (a Keras layer holds its nested layers'
      variables too), or ``None``.
    context: ``(layer, role, **kw) -> TransformContext``.
    record: called with ``(context, before, after)`` for every gradient
      a transform changed, a group transform's included.

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
          context(", ".join(layers), "gradients"),
          f"transform_gradients({named!r}, {fn!r})")
      for i, g in zip(idx, new):
        v = pairs[i][1]
        where = f"transform_gradients({named!r}, {fn!r}) on {v.name}"
        g = _checks.check_result(grads[i], g, where)
        if record is not None and grads[i] is not None:
          record(context(layer_of(v, layers) or "", "gradients", variable=v),
                 grads[i], g)
        grads[i] = g
      continue
    for i in idx:
      v = pairs[i][1]
      if grads[i] is not None:
        ctx = context(layer_of(v, layers) or "", "gradients", variable=v)
        g = _checks.checked(fn, grads[i], ctx,
                            f"transform_gradients({named!r}) on {v.name}")
        if record is not None:
          record(ctx, grads[i], g)
        grads[i] = g
  return grads
