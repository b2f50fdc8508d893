"""The per-layer policy: how one layer's compiled rule acts on its gradient.

Both executors call :func:`layer_backward` for a layer whose rule makes it
stop at its outputs (``LayerRule.cut``), with the gradient at its outputs and
the executor's :class:`LayerSteps`: the TF1 engine (one segment call per
VJP) and the Keras tape (the call's inner tape). The branches are the rule's
:class:`~graphgrad.core._rules.Mode`, in a fixed order: a task combination
rewrites the gradient ``g``; the layer's own variables get their gradients
from ``g``; the upstream transform maps ``g`` to ``fn(g)``; the inputs get
what a VJP of ``fn(g)`` gives, or what the backward replacement or the
override returns instead. A ``LINEAR`` rule ``c * g`` takes one VJP of
``g``, whose part below is weighted by ``c``.
"""

import dataclasses
from typing import Callable, List, Optional, Protocol, Tuple, cast

from graphgrad.core._gradients import is_zero
from graphgrad.core._rules import LayerRule, Mode


class LayerSteps(Protocol):
  """What an executor does at one layer; :func:`layer_backward` decides
  which steps run, and in what order."""

  def vjp(self, grads: List, inputs: bool, own: bool,
          other: bool) -> Tuple[List, List, List]:
    """Backpropagates ``grads`` (one per output) through the layer.

    Returns gradients for the inputs, the layer's own variables and the
    other variables it reads, each list empty where not asked for.
    """

  def weigh(self, grad, factor: float):
    """``factor * grad``."""

  def arrived(self, grads: List) -> List:
    """The complete gradient at the outputs, after the rule's task
    combination (the executor records it for replacements below)."""

  def transform(self, grads: List) -> List:
    """The rule's upstream transform, with the plan's checks."""

  def observe(self, grads: List) -> None:
    """Records ``g`` where a ``LINEAR`` rule weights instead of calling its
    transform (the plan's trace)."""

  def replace(self, grads: List, chain_rule: Callable[[], List]) -> List:
    """The backward replacement's gradients for the inputs;
    ``chain_rule()`` gives what a VJP of ``grads`` sends to them."""


class OverrideSteps(LayerSteps, Protocol):
  """The steps of an executor that overrides a layer's whole call (the
  Keras tape). A tf.Graph plan overrides ops, in its VJP, and compiles no
  layer to ``OVERRIDDEN``, so its steps need not override."""

  def override(self, grads: List) -> List:
    """The override's gradients for the inputs."""


@dataclasses.dataclass
class LayerGrads:
  """What :func:`layer_backward` gives.

  Attributes:
    upstream: the complete gradient at the outputs, after the task
      combination: what a replacement below reads through ``upstream_of``.
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


def layer_backward(rule: LayerRule, grads: List,
                   steps: LayerSteps) -> LayerGrads:
  """Applies one layer's rule to the gradient at its outputs.

  Args:
    rule: the layer's compiled rule.
    grads: the gradient at each output, summed over all consumers.
    steps: the executor's steps at this layer (:class:`OverrideSteps`
      for a rule ``OVERRIDDEN``).

  Returns:
    The layer's :class:`LayerGrads`.
  """
  g = steps.arrived(list(grads))
  mode = rule.mode
  if mode is Mode.PLAIN or mode is Mode.LINEAR:
    # One VJP of g: c * g's VJP is c times it, and the own variables see g.
    factor = rule.factor if mode is Mode.LINEAR else None
    if factor is not None:
      steps.observe(g)
      if is_zero(factor):
        return LayerGrads(g, None, steps.vjp(g, False, True, False)[1], [])
    dx, own, other = steps.vjp(g, True, True, True)
    if factor is not None:
      dx = [steps.weigh(d, factor) for d in dx]
      other = [steps.weigh(d, factor) for d in other]
    return LayerGrads(g, dx, own, other)
  own = steps.vjp(g, False, True, False)[1]
  below = steps.transform(g) if rule.upstream is not None else g
  if mode is Mode.TRANSFORMED:
    dx, _, other = steps.vjp(below, True, False, True)
    return LayerGrads(g, dx, own, other)
  other = steps.vjp(below, False, False, True)[2]
  if mode is Mode.OVERRIDDEN:
    dx = cast(OverrideSteps, steps).override(below)
  else:
    dx = steps.replace(below, lambda: steps.vjp(below, True, False, False)[0])
  return LayerGrads(g, dx, own, other)
