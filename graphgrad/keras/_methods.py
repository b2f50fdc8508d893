"""The Keras tape's side of a backward replacement's context.

A ``gg.backward`` replacement runs on a Keras layer call as on a
``GradientPlan``: the tape (``_tape_backward``) makes a
``gg.backward.BackwardContext`` whose executor is a :class:`TapeBackward`
(the VJP is the layer VJP of the call, whose tape records the replacement's
own ops too; a dense layer is a ``Dense`` layer's kernel product; variables
live in the plan's :class:`MethodVariables`, which ``tf.train.Checkpoint``
saves), and calls the replacement. A replacement's ``check`` and ``cuts``
see the model's layers as :class:`KerasLayers`.
"""

from typing import Any, Callable, Dict, FrozenSet, List

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.core._gradients import dense
from graphgrad.keras._layer_index import LayerIndex, tf_variable
from graphgrad.keras._tape_vjp import TapeVJP
from graphgrad.methods import _replacement


class MethodVariables(tf.Module):
  """The variables a plan's training methods own, by key.

  A replacement's ``context.variable(key, ...)`` on layer ``<layer>`` is
  kept under ``"<first part of key>/<layer>/<rest of key>"``:
  ``"feedback_alignment/<layer>"``, ``"dfa_<i>/<layer>"`` (the feedback
  matrices) and ``"synthetic/<layer>/<i>/kernel_<j>"`` (``bias_<j>``). The
  values are ``tf.Variable`` objects, tracked for ``tf.train.Checkpoint``.
  ``states`` holds the state modules of stateful task-combination methods
  (GradVac, Nash-MTL), by ``"combine_tasks/<layer>"``, tracked as well.
  """

  def __init__(self):
    super().__init__(name="graphgrad_methods")
    self.by_key: Dict[str, tf.Variable] = {}
    self.states: Dict[str, tf.Module] = {}

  def get(self, key: str, init: Callable[[], tf.Tensor], trainable: bool,
          name: str) -> tf.Variable:
    """The variable under ``key``, made from ``init()`` on first use."""
    if key not in self.by_key:
      with tf.init_scope():  # made eagerly, once, even while tracing
        self.by_key[key] = tf.Variable(init(), trainable=trainable, name=name)
    return self.by_key[key]

  def state(self, key: str, create: Callable[[], Any]) -> Any:
    """The state under ``key``, made by ``create()`` on first use.

    ``create`` returning ``None`` (a stateless method) stores nothing.
    """
    if key not in self.states:
      with tf.init_scope():  # made eagerly, once, even while tracing
        made = create()
      if made is None:
        return None
      self.states[key] = made
    return self.states[key]


def dense_parts(layer, path: str, who: str):
  """``(kernel, bias, activation)`` of a Dense layer, or raises."""
  kernel = tf_variable(getattr(layer, "kernel", None))
  if kernel is None or kernel.shape.rank != 2 or not hasattr(
      layer, "activation"):
    raise _errors.UnsupportedGraphError(
        f"{who}: layer {path!r} ({type(layer).__name__}) must be a built "
        f"Dense layer, with a 2-D `kernel` and an `activation`. Use "
        f"direct_feedback_alignment() or synthetic() for other layer types.")
  bias = tf_variable(getattr(layer, "bias", None))
  return kernel, bias, layer.activation


class KerasLayers(LayerIndex):
  """A Keras model's layers, as a replacement's ``check`` and ``cuts`` (and
  ``context.net``) see them in a ``KerasPlan``: the plan's index of them.

  Args:
    model: the model.
  """

  def __init__(self, model):
    super().__init__(model)
    self.model = model

  def layers_of_ops(self, match: str, key: str) -> FrozenSet[str]:
    """The layers an override matches: a KerasPlan overrides the call of
    one layer (``match`` ``"layer"``) (``graphgrad.core._rules.Topology``)."""
    return frozenset([key]) if match == "layer" else frozenset()

  @property
  def replacement_view(self) -> "KerasLayers":
    """The layers as a backward replacement sees them: this value."""
    return self

  def top_layer(self, who: str, fix: str) -> str:
    """The last top-level layer holding variables: the model's top.

    Raises:
      GraphGradError: naming ``who`` and ending with ``fix``, if the model
        has several outputs, or no layer holds variables yet (unbuilt).
    """
    outputs = getattr(self.model, "outputs", None) or ()
    if len(outputs) > 1:
      raise _errors.GraphGradError(
          f"{who}: `error_layer` is needed, because the model has "
          f"{len(outputs)} outputs. {fix}")
    tops = [p for p in self.paths if "/" not in p and self[p].weights]
    if not tops:
      raise _errors.GraphGradError(
          f"{who}: `error_layer` is needed, because the model's layers hold "
          f"no variables yet (it is not built), so the top layer is "
          f"unknown. {fix} Or build the model first (call it once, or give "
          f"it a keras.Input).")
    return tops[-1]

  def check_dense(self, path: str, who: str) -> None:
    """Refuses a built layer that is not ``Dense``."""
    layer = self[path]
    if getattr(layer, "built", False):
      dense_parts(layer, path, who)


class TapeBackward:
  """The Keras tape's side of one replacement's context.

  ``call_vjp`` is the layer VJP of the call; while the replacement runs,
  its tape records again (``_tape_backward``), so that :meth:`vjp`
  differentiates what the replacement builds too.

  Args:
    call_vjp: the call's layer VJP (``_tape_vjp.TapeVJP.record``).
    layer: the Keras layer.
    path: its path.
    inputs: the call's floating-point inputs, which the tape watched.
    variables: the plan's :class:`MethodVariables`.
  """

  def __init__(self, call_vjp: TapeVJP, layer, path: str, inputs,
               variables: MethodVariables):
    self.call_vjp, self.layer, self.path = call_vjp, layer, path
    self.inputs = list(inputs)
    self.variables = variables
    # Tensors the tape recorded nothing behind: stopping at them is free.
    self._leaves = {t.ref() for t in self.inputs}
    self._as_leaf: Dict[Any, tf.Tensor] = {}

  def vjp(self, ys, xs, grad_ys, stop) -> List[Gradient]:
    # A product dense() recomputed is a source (and a stop) as its leaf.
    xs = [self._as_leaf.get(x.ref(), x) for x in xs]
    for s in stop:
      if self._as_leaf.get(s.ref(), s).ref() not in self._leaves:
        raise _errors.GraphGradError(
            f"replace_backward({self.path!r}): context.vjp(stop=...) got "
            f"{_text(s)}; on a KerasPlan it can stop only at the context's "
            f"inputs and at context.dense().pre, behind which the tape "
            f"recorded nothing. Build the tensors to differentiate from "
            f"those instead.")
    if not ys or not xs:
      return [None] * len(xs)
    # BackwardContext.vjp has dropped the ys whose grad_ys entry is None.
    grads = None if grad_ys is None else [dense(g) for g in grad_ys]
    with self.call_vjp.paused():
      return self.call_vjp.vjp(ys, xs, grads)

  def variable(self, key, init, trainable, name) -> tf.Variable:
    head, _, rest = key.partition("/")
    full = "/".join(p for p in (head, self.path, rest) if p)
    return self.variables.get(full, init, trainable, name)

  def dense(self, who: str) -> _replacement.DenseMatMul:
    kernel, bias, act = dense_parts(self.layer, self.path, who)
    x = self.inputs[0]  # a Dense call's one input
    if x.shape.rank != 2:
      raise _errors.UnsupportedGraphError(
          f"{who}: layer {self.path!r} got an input of shape {x.shape}; "
          f"{who} needs a [batch, features] input. Flatten it first "
          f"(keras.layers.Flatten).")
    w = tf.cast(kernel, x.dtype)
    z = tf.matmul(x, w)
    # The outputs are recomputed from a leaf copy of the product: as a
    # source or a stop, the product is that leaf, so that nothing but the
    # product leads from x to them, as in the layer's call.
    with self.call_vjp.paused():
      leaf = tf.identity(z)
    self.call_vjp.watch(leaf)
    self._leaves.add(leaf.ref())
    self._as_leaf[z.ref()] = leaf
    y = leaf if bias is None else tf.nn.bias_add(leaf, tf.cast(bias, z.dtype))
    y = act(y) if act is not None else y
    return _replacement.DenseMatMul(data=x, kernel=w, pre=z, outputs=(y,))


def _text(t) -> str:
  return t.name if tf.is_symbolic_tensor(t) else f"a tensor of shape {t.shape}"
