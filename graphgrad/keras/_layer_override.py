"""KerasPlan's overrides: a layer call's backward pass, inside one plan.

The tape runs an overridden layer's call inside its ``tf.custom_gradient``
(``_intercept``), and the call's inputs get ``fn(call, *output_grads)``
instead of the chain rule through the call. ``call`` is a
``core._layer_step.LayerCall``, with the ``name``, ``type``, ``inputs`` and
``outputs`` of a ``tf.Operation``, so that ``fn`` is written like a
registered gradient function and ``straight_through`` serves both plans.

Overriding by op type (``"Round"``), as ``GradientPlan`` does, is not offered:
a ``tf.GradientTape`` finds an op's gradient in TensorFlow's global registry
by the op's type, even inside ``tf.function``, so a per-plan override of
every op of a type would have to change that registry for every other tape.
"""

from typing import Any, TypeVar

from graphgrad import _errors
from graphgrad.core._declaration_model import Declarations
from graphgrad.core._gradients import straight_through as identity

_P = TypeVar("_P", bound="LayerOverriding")


class LayerOverriding:
  """``override_gradient`` and ``straight_through`` of a KerasPlan.

  The plan sets ``_index`` (its ``LayerIndex``) and ``_declarations``.
  """

  _index: Any
  _declarations: Declarations

  def override_gradient(self: _P, layer, fn) -> _P:
    """Gives ``layer``'s call the backward pass ``fn``, inside this plan only.

    At each call of ``layer`` under the plan's tape, with ``g`` the
    gradients at the call's floating-point outputs (summed over all
    consumers, after every rewrite above), the call's floating-point inputs
    get ``fn(call, *g)`` instead of what backpropagating ``g`` through the
    call gives, and backpropagation continues below. The layer's own
    variables keep their chain-rule gradients through the call (``None``
    across an op without a gradient), so override a layer that holds the op
    alone, such as a quantizer layer. TensorFlow's gradient registry is not
    changed. An upstream transform or a task combination on the same layer
    acts before ``fn``; it works eagerly and inside ``tf.function``.

    Args:
      layer: a Keras layer name (or ``"outer/inner"`` path, or the layer).
      fn: ``fn(call, *output_grads) -> input grads``, one gradient (or
        ``None``) per ``call.inputs`` tensor; ``call`` has the ``name``,
        ``type``, ``inputs``, ``outputs`` of an op, and the ``layer``.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is not in the model (an op type
        included: see the module docstring).
      GraphGradError: if ``fn`` is not callable, the layer already has an
        override or a backward replacement, or a tape was opened.

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> model = tf.keras.Sequential([
      ...     tf.keras.layers.Dense(1, use_bias=False,
      ...                           kernel_initializer="ones", name="l1"),
      ...     tf.keras.layers.Lambda(tf.round, name="quant")])
      >>> plan = gg.KerasPlan(model).override_gradient(
      ...     "quant", lambda call, g: 0.5 * g)
      >>> with plan.tape() as tape:
      ...   loss = tf.reduce_sum(3.0 * model(tf.constant([[0.4]])))
      >>> [g.numpy().tolist() for g in tape.gradient(loss)]
      [[[0.6000000238418579]]]
    """
    return self._override(layer, fn, "override_gradient")

  def straight_through(self: _P, layer) -> _P:
    """Gives ``layer``'s call an identity backward pass (straight-through).

    ``override_gradient(layer, fn)`` with ``fn`` passing each output's
    gradient to the input of the same index, as ``GradientPlan``'s
    ``straight_through`` does for an op.

    Args:
      layer: a Keras layer name (or ``"outer/inner"`` path, or the layer).

    Returns:
      The plan, for chaining.

    Raises:
      GraphGradError: as :meth:`override_gradient` raises it.
    """
    return self._override(layer, identity, "straight_through")

  def _override(self: _P, layer, fn, caller: str) -> _P:
    try:
      path = self._index.find(layer, "layer")
    except _errors.LayerNotFoundError as e:
      if not isinstance(layer, str):
        raise
      raise _errors.LayerNotFoundError(
          f"{caller}: `layer` {layer!r} is not a layer of the model. A "
          f"KerasPlan overrides the backward pass of a layer's call, not of "
          f"an op type: a tf.GradientTape takes an op's gradient from "
          f"TensorFlow's global registry by its type, which a plan does not "
          f"change. Put the op in a layer of its own (e.g. "
          f"tf.keras.layers.Lambda(tf.round, name='quant')) and pass that "
          f"layer's name. ({e})") from e
    self._declarations.add_override(("layer", path), fn, caller)
    return self
