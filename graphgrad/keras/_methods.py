"""The backward replacements of ``gg.backward`` on Keras layers.

``gg.backward.feedback_alignment``, ``direct_feedback_alignment`` and
``synthetic`` describe a method by their public fields (``seed``,
``stddev``, ``error_layer``, ``hidden``, ``loss_weight``); the TF1 engine
runs them on graph ops, and this module runs the same equations on the
tensors a Keras layer's ``call`` saw. Their variables (feedback matrices,
synthetic-gradient modules) are made once per plan, from the same seeds and
keys as the TF1 plan's, so that both plans start from equal values; they
live in the plan's :class:`MethodVariables`, which ``tf.train.Checkpoint``
saves with the plan.

A user-written replacement on a :class:`~graphgrad.KerasPlan` is a callable
mapping a :class:`KerasBackwardContext` to one gradient per
``context.inputs`` tensor (or to a ``gg.backward.BackwardResult``); it runs,
and its result is checked, as on a ``GradientPlan``.
"""

import dataclasses
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.keras._layer_tree import tf_variable
from graphgrad.methods import _backward
from graphgrad.methods import _synthetic as _synthetic_lib

GradsAndVars = List[Tuple[Gradient, tf.Variable]]


class MethodVariables(tf.Module):
  """The variables a plan's training methods own, by key.

  Keys are ``"feedback_alignment/<layer>"``, ``"dfa_<i>/<layer>"`` (the
  feedback matrices, as the TF1 plan keys them) and
  ``"synthetic/<layer>/<i>/kernel_<j>"`` (``bias_<j>``). The values are
  ``tf.Variable`` objects, tracked for ``tf.train.Checkpoint``. ``states``
  holds the state modules of stateful task-combination methods (GradVac,
  Nash-MTL), by ``"combine_tasks/<layer>"``, tracked as well.
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


@dataclasses.dataclass(frozen=True)
class KerasBackwardContext:
  """What a backward replacement sees of one call of a Keras layer.

  Attributes:
    layer: the Keras layer whose backward pass is replaced.
    name: its path in the model (``"outer/inner"`` for a nested layer).
    inputs: the floating-point tensors the call received; return one
      gradient per tensor, in this order.
    outputs: the floating-point tensors it returned.
    upstream: the gradients at ``outputs`` (after the layer's upstream
      transform); entries may be ``None``.
    upstream_of: ``path -> [grad per output]``: the complete gradient at
      the outputs of a layer above (one the replacement reads, such as the
      error layer of direct feedback alignment).
    chain_rule: ``() -> [grad per input]``: what plain backpropagation of
      ``upstream`` through the call gives.
    variables: the plan's :class:`MethodVariables`.
    labels: the ``labels`` given to ``plan.tape(labels=...)``, or ``None``.

  Example:
    A replacement that sends half of the chain rule's gradient below ``l2``:

    >>> import tensorflow as tf, graphgrad as gg
    >>> ones = dict(use_bias=False, kernel_initializer="ones")
    >>> model = tf.keras.Sequential([
    ...     tf.keras.Input((1,)), tf.keras.layers.Dense(1, name="l1", **ones),
    ...     tf.keras.layers.Dense(1, name="l2", **ones)])
    >>> halved = lambda ctx: [0.5 * g for g in ctx.chain_rule()]
    >>> plan = gg.KerasPlan(model).replace_backward("l2", halved)
    >>> with plan.tape() as tape:
    ...   loss = tf.reduce_sum(3.0 * model(tf.constant([[2.0]])))
    >>> [g.numpy().tolist() for g in tape.gradient(loss)]  # l1, l2 kernels
    [[[3.0]], [[6.0]]]
  """
  layer: Any
  name: str
  inputs: Sequence[tf.Tensor]
  outputs: Sequence[tf.Tensor]
  upstream: Sequence[Gradient]
  upstream_of: Callable[[str], List[Gradient]]
  chain_rule: Callable[[], List[Gradient]]
  variables: MethodVariables
  labels: Optional[tf.Tensor] = None


_FIX = "Give the model's input a static shape (keras.Input(shape=...))."


def _features(t, what: str) -> int:
  return _backward.static_features(t, what, _FIX)


def feedback_matrix(ctx: KerasBackwardContext, key: str, shape, stddev,
                    seed: Optional[int]) -> tf.Variable:
  """A fixed ``N(0, stddev^2)`` matrix, the TF1 plan's for equal ``seed``."""
  def init():
    if seed is None:
      return tf.random.normal(shape, stddev=stddev)
    derived = zlib.crc32(f"{key}/{ctx.name}".encode())
    return tf.random.stateless_normal(shape, seed=[seed, derived],
                                      stddev=stddev)
  return ctx.variables.get(f"{key}/{ctx.name}", init, trainable=False,
                           name="B")


# -- feedback alignment --------------------------------------------------------

def dense_parts(layer, path: str):
  """``(kernel, bias, activation)`` of a Dense layer, or raises."""
  kernel = tf_variable(getattr(layer, "kernel", None))
  if kernel is None or kernel.shape.rank != 2 or not hasattr(
      layer, "activation"):
    raise _errors.UnsupportedGraphError(
        f"feedback_alignment: layer {path!r} ({type(layer).__name__}) must "
        f"be a built Dense layer, with a 2-D `kernel` and an `activation`. "
        f"Use direct_feedback_alignment() or synthetic() for other layer "
        f"types.")
  bias = tf_variable(getattr(layer, "bias", None))
  return kernel, bias, layer.activation


def _feedback_alignment(r, ctx: KerasBackwardContext) -> List[Gradient]:
  kernel, bias, act = dense_parts(ctx.layer, ctx.name)
  (x,), (dy,) = ctx.inputs, ctx.upstream
  if dy is None:
    return [None]
  if x.shape.rank != 2:
    raise _errors.UnsupportedGraphError(
        f"feedback_alignment: layer {ctx.name!r} got an input of shape "
        f"{x.shape}; feedback alignment needs a [batch, features] input. "
        f"Flatten it first (keras.layers.Flatten).")
  fan = int(kernel.shape[-1])
  stddev = r.stddev if r.stddev is not None else 1.0 / np.sqrt(fan)
  b = feedback_matrix(ctx, "feedback_alignment", kernel.shape, stddev, r.seed)
  # delta: the gradient at x @ W, through the bias and activation above it.
  with tf.GradientTape() as tape:
    z = tf.matmul(x, tf.cast(kernel, x.dtype))
    tape.watch(z)
    y = z if bias is None else tf.nn.bias_add(z, tf.cast(bias, z.dtype))
    y = act(y) if act is not None else y
  delta = tape.gradient(y, z, output_gradients=tf.convert_to_tensor(dy))
  return [tf.matmul(delta, tf.cast(b, delta.dtype), transpose_b=True)]


# -- direct feedback alignment -------------------------------------------------

def _direct_feedback_alignment(r, ctx: KerasBackwardContext, error_layer):
  error = [g for g in ctx.upstream_of(error_layer)]
  if len(error) != 1:
    raise _errors.GraphGradError(
        f"direct_feedback_alignment: the error layer {error_layer!r} must "
        f"have one floating-point output (the logits); it has "
        f"{len(error)}. Pass error_layer= a layer with a single output.")
  if error[0] is None:
    return [None] * len(ctx.inputs)
  e = tf.convert_to_tensor(error[0])
  n_err = _features(e, "direct_feedback_alignment error")
  e = tf.reshape(e, [-1, n_err])
  out = []
  for i, t in enumerate(ctx.inputs):
    n_in = _features(t, f"direct_feedback_alignment on {ctx.name!r}")
    stddev = r.stddev if r.stddev is not None else 1.0 / np.sqrt(n_err)
    b = feedback_matrix(ctx, f"dfa_{i}", [n_err, n_in], stddev, r.seed)
    g = tf.matmul(tf.cast(e, t.dtype), tf.cast(b, t.dtype))
    out.append(tf.reshape(g, tf.shape(t)))
  return out


# -- synthetic gradients -------------------------------------------------------

def _module(r, ctx, i, sizes, dtype) -> List[tf.Variable]:
  """The synthetic module at input ``i``: the TF1 plan's initial values."""
  prefix = f"synthetic/{ctx.name}/{i}"
  values: List[tf.Tensor] = []  # module_values, made on the first init

  def value(k):
    if not values:
      values.extend(_synthetic_lib.module_values(r.seed, ctx.name, i, sizes,
                                                 dtype))
    return values[k]
  made = []
  for j in range(len(sizes) - 1):
    made.append(ctx.variables.get(f"{prefix}/kernel_{j}",
                                  lambda k=2 * j: value(k), True,
                                  f"kernel_{j}"))
    made.append(ctx.variables.get(f"{prefix}/bias_{j}",
                                  lambda k=2 * j + 1: value(k), True,
                                  f"bias_{j}"))
  return made


def _synthetic(r, ctx: KerasBackwardContext):
  true = ctx.chain_rule()
  out: List[Gradient] = []
  extra: GradsAndVars = []
  for i, (x, target) in enumerate(zip(ctx.inputs, true)):
    if target is None:
      out.append(None)
      continue
    z, n = _synthetic_lib.module_input(x, ctx.labels, ctx.name, _FIX)
    variables = _module(r, ctx, i, [int(z.shape[-1]), *r.hidden, n], x.dtype)
    with tf.GradientTape() as tape:
      prediction = tf.reshape(_synthetic_lib.mlp(z, variables), tf.shape(x))
      target = tf.stop_gradient(tf.convert_to_tensor(target))
      loss = tf.cast(r.loss_weight, x.dtype) * tf.reduce_sum(
          tf.square(prediction - target))
    extra += list(zip(tape.gradient(loss, variables), variables))
    out.append(prediction)
  return out, extra


# -- dispatch ------------------------------------------------------------------

def method_of(fn) -> Optional[str]:
  """``fn``'s name when it is one of gg.backward's methods, else ``None``."""
  name = getattr(fn, "name", None)
  known = ("feedback_alignment", "direct_feedback_alignment", "synthetic")
  return name if name in known and hasattr(fn, "backward") else None


def check(fn, layer, path: str) -> None:
  """Refuses, when declared, what the Keras form of ``fn`` cannot do."""
  method = method_of(fn)
  if method == "synthetic" and getattr(fn, "labels", None) is not None:
    raise _errors.GraphGradError(
        f"replace_backward({path!r}): on a KerasPlan the labels of "
        f"synthetic(labels=...) only exist inside the training step. "
        f"Declare gg.backward.synthetic() without labels and pass them "
        f"each step: `with plan.tape(labels=y_onehot) as tape:`.")
  if method == "feedback_alignment" and getattr(layer, "built", False):
    dense_parts(layer, path)


def run(fn, ctx: KerasBackwardContext,
        error_layer: Optional[str]) -> Tuple[List[Gradient], GradsAndVars]:
  """Runs replacement ``fn`` on one call; returns (grads, extra pairs).

  A user's replacement runs through ``gg.backward``'s ``run_replacement``,
  as on the TF1 plan: an exception it raises names the layer, and its
  result is checked (one gradient like each input, of this graph or
  eager, alone or in a ``BackwardResult``).
  """
  method = method_of(fn)
  where = f"replace_backward({ctx.name!r})"
  extra: GradsAndVars = []
  with tf.name_scope(method or "replace_backward"):
    if method is None:
      result = _backward.run_replacement(fn, ctx, where)
      return list(result.input_grads), list(result.extra_grads_and_vars)
    if method == "feedback_alignment":
      grads = _feedback_alignment(fn, ctx)
    elif method == "direct_feedback_alignment":
      grads = _direct_feedback_alignment(fn, ctx, error_layer)
    else:
      grads, extra = _synthetic(fn, ctx)
  result = _backward.checked_result(fn, grads, ctx.inputs, where)
  return list(result.input_grads), extra


def error_layer(fn, path: str, model, index) -> Optional[str]:
  """The error layer of ``fn`` if it is DFA's replacement on ``path``.

  DFA projects the gradient at ``fn.error_layer``'s output, by default the
  last top-level layer that holds variables in ``model``'s ``index``.

  Raises:
    GraphGradError: if the default is ambiguous (several model outputs) or
      unknown (the model is not built).
  """
  if method_of(fn) != "direct_feedback_alignment":
    return None
  if fn.error_layer is not None:
    return index.find(fn.error_layer, "error_layer")
  if len(getattr(model, "outputs", None) or ()) > 1:
    raise _errors.GraphGradError(
        f"direct_feedback_alignment on {path!r}: `error_layer` is needed, "
        f"because the model has {len(model.outputs)} outputs. Pass "
        f"error_layer='...', the layer whose output gradient (the error at "
        f"the logits) is projected.")
  tops = [p for p in index.paths if "/" not in p and index[p].weights]
  if not tops:
    raise _errors.GraphGradError(
        f"direct_feedback_alignment on {path!r}: `error_layer` is needed, "
        f"because the model's layers hold no variables yet (it is not "
        f"built), so the top layer is unknown. Pass error_layer='...', or "
        f"build the model first (call it once, or give it a keras.Input).")
  return tops[-1]
