"""Direct feedback alignment: each layer gets a projection of the top error."""

from typing import Optional

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.methods._replacement import (
  Replacement,
  feedback_matrix_value,
  static_features,
)
from graphgrad.transforms import _validate

_WHICH = ("Pass error_layer='...', the layer whose output gradient (the "
          "error at the logits) is projected.")


def _error_layer(net, layer: str, given: Optional[str]) -> str:
  """The error layer of DFA on ``layer``: ``given``, or the top layer."""
  if not isinstance(net, LayerGraph):  # a KerasPlan's layers
    if given is not None:
      return net.find(given, "error_layer")
    return net.top_layer(f"direct_feedback_alignment on {layer!r}", _WHICH)
  if given is not None:
    name = net[given].name
  else:
    tops = [l.name for l in net if net.reaches_loss_directly(l.name)]
    if len(tops) != 1:
      raise _errors.GraphGradError(
          f"direct_feedback_alignment: `error_layer` is needed, because "
          f"{len(tops)} layers reach the loss directly "
          f"({', '.join(tops) or 'none'}). {_WHICH}")
    name = tops[0]
  outs = [t for t in net[name].outputs
          if t.dtype.is_floating and not _graph_util.is_handle(t)]
  _one_output(name, len(outs))
  return name


def _one_output(name: str, n: int) -> None:
  if n != 1:
    raise _errors.GraphGradError(
        f"direct_feedback_alignment: the error layer {name!r} must have one "
        f"floating-point output (the logits); it has {n}. Pass "
        f"error_layer= a layer with a single output.")


class DirectFeedbackAlignment(Replacement):
  name = "direct_feedback_alignment"
  homogeneous = True

  def __init__(self, seed, error_layer, stddev):
    self.seed, self.error_layer, self.stddev = seed, error_layer, stddev

  def check(self, net, layer):
    _error_layer(net, layer, self.error_layer)

  def cuts(self, net, layer):
    return [_error_layer(net, layer, self.error_layer)]

  def matrix_value(self, layer: str, index: int, n_err: int, n_in: int,
                   dtype=tf.float32) -> tf.Tensor:
    """The initial ``B`` of ``layer``'s input ``index``, as every executor
    makes it: ``[n_err, n_in]``, for ``n_err`` error features."""
    stddev = self.stddev if self.stddev is not None else 1.0 / np.sqrt(n_err)
    return feedback_matrix_value(self.seed, f"dfa_{index}", layer,
                                 [n_err, n_in], stddev, dtype)

  def backward(self, context):
    """``e B_x`` for each input ``x``, ``e`` the error layer's gradient."""
    top = _error_layer(context.net, context.name, self.error_layer)
    error = list(context.upstream_of(top))
    _one_output(top, len(error))
    inputs = context.inputs
    if error[0] is None:
      return [None] * len(inputs)
    e = tf.convert_to_tensor(error[0])
    n_err = static_features(e, "direct_feedback_alignment error")
    e = tf.reshape(e, [-1, n_err])
    out = []
    for i, t in enumerate(inputs):
      n_in = static_features(
          t, f"direct_feedback_alignment on {context.name!r}")
      b = context.variable(f"dfa_{i}", lambda i=i, n_in=n_in: (
          self.matrix_value(context.name, i, n_err, n_in)))
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
      input position); without one, the tf.Graph's random seed is used.
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
  _validate.random_matrix("direct_feedback_alignment", seed, stddev)
  if error_layer is not None and not isinstance(error_layer, str):
    raise _errors.GraphGradError(
        f"direct_feedback_alignment: `error_layer` must be a layer name (a "
        f"str) or None; got {type(error_layer).__name__} {error_layer!r}. "
        f"Pass e.g. error_layer='logits'.")
  return DirectFeedbackAlignment(seed, error_layer, stddev)
