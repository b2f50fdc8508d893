"""Feedback alignment: a dense layer sends ``delta B^T`` below, not ``W^T``."""

from typing import Optional

import numpy as np
import tensorflow as tf

from graphgrad._types import sum_gradients
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.methods._replacement import (
  Replacement,
  feedback_matrix_value,
  kernel_matmul,
)
from graphgrad.transforms import _validate


class FeedbackAlignment(Replacement):
  name = "feedback_alignment"
  homogeneous = True

  def __init__(self, seed, stddev):
    self.seed, self.stddev = seed, stddev

  def check(self, net, layer):
    if isinstance(net, LayerGraph):
      kernel_matmul(net, layer, self.name)
    else:  # a KerasPlan's layers: a built layer must be Dense
      net.check_dense(layer, self.name)

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
    inputs = list(context.inputs)
    d = context.dense(self.name)
    kernel = d.kernel
    b = context.variable(self.name, lambda: self.matrix_value(
        context.name, kernel.shape, d.fan_out))
    ys = [y for y, g in zip(d.outputs, context.upstream) if g is not None]
    gys = [g for g in context.upstream if g is not None]
    if not ys or not inputs:
      return [None] * len(inputs)
    # delta: the gradient at the kernel product, through the layer's ops
    # above it (bias, an activation inside the layer).
    delta, = context.vjp(ys, [d.pre], gys, stop=inputs)
    # Paths from the inputs to the outputs that bypass the product.
    bypass = context.vjp(ys, inputs, gys, stop=inputs + [d.pre])
    if delta is None:
      return bypass
    # d(data) with B in place of the kernel: the product's own gradient.
    swapped = d.product(tf.cast(b, kernel.dtype))
    d_data, = context.vjp([swapped], [d.data], [delta])
    through = context.vjp([d.data], inputs, [d_data], stop=inputs)
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
      dense (no MatMul against its own kernel, e.g. a convolution; in a
      ``KerasPlan``, a built layer that is not ``Dense``), and in a
      ``KerasPlan``'s step, for an input that is not ``[batch, features]``.

  Example:
    >>> feedback_alignment(seed=0)
    feedback_alignment(seed=0)
  """
  _validate.random_matrix("feedback_alignment", seed, stddev)
  return FeedbackAlignment(seed, stddev)
