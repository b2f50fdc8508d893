"""Synthetic gradients: a trained module predicts the gradient at a boundary."""

import dataclasses
import zlib
from typing import Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad.methods._backward import (
  BackwardContext,
  Replacement,
  _static_features,
)
from graphgrad.transforms import _validate
from graphgrad.transforms._transforms import EXTRA_GRADS_AND_VARS


@dataclasses.dataclass(frozen=True)
class SyntheticModule:
  """The module that predicts the gradient at one input tensor.

  Attributes:
    variables: its trainable variables, input side first.
    prediction: the synthetic gradient sent below, shaped like the input.
    target: the true gradient it regresses onto (``stop_gradient`` applied).
    loss: ``loss_weight * ||prediction - target||^2``, the regression loss.
  """
  variables: Sequence[tf.Variable]
  prediction: tf.Tensor
  target: tf.Tensor
  loss: tf.Tensor


class _Synthetic(Replacement):
  name = "synthetic"

  def __init__(self, hidden, labels, loss_weight, seed):
    self.hidden = tuple(hidden)
    self.labels = labels
    self.loss_weight = loss_weight
    self.seed = seed
    self.modules: Dict[str, SyntheticModule] = {}

  def _variables(self, context, key, sizes, dtype) -> List[tf.Variable]:
    store = context.state.setdefault("synthetic_modules", {})
    if key not in store:
      made = []
      seed = 0 if self.seed is None else self.seed
      for j, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        last = j == len(sizes) - 2
        if last:  # zero: the first synthetic gradients are zero (Jaderberg)
          init = tf.zeros([n_in, n_out], dtype)
        else:
          derived = zlib.crc32(f"{key}/{j}".encode())
          init = tf.random.stateless_normal(
              [n_in, n_out], seed=[seed, derived],
              stddev=np.sqrt(2.0 / n_in), dtype=dtype)
        made.append(tf.compat.v1.Variable(init, name=f"kernel_{j}"))
        made.append(tf.compat.v1.Variable(tf.zeros([n_out], dtype),
                                          name=f"bias_{j}"))
      store[key] = made
    return store[key]

  def backward(self, context: BackwardContext):
    true = context.chain_rule()
    out = []
    for i, (x, target) in enumerate(zip(context.inputs, true)):
      if target is None:  # the input does not reach the outputs
        out.append(None)
        continue
      n = _static_features(x, f"synthetic on {context.layer.name!r}")
      feats = [tf.reshape(tf.stop_gradient(x), [-1, n])]
      if self.labels is not None:
        n_labels = _static_features(self.labels, "synthetic `labels`")
        labels = tf.cast(tf.stop_gradient(self.labels), x.dtype)
        feats.append(tf.reshape(labels, [-1, n_labels]))
      z = tf.concat(feats, 1) if len(feats) > 1 else feats[0]
      sizes = [int(z.shape[-1]), *self.hidden, n]
      variables = self._variables(context, (context.layer.name, i), sizes,
                                  x.dtype)
      h = z
      for j in range(0, len(variables), 2):
        h = tf.matmul(h, variables[j]) + variables[j + 1]
        if j + 2 < len(variables):
          h = tf.nn.relu(h)
      prediction = tf.reshape(h, tf.shape(x), name="prediction")
      target = tf.stop_gradient(tf.convert_to_tensor(target), name="target")
      loss = tf.multiply(tf.cast(self.loss_weight, x.dtype),
                         tf.reduce_sum(tf.square(prediction - target)),
                         name="loss")
      grads = tf.compat.v1.gradients(loss, variables)
      context.state.setdefault(EXTRA_GRADS_AND_VARS, []).extend(
          zip(grads, variables))
      self.modules[x.name] = SyntheticModule(tuple(variables), prediction,
                                             target, loss)
      out.append(prediction)
    return out

  def __repr__(self):
    return (f"synthetic(hidden={self.hidden!r}, "
            f"labels={getattr(self.labels, 'name', None)!r}, "
            f"loss_weight={self.loss_weight!r})")


def synthetic(hidden: Sequence[int] = (), labels: Optional[tf.Tensor] = None,
              loss_weight: float = 1.0,
              seed: Optional[int] = None) -> Replacement:
  """Synthetic gradients (Jaderberg et al., 2017, "Decoupled Neural
  Interfaces using Synthetic Gradients").

  At each input ``x`` of the layer (flattened to ``[batch, n]``), a small
  module ``M`` (an MLP with ReLU hidden layers ``hidden`` and a linear output
  layer initialised to zero) predicts the gradient from the activations and,
  optionally, the labels ``y``:

      dx_hat = M([stop_gradient(x), y]).

  Everything below the layer trains on ``dx_hat`` instead of the chain rule.
  ``M`` trains in the same train op on

      L_M = loss_weight * ||dx_hat - stop_gradient(dx)||^2,

  where ``dx`` is what the chain rule gives from the gradient at the layer's
  outputs (after its upstream transform; synthetic itself, when the layer
  above has a synthetic replacement too). ``M``'s ``(grad, var)`` pairs are
  appended to ``plan.compute_gradients()``. The layer's own parameters get
  their true gradients. ``r.modules`` maps each input tensor's name to its
  :class:`SyntheticModule` (variables, prediction, target, loss).

  Args:
    hidden: sizes of the module's hidden layers; ``()`` is a linear module.
    labels: an optional ``[batch, ...]`` tensor (e.g. one-hot labels) the
      module is conditioned on, as the paper's cDNI.
    loss_weight: scale of the regression loss.
    seed: seed of the stateless initialiser of the hidden layers.

  Returns:
    A replacement for ``plan.replace_backward(layer, r)``.

  Raises:
    GraphGradError: if ``hidden`` is not a sequence of positive ints,
      ``labels`` is not a tensor, ``loss_weight`` is not a non-negative
      finite number or ``seed`` is not an int.

  Example:
    >>> synthetic(hidden=(64,))
    synthetic(hidden=(64,), labels=None, loss_weight=1.0)
  """
  if not isinstance(hidden, (list, tuple, range)):
    raise _errors.GraphGradError(
        f"synthetic: `hidden` must hold positive layer sizes, as a tuple or "
        f"list; got {type(hidden).__name__} {hidden!r}. Pass e.g. "
        f"hidden=(64,), or () for a linear module.")
  hidden = tuple(hidden)
  if any(not isinstance(h, int) or isinstance(h, bool) or h <= 0
         for h in hidden):
    raise _errors.GraphGradError(
        f"synthetic: `hidden` must hold positive layer sizes; got {hidden!r}. "
        f"Pass e.g. hidden=(64,), or () for a linear module.")
  if labels is not None and not isinstance(labels, tf.Tensor):
    raise _errors.GraphGradError(
        f"synthetic: `labels` must be a tensor of the graph, such as the "
        f"one-hot label placeholder; got {type(labels).__name__}.")
  _validate.number("synthetic", "loss_weight", loss_weight,
                   what="non-negative", low=0.0, tensor=False,
                   fix="Pass e.g. loss_weight=1.0.")
  _validate.seed("synthetic", seed)
  return _Synthetic(hidden, labels, loss_weight, seed)
