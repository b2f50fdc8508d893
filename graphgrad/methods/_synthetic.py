"""Synthetic gradients: a trained module predicts a layer's input gradient."""

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.methods._replacement import (
  BackwardContext,
  BackwardResult,
  Replacement,
  stateless_seed,
  static_features,
)
from graphgrad.transforms import _validate


@dataclasses.dataclass(frozen=True)
class SyntheticModule:
  """The module that predicts the gradient at one input tensor.

  Attributes:
    variables: its trainable variables, input side first.
    prediction: the synthetic gradient sent below, shaped like the input.
    target: the true gradient it regresses onto (``stop_gradient`` applied).
    loss: ``loss_weight * ||prediction - target||^2``, the regression loss.
    input: the layer's input tensor whose gradient it predicts.
  """
  variables: Sequence[tf.Variable]
  prediction: tf.Tensor
  target: tf.Tensor
  loss: tf.Tensor
  input: Optional[tf.Tensor] = None


def module_values(seed: Optional[int], layer: str, index: int,
                  sizes: Sequence[int], dtype=tf.float32) -> List[tf.Tensor]:
  """Initial values ``[kernel_0, bias_0, kernel_1, ...]`` of a module.

  The module maps ``sizes[0]`` features through ``sizes[1:]``. Hidden
  kernels are He-normal stateless draws from ``[seed or 0, crc32(key)]``
  with ``key`` naming the layer, the input's position ``index`` and the
  kernel; the output kernel and every bias are zero (the first synthetic
  gradients are zero, as in Jaderberg et al.). The same numbers in a
  ``tf.Graph`` and eagerly for the same arguments.

  Example:
    >>> [v.shape.as_list() for v in module_values(0, "l2", 0, [3, 4, 2])]
    [[3, 4], [4], [4, 2], [2]]
  """
  made = []
  seed = 0 if seed is None else seed
  for j, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    if j == len(sizes) - 2:
      made.append(tf.zeros([n_in, n_out], dtype))
    else:
      made.append(tf.random.stateless_normal(
          [n_in, n_out], seed=stateless_seed(seed, f"{(layer, index)}/{j}"),
          stddev=np.sqrt(2.0 / n_in), dtype=dtype))
    made.append(tf.zeros([n_out], dtype))
  return made


class SyntheticGradients(Replacement):
  name = "synthetic"

  def __init__(self, hidden, labels, loss_weight, seed):
    self.hidden = tuple(hidden)
    self.labels = labels
    self.loss_weight = loss_weight
    self.seed = seed

  def check(self, net, layer):
    if self.labels is not None and not isinstance(net, LayerGraph):
      raise _errors.GraphGradError(
          f"replace_backward({layer!r}): on a KerasPlan the labels of "
          f"synthetic(labels=...) only exist inside the training step. "
          f"Declare gg.backward.synthetic() without labels and pass them "
          f"each step: `with plan.tape(labels=y_onehot) as tape:`.")

  def initial_values(self, layer: str, index: int, sizes: Sequence[int],
                     dtype=tf.float32) -> List[tf.Tensor]:
    """The initial values of the module at ``layer``'s input ``index``, as
    every executor makes them (see :func:`module_values`)."""
    return module_values(self.seed, layer, index, sizes, dtype)

  def modules(self, plan) -> Dict[str, SyntheticModule]:
    """Input tensor name -> its :class:`SyntheticModule`, in one built plan.

    Args:
      plan: a built ``GradientPlan`` that declared this replacement (on any
        number of layers); each plan has its own modules.
    """
    layers = [l for l, r in plan.rules.replacements.items() if r is self]
    return {m.input.name: m for l in layers
            for m in plan.resources.of_layer(l).values()
            if isinstance(m, SyntheticModule) and m.input is not None
            and tf.is_symbolic_tensor(m.input)}

  def backward(self, context: BackwardContext) -> BackwardResult:
    """Each input's module's prediction below; its pairs to train it."""
    labels = self.labels if self.labels is not None else context.labels
    out: List[Optional[tf.Tensor]] = []
    extra: List[Tuple[Gradient, tf.Variable]] = []
    for i, (x, target) in enumerate(zip(context.inputs, context.chain_rule())):
      if target is None:  # the input does not reach the outputs
        out.append(None)
        continue
      module = self._module(context, labels, i, x, target)
      grads = context.vjp([module.loss], list(module.variables))
      extra += zip(grads, module.variables)
      context.resources.put(context.name, f"synthetic/module_{i}", module)
      out.append(module.prediction)
    return BackwardResult(out, extra)

  def _module(self, context, labels, i, x, target) -> SyntheticModule:
    z, n = module_input(x, labels, context.name)
    sizes = [int(z.shape[-1]), *self.hidden, n]
    values: List[tf.Tensor] = []  # the initial values, made on first use

    def value(k):
      if not values:
        values.extend(self.initial_values(context.name, i, sizes, x.dtype))
      return values[k]
    variables = [context.variable(
        f"synthetic/{i}/{'kernel' if k % 2 == 0 else 'bias'}_{k // 2}",
        lambda k=k: value(k), trainable=True,
        name=f"{'kernel' if k % 2 == 0 else 'bias'}_{k // 2}")
                 for k in range(2 * (len(sizes) - 1))]
    prediction = tf.reshape(mlp(z, variables), tf.shape(x), name="prediction")
    target = tf.stop_gradient(tf.convert_to_tensor(target), name="target")
    loss = tf.multiply(tf.cast(self.loss_weight, x.dtype),
                       tf.reduce_sum(tf.square(prediction - target)),
                       name="loss")
    return SyntheticModule(tuple(variables), prediction, target, loss, x)

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
  their true gradients. Each plan, and each layer, that declares one
  ``synthetic()`` value gets its own modules: ``r.modules(plan)`` maps each
  input tensor's name to its :class:`SyntheticModule` (variables,
  prediction, target, loss) in ``plan``.

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
  hidden = _check_hidden(hidden)
  if labels is not None and not isinstance(labels, tf.Tensor):
    raise _errors.GraphGradError(
        f"synthetic: `labels` must be a tensor of the tf.Graph, such as the "
        f"one-hot label placeholder; got {type(labels).__name__}.")
  _validate.number("synthetic", "loss_weight", loss_weight,
                   what="non-negative", low=0.0, tensor=False,
                   fix="Pass e.g. loss_weight=1.0.")
  _validate.seed("synthetic", seed)
  return SyntheticGradients(hidden, labels, loss_weight, seed)


def _check_hidden(hidden) -> Tuple[int, ...]:
  """``hidden`` as a tuple of positive ints; raises GraphGradError if not."""
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
  return hidden


def module_input(x: tf.Tensor, labels: Optional[tf.Tensor],
                 layer: str) -> Tuple[tf.Tensor, int]:
  """A synthetic module's input at ``x`` of ``layer``, and ``x``'s features.

  ``[stop_gradient(x), labels]``, each flattened to ``[batch, n]``; both
  plans build it so.

  Raises:
    UnsupportedGraphError: if ``x`` or ``labels`` has an unknown non-batch
      dimension.
  """
  n = static_features(x, f"synthetic on {layer!r}")
  feats = [tf.reshape(tf.stop_gradient(x), [-1, n])]
  if labels is not None:
    n_labels = static_features(labels, "synthetic `labels`")
    cast = tf.cast(tf.stop_gradient(labels), x.dtype)
    feats.append(tf.reshape(cast, [-1, n_labels]))
  return (tf.concat(feats, 1) if len(feats) > 1 else feats[0]), n


def mlp(z: tf.Tensor, variables: Sequence[tf.Variable]) -> tf.Tensor:
  """The module's forward pass: ``(kernel, bias)`` pairs, ReLU between."""
  h = z
  for j in range(0, len(variables), 2):
    h = tf.matmul(h, variables[j]) + variables[j + 1]
    if j + 2 < len(variables):
      h = tf.nn.relu(h)
  return h
