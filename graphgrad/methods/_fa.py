"""Feedback alignment: a dense layer sends ``delta B^T`` below, not ``W^T``."""

from typing import Optional

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import sum_gradients
from graphgrad.analysis import _graph_util
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.methods._replacement import (
  Replacement,
  feedback_matrix,
  feedback_matrix_value,
)
from graphgrad.transforms import _validate


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


class FeedbackAlignment(Replacement):
  name = "feedback_alignment"

  def __init__(self, seed, stddev):
    self.seed, self.stddev = seed, stddev

  def check(self, net, layer):
    _kernel_matmul(net, layer)

  def matrix_value(self, layer: str, shape, fan_out: int,
                   dtype=tf.float32) -> tf.Tensor:
    """The initial ``B`` of ``layer``'s kernel, as every executor makes it.

    Args:
      layer: the layer's name.
      shape: the kernel's shape.
      fan_out: the MatMul's output features (the kernel's last dimension
        for ``x @ W``), which set the default standard deviation.
      dtype: of the value.
    """
    stddev = self.stddev if self.stddev is not None else 1.0 / np.sqrt(fan_out)
    return feedback_matrix_value(self.seed, self.name, layer, shape, stddev,
                                 dtype)

  def backward(self, context):
    mm, k = _kernel_matmul(context.net, context.layer.name)
    kernel, data = mm.inputs[k], mm.inputs[1 - k]
    out = mm.outputs[0]
    fan = int(out.shape[-1]) if k == 1 else int(out.shape[0])
    b = feedback_matrix(context, self.name, lambda: self.matrix_value(
        context.layer.name, kernel.shape, fan))
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
    return [sum_gradients([a, c]) for a, c in zip(bypass, through)]

  def __repr__(self):
    return f"feedback_alignment(seed={self.seed!r})"


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
      from the tf.Graph's random seed.
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
  _validate.random_matrix("feedback_alignment", seed, stddev)
  return FeedbackAlignment(seed, stddev)
