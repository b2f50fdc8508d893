"""Parameter transforms, applied once for both executors.

:func:`transform_parameters` applies a plan's compiled
:class:`~graphgrad.core._rules.ParameterRule` s, in their order (each layer's
own in declaration order, then the group transforms), to a list of
``(gradient, variable)`` pairs. A per-tensor transform sees each gradient of
its layers' variables with a context naming the variable's layer; a group
transform sees all of its layers' pairs at once. Each executor says which
layers hold a variable and how a transform is applied (the TF1 executor
records it in the plan's trace); under a loss scale (``transforms._scaled``)
every transform sees the unscaled gradients.
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple

from graphgrad._types import Gradient
from graphgrad.core._rules import ParameterRule
from graphgrad.transforms import _checks
from graphgrad.transforms._context import TransformContext
from graphgrad.transforms._group import GroupTransform

# (fn, gradient, context, where) -> the transformed gradient, checked.
Apply = Callable[[Any, Gradient, TransformContext, str], Gradient]


def transform_parameters(
    rules: Sequence[ParameterRule], pairs: Sequence[Tuple[Gradient, Any]],
    layer_of: Callable[[Any, Tuple[str, ...]], Optional[str]],
    context: Callable[..., TransformContext],
    apply: Apply = _checks.checked) -> List[Gradient]:
  """The gradients of ``pairs`` after the parameter transforms ``rules``.

  Args:
    rules: the plan's parameter rules, in the order they act.
    pairs: ``(gradient, variable)`` pairs; ``variable`` is ``None`` for a
      source that is no variable (a tensor given to ``tape.gradient``).
    layer_of: ``(variable, layers) -> name``: the layer among ``layers``
      that holds the variable (a Keras layer holds its nested layers'
      variables too), or ``None``.
    context: ``(layer, role, **kw) -> TransformContext``.
    apply: how a per-tensor transform is applied and checked.

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
        where = (f"transform_gradients({named!r}, {fn!r}) on "
                 f"{pairs[i][1].name}")
        grads[i] = _checks.check_result(grads[i], g, where)
      continue
    for i in idx:
      v = pairs[i][1]
      if grads[i] is not None:
        owner = layer_of(v, layers) or ""
        grads[i] = apply(fn, grads[i],
                         context(owner, "gradients", variable=v),
                         f"transform_gradients({named!r}) on {v.name}")
  return grads
