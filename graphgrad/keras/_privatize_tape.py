"""DP-SGD under a plan tape: per-example norms from the Keras layer calls.

While the tape records, :class:`Recorder` wraps the ``call`` of every layer
that holds trainable variables itself and keeps each call's input and
output. After the forward pass, one backward pass of ``sum_i l_i`` gives the
gradient at every recorded output, and the rule :data:`RULES` registers for
the layer's type makes the forms (:mod:`graphgrad.core._forms`) of its
variables' uses: ``Dense`` and ``EinsumDense`` (input, pre-activation
gradient), ``Conv2D`` (the same, and its strides), ``Embedding`` (ids,
gradient), ``LayerNormalization`` (normalized input times gradient).
Another layer (a recurrent or ``TimeDistributed`` one for its sublayers'
variables too) gets exact per-example gradients through its own call, run
on each example's rows of its inputs (``TapeVJP.per_example``), logged
once. The recorder is the tape's :class:`~graphgrad.core._privacy.Uses`.
"""

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from graphgrad import _compat, _errors
from graphgrad.analysis import _example_axis
from graphgrad.core._forms import (
  Conv2DForm,
  DenseForm,
  EmbeddingForm,
  Form,
  PerExampleForm,
  after,
  broadcast_per_example,
  einsum_dense,
  examples_first,
  norm_dtype,
  rows,
)
from graphgrad.keras._layer_index import (
  CallPatches,
  direct_variables,
  holds_variables,
  inputs_where,
  tf_variable,
)
from graphgrad.keras._tape_vjp import TapeVJP, error_line

log = logging.getLogger("graphgrad")

_warned: set = set()
# Models whose ops were checked for mixing examples (eager steps).
_TRACED: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()

# (variable, form) of each variable a layer call uses.
Forms = List[Tuple[tf.Variable, Form]]


def _kind(layer) -> str:
  """The Keras class name of a layer of Keras 3 or tf-keras, else ``""``."""
  cls = type(layer)
  module = cls.__module__.split(".")[0]
  return cls.__name__ if module in ("keras", "tf_keras") else ""


class Recorder:
  """The layer calls of one forward pass: where the variables meet the
  examples.

  Args:
    model: the Keras model.
  """

  def __init__(self, model):
    self.model = model
    self.calls: List[Dict[str, Any]] = []
    self._patches = CallPatches()

  # -- recording -------------------------------------------------------------

  def patch(self) -> None:
    """Wraps the ``call`` of every layer holding trainable variables (or
    not built yet)."""
    stack = [self.model]
    seen = set()
    while stack:
      layer = stack.pop()
      if id(layer) in seen:
        continue
      seen.add(id(layer))
      if not _is_unit(layer):  # its sublayers are recorded in its call
        stack += _compat.sublayers(layer)
      if _kind(layer) == "BatchNormalization" and layer.trainable:
        raise _errors.UnsupportedGraphError(
            f"privatize: the BatchNormalization layer {layer.name!r} "
            f"normalizes each example with the statistics of the whole "
            f"batch, so one example changes every other example's gradient "
            f"and clipping each one bounds nothing. Use LayerNormalization "
            f"or GroupNormalization, or freeze it (layer.trainable = False).")
      # An unbuilt layer may make its variables in its first call.
      if (not getattr(layer, "built", True)
          or (_owns_variables(layer) and layer.trainable_weights)):
        self._patches.replace(layer, self._wrapper(layer, layer.call))

  def unpatch(self) -> None:
    self._patches.restore()

  def _wrapper(self, layer, call):
    def wrapped_call(*args, **kwargs):
      act = _activation_to_split(layer, args)
      if act is None:
        pre = out = _apart(call(*args, **kwargs))
      else:  # the pre-activation's gradient comes from the one backward pass
        layer.activation = _identity
        try:
          pre = call(*args, **kwargs)
        finally:
          layer.activation = act
        out = act(pre)
      # Which layers hold variables is read after the forward pass
      # (_holding): inside a call, Keras 3's autocast scope of a
      # mixed_float16 layer reads each variable as a float16 tensor.
      self.calls.append(dict(layer=layer, call=call, args=args,
                             kwargs=kwargs, out=pre))
      return out
    return wrapped_call

  def _holding(self) -> List[Dict[str, Any]]:
    """The recorded calls of layers that hold trainable variables."""
    return [c for c in self.calls
            if _owns_variables(c["layer"]) and c["layer"].trainable_weights]

  # -- ops that mix examples, in an eager step ------------------------------

  def refuse_mixing(self) -> None:
    """Traces the model once on its input signature and refuses an op that
    mixes examples on the way to its outputs.

    A traced step's loss is checked whole by ``private_gradients``; an
    eager one has no graph, so the model (not the loss function) is traced
    here, once per model. A model without known inputs (subclassed, never
    called on ``keras.Input``) is logged once and not checked.
    """
    model = self.model
    if model in _TRACED:
      return
    inputs = getattr(model, "inputs", None)
    try:
      specs = [tf.TensorSpec(x.shape, x.dtype) for x in inputs or ()]
    except (AttributeError, TypeError, ValueError):
      specs = []
    if not specs:
      log.warning("privatize: %r has no known inputs (a subclassed model?), "
                  "so its ops are not checked for mixing examples in an "
                  "eager step; run the step in a tf.function to check the "
                  "whole loss.", getattr(model, "name", model))
      _TRACED[model] = True
      return
    call = tf.function(lambda *xs: model(xs[0] if len(xs) == 1 else list(xs),
                                         training=True))
    graph = call.get_concrete_function(*specs).graph
    for out in graph.outputs:
      if out.dtype.is_floating and out.shape.rank:
        _example_axis.refuse_mixing(out)
    _TRACED[model] = True  # checked: a refused model is checked again

  # -- the Uses of core._privacy.private_gradients ---------------------------

  def outputs(self) -> List[tf.Tensor]:
    return [y for c in self._holding() for y in _flat_outputs(c)]

  def forms(self, grads, batch) -> Dict[Any, list]:
    forms: Dict[Any, list] = {}
    grads = list(grads)
    for c in self._holding():
      n = len(_flat_outputs(c))
      dys, grads = grads[:n], grads[n:]
      dys = [tf.convert_to_tensor(dy) if isinstance(dy, tf.IndexedSlices)
             else dy for dy in dys]
      if all(dy is None for dy in dys):
        continue
      for var, form in _forms(c, dys, batch):
        forms.setdefault(var.ref(), []).append(form)
    if not forms:
      raise _errors.NotConnectedError(
          "privatize: no layer with trainable variables ran under the tape "
          "on the way to the loss; call the model inside `with "
          "plan.tape() as tape:`.")
    return forms

  def key(self, variable):
    v = tf_variable(variable)
    return None if v is None else v.ref()

  def refuse_outside(self, variable) -> None:
    raise _errors.UnsupportedGraphError(
        f"privatize: {getattr(variable, 'name', variable)} reaches the loss "
        f"other than through the call of a layer that holds it, so its "
        f"per-example gradient is unknown. Use it inside a Keras layer that "
        f"owns it, or leave it out of `sources`.")


# -- the boundary tensors of each layer type -----------------------------------


def _is_unit(layer) -> bool:
  """A layer whose call is recorded for the variables of its sublayers too.

  A Keras recurrent layer (``LSTM``, ``GRU``, ``SimpleRNN``, ``RNN``)
  calls its cell inside a loop on ``(inputs, states)``, and tf-keras' fused
  ``LSTM`` and ``GRU`` never call it. A ``TimeDistributed`` layer calls the
  layer it wraps on the rows of every example at once (tf-keras merges
  them into ``[B*T, ...]``), so a call of the wrapped layer is not one row
  per example.
  """
  return _kind(layer) == "TimeDistributed" or any(
      c.__name__ == "RNN" and c.__module__.split(".")[0]
      in ("keras", "tf_keras") for c in type(layer).__mro__)


def _owns_variables(layer) -> bool:
  """Whether a recorded call of ``layer`` stands for its variables."""
  return _is_unit(layer) or holds_variables(layer)


def _own_variables(layer) -> List[tf.Variable]:
  """The trainable variables a call of ``layer`` stands for."""
  trainable = {v.ref() for v in map(tf_variable, layer.trainable_weights)
               if v is not None}
  held = ([tf_variable(v) for v in layer.trainable_weights]
          if _is_unit(layer) else direct_variables(layer))
  return [v for v in held if v is not None and v.ref() in trainable]


def _flat_outputs(call: Dict[str, Any]) -> List[tf.Tensor]:
  """The tensors a recorded call returned (a tensor, a tuple, a dict)."""
  return [y for y in tf.nest.flatten(call["out"]) if isinstance(y, tf.Tensor)]


def _apart(out):
  """A nested output whose tensors no other one depends on: the gradient
  at each is then what reaches it from outside the call alone (an RNN's
  last output is computed from its last state, and may be that tensor)."""
  if len(tf.nest.flatten(out)) < 2:
    return out
  return tf.nest.map_structure(
      lambda y: tf.identity(y) if isinstance(y, tf.Tensor) else y, out)


def _forms(call: Dict[str, Any], dys, batch) -> Forms:
  """``(variable, form)`` of each use in one layer call, by the rule
  :data:`RULES` registers for the layer's type, from the gradients ``dys``
  at its :func:`_flat_outputs`."""
  layer = call["layer"]
  kind = _kind(layer)
  x = call["args"][0] if call["args"] else None
  rule = RULES.get(kind)
  if (rule is not None and isinstance(x, tf.Tensor)
      and len(call["args"]) == 1 and len(dys) == 1 and dys[0] is not None):
    # A rule reads rows [B, ...] of its input and gradient: a time-major
    # [T, B, ...] call is refused, not mixed up. Every form reads the
    # gradient, which waits for the checks.
    dy = after(_examples_first(layer, x, batch, "input")
                + _examples_first(layer, dys[0], batch, "output"), dys[0])
    if not dy.shape.is_fully_defined():  # from a tf.py_function, say
      dy = tf.ensure_shape(dy, _flat_outputs(call)[0].shape)
    out = rule(layer, x, dy, batch)
    if out is not None:
      return out
  return _fallback(call, dys, batch)


def _examples_first(layer, x: tf.Tensor, batch, what: str) -> list:
  """The check that the leading axis of ``x``, the ``what`` of a call of
  ``layer``, is the examples' (``core._forms.examples_first``)."""
  return examples_first(x, batch, f"the {what} of layer {layer.name!r}",
                        f" ({type(layer).__name__})")


def _identity(x):
  return x


def _linear(layer) -> bool:
  act = getattr(layer, "activation", None)
  return act is None or getattr(act, "__name__", "") == "linear"


def _activation_to_split(layer, args):
  """The activation a recorded call applies after its kernel rule's
  product, or ``None``: the call then records its pre-activation output,
  whose gradient the rule needs, and the activation runs after it."""
  kind = _kind(layer)
  if (kind not in _KERNEL_RULES or _linear(layer) or len(args) != 1
      or not isinstance(args[0], tf.Tensor)
      or not _KERNEL_RULES[kind](layer)):
    return None
  return layer.activation


def _kernel_forms(layer, dy, batch, kernel_form):
  """The forms of a layer ``activation(product(kernel) + bias)``: the
  kernel's ``kernel_form(g, dtype)`` from the gradient ``g = dy`` at the
  pre-activation, the bias' per example. A call the rule reads (one
  tensor argument, a layer the rule accepts) recorded its pre-activation
  (:func:`_activation_to_split`)."""
  kernel = tf_variable(layer.kernel)
  bias = tf_variable(getattr(layer, "bias", None))
  dtype = norm_dtype(kernel.dtype)
  g = dy
  out: Forms = [(kernel, kernel_form(g, dtype))]
  if bias is not None:
    # The rows of an example (a tf-keras TimeDistributed layer merges them
    # into the leading axis, [B*T, units]) first, as rows() reads the input.
    out.append((bias, PerExampleForm(broadcast_per_example(
        rows(g, batch, dtype), bias.shape, batch))))
  return out


def _dense_ok(layer) -> bool:
  return not (getattr(layer, "lora_enabled", False)
              or getattr(layer, "quantization_mode", None))


def _dense(layer, x, dy, batch):
  if not _dense_ok(layer):
    return None
  return _kernel_forms(layer, dy, batch, lambda g, dtype: DenseForm(
      rows(x, batch, dtype), rows(g, batch, dtype)))


def _einsum_dense_ok(layer) -> bool:
  return _dense_ok(layer) and isinstance(getattr(layer, "equation", None),
                                         str)


def _einsum_dense(layer, x, dy, batch):
  """``EinsumDense`` (the projections of ``MultiHeadAttention``): a dense
  form when its equation is a dense op on trailing axes, its bias per
  example (the bias lines up with the output's trailing axes)."""
  if not _einsum_dense_ok(layer):
    return None
  kernel = tf_variable(layer.kernel)
  bias = tf_variable(getattr(layer, "bias", None))
  dtype = norm_dtype(kernel.dtype)
  form = einsum_dense(layer.equation, x, dy, kernel.shape, batch, dtype)
  if form is None:
    return None
  out: Forms = [(kernel, form)]
  if bias is not None:
    p = broadcast_per_example(tf.cast(dy, dtype), bias.shape, batch)
    if p is None:
      return None
    out.append((bias, PerExampleForm(p)))
  return out


def _conv2d_ok(layer) -> bool:
  return (layer.data_format == "channels_last"
          and getattr(layer, "groups", 1) == 1
          and tuple(layer.dilation_rate) == (1, 1)
          and layer.padding in ("same", "valid"))


def _conv2d(layer, x, dy, batch):
  if not _conv2d_ok(layer):
    return None
  shape = tf_variable(layer.kernel).shape
  strides = [1, *layer.strides, 1]
  padding = layer.padding.upper()
  return _kernel_forms(layer, dy, batch, lambda g, dtype: Conv2DForm(
      x, g, shape, strides, padding))


def _embedding(layer, x, dy, batch):
  if getattr(layer, "lora_enabled", False) or getattr(
      layer, "quantization_mode", None):
    return None
  table = tf_variable(layer.embeddings)
  dtype = norm_dtype(table.dtype)
  ids = tf.reshape(tf.cast(x, tf.int64), [batch, -1])
  return [(table, EmbeddingForm(ids, rows(dy, batch, dtype)))]


def _layer_norm(layer, x, dy, batch):
  if getattr(layer, "rms_scaling", False):
    return None
  axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
  rank = x.shape.rank
  axes = sorted(a % rank for a in axes)
  if axes != list(range(rank - len(axes), rank)):
    return None  # the scale lines up with trailing axes only
  gamma, beta = tf_variable(layer.gamma), tf_variable(layer.beta)
  dtype = norm_dtype((beta if gamma is None else gamma).dtype)
  xf, g = tf.cast(x, dtype), tf.cast(dy, dtype)
  mean, var = tf.nn.moments(xf, axes=axes, keepdims=True)
  normed = (xf - mean) * tf.math.rsqrt(var + layer.epsilon)
  parts = ([(gamma, normed * g)] if gamma is not None else []) + (
      [(beta, g)] if beta is not None else [])
  out = [(v, broadcast_per_example(p, v.shape, batch)) for v, p in parts]
  if any(p is None for _, p in out):
    return None
  return [(v, PerExampleForm(p)) for v, p in out]


# The forms of a layer's call by its Keras class name: ``rule(layer, x, dy,
# batch)``, with ``x`` the call's one tensor argument and ``dy`` the
# gradient at its output; ``None`` where the rule does not apply (the exact
# fallback then).
RULES: Dict[str, Callable[..., Optional[Forms]]] = {
    "Dense": _dense, "EinsumDense": _einsum_dense, "Conv2D": _conv2d,
    "Embedding": _embedding, "LayerNormalization": _layer_norm}
# The rules that read the gradient at the pre-activation, and when they apply.
_KERNEL_RULES = {"Dense": _dense_ok, "EinsumDense": _einsum_dense_ok,
                 "Conv2D": _conv2d_ok}


def _fallback(call: Dict[str, Any], dys, batch) -> Forms:
  """Exact per-example gradients of the layer's own variables.

  The call runs once per example on row ``i`` of every tensor argument
  whose leading axis is the examples' (that of its first output); the
  other arguments (nested in lists and dicts too) pass whole. It runs
  through the layer itself, in the scope the layer opens around its call:
  there tf-keras' autocast reads float32 variables as float16.
  """
  layer, args, kwargs = call["layer"], call["args"], call["kwargs"]
  variables = _own_variables(layer)
  outs = _flat_outputs(call)
  rows = tf.get_static_value(batch)
  if rows is None:  # a traced batch of unknown size: checked when run
    rows = outs[0].shape[0] if outs and outs[0].shape.rank else -1
  xs, run = inputs_where(layer, args, kwargs, lambda x: (
      isinstance(x, tf.Tensor) and bool(x.shape.rank)
      and x.shape[0] == rows))
  if not xs:
    raise _errors.UnsupportedGraphError(
        f"privatize: layer {layer.name!r} ({type(layer).__name__}) has no "
        f"norm rule, and no tensor argument of its call has the examples "
        f"along its first axis (as its output does), so its per-example "
        f"gradients cannot be computed. Pass the examples to the layer as "
        f"tensors of shape [batch, ...].")
  key = type(layer).__name__
  if key not in _warned:
    _warned.add(key)
    log.warning("privatize: no norm rule for %s layers (%r); their "
                "per-example gradients are computed through their own call, "
                "one example at a time.", key, layer.name)

  dtype = norm_dtype(variables[0].dtype)
  vjp = TapeVJP.of_call(run, xs)
  # The gradients at the flattened output, a non-tensor's None; each one's
  # rows are the examples', as the inputs' (each gradient waits for the
  # checks: the per-example gradients read them all).
  checks = [c for x in xs
            for c in _examples_first(layer, x, batch, "input")]
  checks += [c for dy in dys if dy is not None
             for c in _examples_first(layer, dy, batch, "output")]
  grads = iter([None if dy is None else after(checks, dy) for dy in dys])
  name = f"layer {layer.name!r} ({type(layer).__name__})"
  try:
    per = vjp.per_example(call["out"], variables, [
        next(grads) if isinstance(y, tf.Tensor) else None
        for y in tf.nest.flatten(call["out"])], batch,
                          loop=_is_unit(layer), name=name)
  except (ValueError, TypeError, NotImplementedError,
          tf.errors.OpError) as e:
    raise _errors.UnsupportedGraphError(
        f"privatize: {name} has no norm rule, and its call fails on one "
        f"example at a time ({type(e).__name__}: {error_line(e)}), so its "
        f"per-example gradients cannot be computed. Write the call with ops "
        f"that treat each example alone (no fixed batch size), or train "
        f"without privatize.") from e
  return [(v, PerExampleForm(tf.cast(p, dtype)))
          for v, p in zip(variables, per)]
