"""Backward replacements: compute what a layer sends below without W^T.

``plan.replace_backward(layer, r)`` makes ``r`` compute the gradient that
``layer`` sends to its input tensors, instead of the chain rule; the layer's
own parameter gradients still come from the true upstream gradient. A
replacement is a :class:`Replacement` (or any callable) mapping a
:class:`BackwardContext` to one gradient per input tensor, or to a
:class:`BackwardResult` that also carries the ``(gradient, variable)`` pairs
of variables it trains itself. Such variables are made once per plan, in
its :class:`~graphgrad.transforms.Resources`, from deterministic initial
values (:func:`feedback_matrix_value`, ``module_values``) that every
executor calls.
"""

import dataclasses
import zlib
from typing import (
  Any,
  Callable,
  List,
  Optional,
  Sequence,
  Tuple,
  Union,
)

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient, gradient_values
from graphgrad.analysis._layer_graph import Layer, LayerGraph
from graphgrad.transforms import _checks
from graphgrad.transforms._context import Resources


@dataclasses.dataclass(frozen=True)
class BackwardContext:
  """What a backward replacement sees of one layer.

  Attributes:
    layer: the :class:`~graphgrad.Layer` whose backward pass is replaced.
    net: the analysed layer graph.
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
    resources: the plan's store, where the replacement keeps what it
      creates once per plan (``resources.get_or_create(layer, name, make)``).
  """
  layer: Layer
  net: LayerGraph
  inputs: Sequence[tf.Tensor]
  outputs: Sequence[tf.Tensor]
  upstream: Sequence[Gradient]
  upstream_of: Callable[[str], List[Gradient]]
  chain_rule: Callable[[], List[Gradient]]
  resources: Resources


@dataclasses.dataclass(frozen=True)
class BackwardResult:
  """What a replacement returns when it trains variables of its own.

  Attributes:
    input_grads: one gradient (or ``None``) per ``context.inputs`` tensor.
    extra_grads_and_vars: ``(gradient, variable)`` pairs of the
      replacement's own variables (a synthetic-gradient module's), which the
      plan appends to ``compute_gradients()`` so that one train op updates
      them too.
  """
  input_grads: Sequence[Gradient]
  extra_grads_and_vars: Sequence[Tuple[Gradient, tf.Variable]] = ()


class Replacement:
  """Base class of backward replacements; the contract of a user-written one.

  A subclass implements :meth:`backward`, mapping a :class:`BackwardContext`
  to one gradient (or ``None``) per ``context.inputs`` tensor, each shaped
  like its tensor, or to a :class:`BackwardResult` when it also trains
  variables of its own. :meth:`check` refuses, when the replacement is
  declared, layers it cannot handle; :meth:`cuts` names the layers whose
  output gradients :meth:`backward` reads with ``context.upstream_of``.
  What it creates once per plan goes in ``context.resources``. A plain
  callable taking the context works too.

  Example:
    >>> import tensorflow as tf, graphgrad as gg
    >>> class HalfChainRule(gg.backward.Replacement):
    ...   name = "half_chain_rule"
    ...   def backward(self, context):
    ...     return [0.5 * g for g in context.chain_rule()]
    >>> with tf.Graph().as_default():
    ...   plan = gg.GradientPlan(gg.demo.two_layer_loss())
    ...   gv = plan.replace_backward("l2", HalfChainRule()).compute_gradients()
    ...   with tf.compat.v1.Session() as s:
    ...     s.run(tf.compat.v1.global_variables_initializer())
    ...     print([s.run(g).tolist() for g, _ in gv])
    [[[1.5], [3.0]], 3.0]
  """

  name = "replacement"

  def check(self, net: LayerGraph, layer: str) -> None:
    """Raises a ``GraphGradError`` if ``layer`` cannot be handled."""

  def cuts(self, net: LayerGraph, layer: str) -> List[str]:
    return []

  def backward(self, context: BackwardContext
               ) -> Union[List[Gradient], BackwardResult]:
    raise NotImplementedError

  def __call__(self, context: BackwardContext
               ) -> Union[List[Gradient], BackwardResult]:
    with tf.name_scope(self.name):
      return self.backward(context)


def run_replacement(fn: Callable, context: Any, where: str) -> BackwardResult:
  """Calls ``fn(context)`` and checks one gradient per input, shaped like it.

  Every executor runs a replacement through here: the TF1 segment engine
  (with a :class:`BackwardContext`) and ``KerasPlan`` (with its
  ``KerasBackwardContext``); both contexts have ``inputs``.

  Args:
    fn: the replacement.
    context: what it sees of the layer.
    where: ``"replace_backward('l2')"``, for messages.

  Returns:
    The result as a :class:`BackwardResult`.

  Raises:
    GraphGradError: naming ``where``, for an exception ``fn`` raised (chained
      to it).
    IncompatibleGradientError: for a result that is not a list of one
      gradient per input, or a gradient of another shape, dtype or
      ``tf.Graph``.
  """
  try:
    out = fn(context)
  except _errors.GraphGradError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise _checks.raised_error(where, "replacement", fn, e) from e
  return checked_result(fn, out, context.inputs, where)


def checked_result(fn: Callable, out: Any, inputs: Sequence[tf.Tensor],
                   where: str) -> BackwardResult:
  """Checks a replacement's result ``out``: one gradient (or ``None``) like
  each of ``inputs``, alone or in a :class:`BackwardResult`.

  Example:
    >>> x = tf.zeros([2, 3])
    >>> checked_result("r", [tf.ones([2, 3])], [x], "here").input_grads[0].shape
    TensorShape([2, 3])
    >>> checked_result("r", tf.ones([2, 3]), [x], "here")
    Traceback (most recent call last):
    ...
    graphgrad._errors.IncompatibleGradientError: here: 'r' returned one tensor,
    not a list, for 1 input tensors (the input of shape (2, 3) float32). Return
    one gradient (or None) per context.inputs tensor, in order.
  """
  if isinstance(out, BackwardResult):
    grads, extra = out.input_grads, tuple(out.extra_grads_and_vars)
  else:
    grads, extra = out, ()
  if not isinstance(grads, (list, tuple)) or len(grads) != len(inputs):
    got = (f"{len(grads)} gradients" if isinstance(grads, (list, tuple))
           else "None" if grads is None
           else "one tensor, not a list," if tf.is_tensor(grads)
           else type(grads).__name__)
    raise _errors.IncompatibleGradientError(
        f"{where}: {fn!r} returned {got} for {len(inputs)} input tensors "
        f"({', '.join(_tensor_text(t) for t in inputs)}). Return one "
        f"gradient (or None) per context.inputs tensor, in order.")
  for t, g in zip(inputs, grads):
    _check_gradient(fn, g, t, where)
  return BackwardResult(list(grads), extra)


def _tensor_text(t) -> str:
  if tf.is_symbolic_tensor(t):
    return t.name
  return f"the input of shape {t.shape} {t.dtype.name}"  # eager: no name


def _check_gradient(fn, g, t, where: str) -> None:
  values = gradient_values(g)
  if values is None:
    return
  if not tf.is_tensor(values):
    raise _errors.IncompatibleGradientError(
        f"{where}: {fn!r} returned {type(values).__name__} {values!r} for "
        f"the input {_tensor_text(t)}; return a tensor shaped like the "
        f"input, or None.")
  if _checks.other_graph(values, t):
    raise _checks.graph_error(where, "replacement", values, t)
  if values.dtype != t.dtype or not values.shape.is_compatible_with(t.shape):
    raise _errors.IncompatibleGradientError(
        f"{where}: {fn!r} returned a gradient of shape {values.shape} "
        f"{values.dtype.name} for the input {_tensor_text(t)} of shape "
        f"{t.shape} {t.dtype.name}. Return a gradient shaped like the input.")


def engine_hook(net: LayerGraph, name: str, fn: Callable,
                resources: Resources,
                extra: List[Tuple[Gradient, tf.Variable]]) -> Callable:
  """Wraps ``fn`` for the segment engine: its arguments in, checked
  gradients out; the result's extra ``(gradient, variable)`` pairs go to
  ``extra``. An exception ``fn`` raises becomes a ``GraphGradError`` naming
  the layer."""
  def run(layer, outputs, upstream, inputs, upstream_of, chain_rule):
    ctx = BackwardContext(layer=net[layer], net=net, inputs=tuple(inputs),
                          outputs=tuple(outputs), upstream=tuple(upstream),
                          upstream_of=upstream_of, chain_rule=chain_rule,
                          resources=resources)
    with tf.name_scope(f"replace_backward_{ctx.layer.name}".replace("/", "_")):
      result = run_replacement(fn, ctx, f"replace_backward({name!r})")
    extra.extend(result.extra_grads_and_vars)
    return result.input_grads
  return run


def stateless_seed(seed: int, key: str) -> List[int]:
  """The seed pair of a stateless draw: ``[seed, crc32(key)]``.

  Every initial value a replacement draws (feedback matrices, synthetic
  modules) is keyed so, in every executor.

  Example:
    >>> stateless_seed(0, "feedback_alignment/l2")[0]
    0
  """
  return [seed, zlib.crc32(key.encode())]


def feedback_matrix_value(seed: Optional[int], name: str, layer: str, shape,
                          stddev: float, dtype=tf.float32) -> tf.Tensor:
  """The initial value of a fixed ``N(0, stddev^2)`` feedback matrix.

  With a seed, a stateless draw from ``[seed, crc32(f"{name}/{layer}")]``:
  the same numbers in a ``tf.Graph`` and eagerly, in every session, for the
  same seed, name, layer and shape. Without one, a draw from the tf.Graph's
  (or the global) random seed.

  Example:
    >>> a = feedback_matrix_value(0, "feedback_alignment", "l2", [2, 3], 0.5)
    >>> b = feedback_matrix_value(0, "feedback_alignment", "l2", [2, 3], 0.5)
    >>> bool(tf.reduce_all(a == b)), a.shape.as_list()
    (True, [2, 3])
  """
  if seed is None:
    return tf.random.normal(shape, stddev=stddev, dtype=dtype)
  return tf.random.stateless_normal(
      shape, seed=stateless_seed(seed, f"{name}/{layer}"), stddev=stddev,
      dtype=dtype)


def feedback_matrix(context: BackwardContext, key: str,
                    value: Callable[[], tf.Tensor]) -> tf.Variable:
  """A fixed matrix with initial ``value()``, one variable per plan."""
  return context.resources.get_or_create(
      context.layer.name, f"{key}/B",
      lambda: tf.compat.v1.Variable(value(), trainable=False, name="B"))


def static_features(t: tf.Tensor, what: str, fix: str = (
    "Give the input a static shape (tf.ensure_shape or set_shape).")) -> int:
  """The number of features per example of ``t``: its non-batch dims' size.

  Raises:
    UnsupportedGraphError: if a non-batch dimension is unknown; ``fix``
      ends the message.
  """
  dims = t.shape.as_list()[1:] if t.shape.rank else None
  if dims is None or not dims or any(d is None for d in dims):
    name = getattr(t, "name", None)  # an eager tensor has none
    raise _errors.UnsupportedGraphError(
        f"{what}: {'the tensor ' + name if name else 'a tensor'} has shape "
        f"{t.shape}; a fixed random projection needs a batch dimension "
        f"followed by known dimensions. {fix}")
  return int(np.prod(dims))
