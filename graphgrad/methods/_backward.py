"""Backward replacements: compute what a layer sends below without W^T.

``plan.replace_backward(layer, r)`` makes ``r`` compute the gradient that
``layer`` sends to its input tensors, instead of the chain rule. The layer's
own parameter gradients still come from the true upstream gradient at its
outputs. A replacement is a :class:`Replacement` (or any callable) that maps
a :class:`BackwardContext` to one gradient per input tensor.

Variables a replacement creates (fixed random feedback matrices, a synthetic
gradient module) are ordinary graph variables made once per plan when it is
built: ``Saver`` saves them, ``global_variables_initializer`` initialises
them and a device function such as ``replica_device_setter`` places them.
"""

import dataclasses
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.analysis import _graph_util
from graphgrad.analysis._layers import Layer, LayerGraph
from graphgrad.transforms import _checks, _validate


@dataclasses.dataclass(frozen=True)
class BackwardContext:
  """What a backward replacement sees of one layer.

  Attributes:
    layer: the :class:`~graphgrad.Layer` whose backward pass is replaced.
    net: the analysed graph.
    inputs: the layer's input tensors that need a gradient; return one
      gradient per tensor, in this order.
    outputs: the layer's output tensors.
    upstream: the gradients at ``outputs`` (after the layer's upstream
      transforms, if any); entries may be ``None``.
    upstream_of: ``name -> [grad per output]``: the complete gradient at the
      outputs of a layer above (one that the plan rewrites or that the
      replacement declares in ``cuts``).
    chain_rule: ``() -> [grad per input]``: builds what plain
      backpropagation of ``upstream`` through the layer gives.
    state: the plan's per-plan dictionary (see ``TransformContext.state``).
  """
  layer: Layer
  net: LayerGraph
  inputs: Sequence[tf.Tensor]
  outputs: Sequence[tf.Tensor]
  upstream: Sequence[Gradient]
  upstream_of: Callable[[str], List[Gradient]]
  chain_rule: Callable[[], List[Gradient]]
  state: Dict[str, Any]


class Replacement:
  """Base class of backward replacements.

  Subclasses implement :meth:`backward`; :meth:`check` refuses layers they
  cannot handle when the replacement is declared, and :meth:`cuts` names the
  layers whose output gradients :meth:`backward` reads with ``upstream_of``.
  """

  name = "replacement"

  def check(self, net: LayerGraph, layer: str) -> None:
    """Raises a ``GraphGradError`` if ``layer`` cannot be handled."""

  def cuts(self, net: LayerGraph, layer: str) -> List[str]:
    return []

  def backward(self, context: BackwardContext) -> List[Gradient]:
    raise NotImplementedError

  def __call__(self, context: BackwardContext) -> List[Gradient]:
    with tf.name_scope(self.name):
      return self.backward(context)


def engine_hook(net: LayerGraph, name: str, fn: Callable,
                state: Dict[str, Any]) -> Callable:
  """Wraps ``fn`` for the engine: a context in, checked gradients out.

  An exception ``fn`` raises becomes a ``GraphGradError`` naming the layer.
  """
  where = f"replace_backward({name!r})"

  def run(layer, outputs, upstream, inputs, upstream_of, chain_rule):
    ctx = BackwardContext(layer=net[layer], net=net, inputs=tuple(inputs),
                          outputs=tuple(outputs), upstream=tuple(upstream),
                          upstream_of=upstream_of, chain_rule=chain_rule,
                          state=state)
    with tf.name_scope(f"replace_backward_{name}".replace("/", "_")):
      try:
        grads = fn(ctx)
      except _errors.GraphGradError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        raise _checks.raised_error(where, "replacement", fn, e) from e
    return _check_grads(where, fn, grads, inputs)
  return run


def _check_grads(where: str, fn, grads, inputs) -> List[Gradient]:
  """Checks a replacement's result: one gradient like each input, or None."""
  if not isinstance(grads, (list, tuple)) or len(grads) != len(inputs):
    got = (f"{len(grads)} gradients" if isinstance(grads, (list, tuple))
           else "None" if grads is None
           else "one tensor, not a list," if tf.is_tensor(grads)
           else type(grads).__name__)
    raise _errors.IncompatibleGradientError(
        f"{where}: {fn!r} returned {got} for {len(inputs)} input tensors "
        f"({', '.join(t.name for t in inputs)}). Return one gradient (or "
        f"None) per context.inputs tensor, in order.")
  for t, g in zip(inputs, grads):
    values = g.values if isinstance(g, tf.IndexedSlices) else g
    if g is None:
      continue
    if not tf.is_tensor(values):
      raise _errors.IncompatibleGradientError(
          f"{where}: {fn!r} returned {type(values).__name__} {values!r} for "
          f"the input {t.name}; return a tensor shaped like the input, or "
          f"None.")
    if _checks.other_graph(values, t):
      raise _checks.graph_error(where, "replacement", values, t)
    if values.dtype != t.dtype or not values.shape.is_compatible_with(
        t.shape):
      raise _errors.IncompatibleGradientError(
          f"{where}: {fn!r} returned a gradient of shape {values.shape} "
          f"{values.dtype.name} for the input {t.name} of shape {t.shape} "
          f"{t.dtype.name}. Return a gradient shaped like the input.")
  return list(grads)


def _feedback_matrix(context: BackwardContext, key: str, shape, stddev,
                     seed: Optional[int]) -> tf.Variable:
  """A fixed N(0, stddev^2) matrix, made once per plan as a variable."""
  store = context.state.setdefault("feedback_matrices", {})
  full_key = (key, context.layer.name)
  if full_key not in store:
    if seed is None:
      init = tf.random.normal(shape, stddev=stddev)
    else:
      derived = zlib.crc32(f"{key}/{context.layer.name}".encode())
      init = tf.random.stateless_normal(shape, seed=[seed, derived],
                                        stddev=stddev)
    store[full_key] = tf.compat.v1.Variable(init, trainable=False, name="B")
  return store[full_key]


def _static_features(t: tf.Tensor, what: str) -> int:
  dims = t.shape.as_list()[1:] if t.shape.rank else None
  if dims is None or not dims or any(d is None for d in dims):
    raise _errors.UnsupportedGraphError(
        f"{what}: the tensor {t.name} has shape {t.shape}; a fixed random "
        f"projection needs a batch dimension followed by known dimensions. "
        f"Give the input a static shape (tf.ensure_shape or set_shape).")
  return int(np.prod(dims))


# -- feedback alignment --------------------------------------------------------

def _kernel_matmul(net: LayerGraph, layer: str):
  """(op, kernel operand index) of the layer's one MatMul with a kernel."""
  owned = {v.op.name for v in net[layer].variables}
  found, types = [], sorted({op.type for op in net[layer].ops})
  for op in net[layer].ops:
    if op.type != "MatMul":
      continue
    for i, t in enumerate(op.inputs):
      src = t.op
      while src.type in ("Identity", "Cast") and src.inputs and (
          _graph_util.read_variable_source(src) is None):
        src = src.inputs[0].op
      if _graph_util.read_variable_source(src) in owned:
        found.append((op, i))
  if len(found) != 1:
    raise _errors.UnsupportedGraphError(
        f"feedback_alignment: layer {layer!r} must be a dense layer, with "
        f"exactly one MatMul against one of its own 2-D variables; found "
        f"{len(found)} such MatMul ops among its op types "
        f"({', '.join(types)}). Use direct_feedback_alignment() or "
        f"synthetic() for other layer types, or group the layer so that it "
        f"holds one dense kernel.")
  return found[0]


class _FeedbackAlignment(Replacement):
  name = "feedback_alignment"

  def __init__(self, seed, stddev):
    self.seed, self.stddev = seed, stddev

  def check(self, net, layer):
    _kernel_matmul(net, layer)

  def backward(self, context):
    mm, k = _kernel_matmul(context.net, context.layer.name)
    kernel, data = mm.inputs[k], mm.inputs[1 - k]
    out = mm.outputs[0]
    fan = int(out.shape[-1]) if k == 1 else int(out.shape[0])
    stddev = self.stddev if self.stddev is not None else 1.0 / np.sqrt(fan)
    b = _feedback_matrix(context, "feedback_alignment", kernel.shape, stddev,
                         self.seed)
    ys = [y for y, g in zip(context.outputs, context.upstream) if g is not None]
    gys = [g for g in context.upstream if g is not None]
    inputs = list(context.inputs)
    if not ys or not inputs:
      return [None] * len(inputs)
    # delta: the gradient at the MatMul's output, through the layer's ops
    # above it (bias, an activation inside the layer).
    delta, = tf.compat.v1.gradients(ys, [out], grad_ys=gys,
                                    stop_gradients=inputs)
    # Paths from the inputs to the outputs that bypass the MatMul.
    bypass = tf.compat.v1.gradients(ys, inputs, grad_ys=gys,
                                    stop_gradients=inputs + [out])
    if delta is None:
      return bypass
    # d(data) with B in place of the kernel: the MatMul's own gradient rule.
    operands = [None, None]
    operands[k], operands[1 - k] = tf.cast(b, kernel.dtype), data
    swapped = tf.matmul(operands[0], operands[1],
                        transpose_a=mm.get_attr("transpose_a"),
                        transpose_b=mm.get_attr("transpose_b"))
    d_data, = tf.compat.v1.gradients(swapped, [data], grad_ys=[delta])
    through = tf.compat.v1.gradients([data], inputs, grad_ys=[d_data],
                                     stop_gradients=inputs)
    return [_add(a, c) for a, c in zip(bypass, through)]

  def __repr__(self):
    return f"feedback_alignment(seed={self.seed!r})"


def _add(a, b):
  if a is None or b is None:
    return b if a is None else a
  return tf.add(tf.convert_to_tensor(a), tf.convert_to_tensor(b))


def feedback_alignment(seed: Optional[int] = None,
                       stddev: Optional[float] = None) -> Replacement:
  """Feedback alignment (Lillicrap et al., 2016, "Random synaptic feedback
  weights support error backpropagation for deep learning").

  For a dense layer ``y = f(x W + b)`` the chain rule sends
  ``dx = delta W^T`` below, with ``delta = dL/d(x W)``. Feedback alignment
  sends

      dx = delta B^T,

  with ``B`` a fixed random matrix of ``W``'s shape, ``B_ij ~ N(0, s^2)``,
  ``s = stddev`` or ``1 / sqrt(fan_out)`` by default. ``W`` and ``b`` still get
  their true gradients ``x^T delta`` and ``sum(delta)``. Ops of the layer
  above the MatMul (bias, an activation inside the layer) are backpropagated
  exactly, and so are ops between the layer's inputs and the MatMul.

  Args:
    seed: with a seed, ``B`` is drawn by a stateless generator from ``seed``
      and the layer name, so it is the same in every session; without one,
      from the graph's random seed.
    stddev: standard deviation of ``B``'s entries.

  Returns:
    A replacement for ``plan.replace_backward(layer, r)``.

  Raises:
    GraphGradError: if ``seed`` is not an int, or ``stddev`` is not a
      positive finite number.
    UnsupportedGraphError: at ``replace_backward``, for a layer that is not
      dense (no MatMul against its own kernel, e.g. a convolution).

  Example:
    >>> feedback_alignment(seed=0)
    feedback_alignment(seed=0)
  """
  _check_random("feedback_alignment", seed, stddev)
  return _FeedbackAlignment(seed, stddev)


def _check_random(factory: str, seed, stddev) -> None:
  _validate.seed(factory, seed)
  if stddev is not None:
    _validate.number(factory, "stddev", stddev, what="positive", low=0.0,
                     low_open=True, tensor=False,
                     fix="Pass e.g. stddev=0.1, or None for the default.")


# -- direct feedback alignment -------------------------------------------------

def _error_layer(net: LayerGraph, layer: str, given: Optional[str]) -> str:
  if given is not None:
    name = net[given].name
  else:
    tops = [l.name for l in net if net.reaches_loss_directly(l.name)]
    if len(tops) != 1:
      raise _errors.GraphGradError(
          f"direct_feedback_alignment: `error_layer` is needed, because "
          f"{len(tops)} layers reach the loss directly "
          f"({', '.join(tops) or 'none'}). Pass error_layer='...', the layer "
          f"whose output gradient (the error at the logits) is projected.")
    name = tops[0]
  outs = [t for t in net[name].outputs
          if t.dtype.is_floating and not _graph_util.is_handle(t)]
  if len(outs) != 1:
    raise _errors.GraphGradError(
        f"direct_feedback_alignment: the error layer {name!r} must have one "
        f"floating-point output (the logits); it has {len(outs)}. Pass "
        f"error_layer= a layer with a single output.")
  return name


class _DirectFeedbackAlignment(Replacement):
  name = "direct_feedback_alignment"

  def __init__(self, seed, error_layer, stddev):
    self.seed, self.error_layer, self.stddev = seed, error_layer, stddev

  def check(self, net, layer):
    _error_layer(net, layer, self.error_layer)

  def cuts(self, net, layer):
    return [_error_layer(net, layer, self.error_layer)]

  def backward(self, context):
    top = _error_layer(context.net, context.layer.name, self.error_layer)
    error, = [g for g in context.upstream_of(top)]
    out = []
    if error is None:
      return [None] * len(context.inputs)
    error = tf.convert_to_tensor(error)
    n_err = _static_features(error, "direct_feedback_alignment error")
    e = tf.reshape(error, [-1, n_err])
    for i, t in enumerate(context.inputs):
      n_in = _static_features(t, f"direct_feedback_alignment on "
                              f"{context.layer.name!r}")
      stddev = self.stddev if self.stddev is not None else 1.0 / np.sqrt(n_err)
      b = _feedback_matrix(context, f"dfa_{i}", [n_err, n_in], stddev,
                           self.seed)
      g = tf.matmul(tf.cast(e, t.dtype), tf.cast(b, t.dtype))
      out.append(tf.reshape(g, tf.shape(t)))
    return out

  def __repr__(self):
    return (f"direct_feedback_alignment(seed={self.seed!r}, "
            f"error_layer={self.error_layer!r})")


def direct_feedback_alignment(seed: Optional[int] = None,
                              error_layer: Optional[str] = None,
                              stddev: Optional[float] = None) -> Replacement:
  """Direct feedback alignment (Nokland, 2016, "Direct Feedback Alignment
  Provides Learning in Deep Neural Networks").

  With ``e = dL/d(logits)`` the error at the top layer's output, a layer
  with DFA sends to each input tensor ``x`` (flattened to ``[batch, n]``)

      dx = e B_x,

  with ``B_x`` a fixed ``[n_logits, n]`` random matrix, ``N(0, s^2)``
  entries, ``s = stddev`` or ``1 / sqrt(n_logits)``. Declared on every layer
  above a hidden layer, each hidden layer ``h_i = f(a_i)`` receives its own
  projection of the top error, and its parameters train on
  ``(e B_i) * f'(a_i)``, as in the paper. Works for any layer type.

  Args:
    seed: seed of the stateless generator of ``B`` (with the layer name and
      input position); without one, the graph's random seed is used.
    error_layer: the layer whose output gradient is ``e``; by default the one
      layer whose output reaches the loss through glue only.
    stddev: standard deviation of ``B``'s entries.

  Returns:
    A replacement for ``plan.replace_backward(layer, r)``.

  Raises:
    GraphGradError: if ``seed`` is not an int, ``error_layer`` not a layer
      name or ``stddev`` not a positive finite number; at
      ``replace_backward``, if the error layer is ambiguous or has more than
      one output.

  Example:
    >>> direct_feedback_alignment(seed=0)
    direct_feedback_alignment(seed=0, error_layer=None)
  """
  _check_random("direct_feedback_alignment", seed, stddev)
  if error_layer is not None and not isinstance(error_layer, str):
    raise _errors.GraphGradError(
        f"direct_feedback_alignment: `error_layer` must be a layer name (a "
        f"str) or None; got {type(error_layer).__name__} {error_layer!r}. "
        f"Pass e.g. error_layer='logits'.")
  return _DirectFeedbackAlignment(seed, error_layer, stddev)
