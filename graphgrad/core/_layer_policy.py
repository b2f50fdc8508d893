"""The per-layer policy: how one layer's declarations act on its gradient.

Both executors call :func:`layer_backward` for a rewritten layer, with the
gradient at its outputs and a VJP provider: the TF1 engine (one segment
call per VJP) and the Keras tape (its inner tape's ``gradient``). The order
is fixed: a task combination rewrites the gradient ``g``; the layer's own
variables get their gradients from ``g``; the upstream transform maps ``g``
to ``fn(g)``; the inputs get what a VJP of ``fn(g)`` gives, or what the
backward replacement or the override returns instead. A linear transform
``c * g`` takes one VJP of ``g``, whose part below is weighted by ``c``.
"""

import dataclasses
from typing import Callable, List, Optional, Protocol, Tuple

from graphgrad.core._gradients import is_zero


@dataclasses.dataclass(frozen=True)
class LayerRules:
  """One layer's declarations, as the policy applies them.

  Each rule takes and returns one gradient per output tensor, or one per
  input for ``replace`` and ``override``; ``None`` means no such rule.

  Attributes:
    tasks: ``g -> g``, the task combination.
    upstream: ``g -> fn(g)``, the upstream transform with its checks.
    factor: ``c`` when the upstream transform is ``c * g`` and may be
      weighted instead of called; else ``None``.
    observe: called with ``g`` where ``factor`` weights instead of
      ``upstream`` being called (the plan's trace).
    replace: ``(g, chain_rule) -> input grads``, the backward replacement;
      ``chain_rule()`` gives what a VJP of ``g`` sends to the inputs.
    override: ``g -> input grads``, the override of the layer's call.
  """
  tasks: Optional[Callable[[List], List]] = None
  upstream: Optional[Callable[[List], List]] = None
  factor: Optional[float] = None
  observe: Optional[Callable[[List], None]] = None
  replace: Optional[Callable[[List, Callable[[], List]], List]] = None
  override: Optional[Callable[[List], List]] = None


class VJP(Protocol):
  """A VJP provider: one backward pass through one layer."""

  def __call__(self, grads: List, inputs: bool, own: bool,
               other: bool) -> Tuple[List, List, List]:
    """Backpropagates ``grads`` (one per output) through the layer.

    Returns gradients for the inputs, the layer's own variables and the
    other variables it reads, each list empty where not asked for.
    """

  def weigh(self, grad, factor: float):
    """``factor * grad``."""


@dataclasses.dataclass
class LayerGrads:
  """What :func:`layer_backward` gives.

  Attributes:
    upstream: the complete gradient at the outputs, after ``tasks``: what
      a replacement below reads through ``upstream_of``.
    inputs: one gradient per input, or ``None`` where a zero factor sends
      nothing below.
    own: the gradients of the layer's own variables.
    other: the gradients of the other variables the layer reads (empty
      where ``inputs`` is ``None``).
  """
  upstream: List
  inputs: Optional[List]
  own: List
  other: List


def layer_backward(rules: LayerRules, grads: List, vjp: VJP) -> LayerGrads:
  """Applies one layer's declarations to the gradient at its outputs.

  Args:
    rules: the layer's declarations.
    grads: the gradient at each output, summed over all consumers.
    vjp: the executor's backward pass through the layer.

  Returns:
    The layer's :class:`LayerGrads`.
  """
  g = rules.tasks(grads) if rules.tasks is not None else list(grads)
  instead = rules.replace is not None or rules.override is not None
  if not instead and (rules.upstream is None or rules.factor is not None):
    # One VJP of g: c * g's VJP is c times it, and the own variables see g.
    if rules.upstream is not None and rules.observe is not None:
      rules.observe(g)
    if is_zero(rules.factor):
      return LayerGrads(g, None, vjp(g, False, True, False)[1], [])
    dx, own, other = vjp(g, True, True, True)
    if rules.factor is not None:
      dx = [vjp.weigh(d, rules.factor) for d in dx]
      other = [vjp.weigh(d, rules.factor) for d in other]
    return LayerGrads(g, dx, own, other)
  own = vjp(g, False, True, False)[1]
  below = rules.upstream(g) if rules.upstream is not None else g
  if not instead:
    dx, _, other = vjp(below, True, False, True)
    return LayerGrads(g, dx, own, other)
  other = vjp(below, False, False, True)[2]
  if rules.override is not None:
    dx = rules.override(below)
  else:
    assert rules.replace is not None
    dx = rules.replace(below, lambda: vjp(below, True, False, False)[0])
  return LayerGrads(g, dx, own, other)
