"""Backward replacements: compute what a layer sends below without W^T.

``plan.replace_backward(layer, r)`` makes ``r`` compute the gradient that
``layer`` sends to its input tensors, instead of the chain rule; the layer's
own parameter gradients still come from the true upstream gradient. A
replacement is a :class:`Replacement` (or any callable) mapping a
:class:`BackwardContext` to one gradient per input tensor, or to a
:class:`BackwardResult` that also carries the ``(gradient, variable)`` pairs
of variables it trains itself. Both plans make the one context type: it
differentiates through the executor's VJP (``context.vjp``) and keeps the
replacement's variables, made once per plan from deterministic initial
values (:func:`feedback_matrix_value`, ``module_values``), in the plan's
store (``context.variable``). Each executor's side of it is its own: the
TF1 engine's is ``graphgrad.plan._replacement_graph``.
"""

import dataclasses
import zlib
from typing import (
  Any,
  Callable,
  List,
  Optional,
  Protocol,
  Sequence,
  Tuple,
  Union,
)

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient, gradient_values
from graphgrad.analysis import _graph_util
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.transforms import _checks
from graphgrad.transforms._context import Resources


@dataclasses.dataclass(frozen=True)
class DenseMatMul:
  """A dense layer's kernel product ``pre = data @ kernel``, as one executor
  found it: what :meth:`BackwardContext.dense` gives.

  Attributes:
    data: the tensor the kernel multiplies.
    kernel: the kernel as the product reads it.
    pre: the product. :meth:`BackwardContext.vjp` differentiates
      ``outputs`` for it (or stops at it), and it for ``data``.
    outputs: one tensor per ``context.outputs``, computed through ``pre``.
    kernel_index: the kernel's operand position, 0 (``kernel @ data``) or
      1 (``data @ kernel``).
    transpose_a: the product's ``transpose_a``.
    transpose_b: the product's ``transpose_b``.

  Example:
    >>> x, w = tf.ones([2, 3]), tf.ones([3, 4])
    >>> d = DenseMatMul(data=x, kernel=w, pre=x @ w, outputs=())
    >>> d.fan_out, float(d.product(2.0 * w)[0, 0])  # feedback's B in W's place
    (4, 6.0)
  """
  data: tf.Tensor
  kernel: tf.Tensor
  pre: tf.Tensor
  outputs: Sequence[tf.Tensor]
  kernel_index: int = 1
  transpose_a: bool = False
  transpose_b: bool = False

  @property
  def fan_out(self) -> int:
    """The product's output features."""
    return int(self.pre.shape[-1] if self.kernel_index == 1
               else self.pre.shape[0])

  def product(self, kernel: tf.Tensor) -> tf.Tensor:
    """``data`` times ``kernel`` in the place of the layer's kernel."""
    operands = [self.data, self.data]
    operands[self.kernel_index] = kernel
    return tf.matmul(operands[0], operands[1], transpose_a=self.transpose_a,
                     transpose_b=self.transpose_b)


class BackwardExecutor(Protocol):
  """What an executor gives a :class:`BackwardContext`: its VJP, its store
  of method variables and its view of a dense layer."""

  def vjp(self, ys: Sequence[tf.Tensor], xs: Sequence[Any],
          grad_ys: Optional[Sequence[Gradient]],
          stop: Sequence[tf.Tensor]) -> List[Gradient]:
    """The gradients of ``ys`` for ``xs``, none flowing back via ``stop``."""

  def variable(self, key: str, init: Callable[[], tf.Tensor],
               trainable: bool, name: str) -> tf.Variable:
    """The layer's variable under ``key``, made from ``init()`` once."""

  def dense(self, who: str) -> DenseMatMul:
    """The layer's kernel product; raises UnsupportedGraphError if none."""


@dataclasses.dataclass(frozen=True)
class BackwardContext:
  """What a backward replacement sees of one layer, in either plan.

  ``GradientPlan`` and ``KerasPlan`` both make this one type; only
  ``layer`` and ``net`` hold what each executor analysed.

  Attributes:
    layer: the layer whose backward pass is replaced: a
      :class:`~graphgrad.Layer` in a ``GradientPlan``, the Keras layer in a
      ``KerasPlan``.
    name: the layer's name (its ``"outer/inner"`` path in a Keras model).
    net: the layers the plan analysed: the :class:`~graphgrad.LayerGraph`
      of a ``GradientPlan``, the model's layers in a ``KerasPlan``.
    inputs: the layer's input tensors that need a gradient (a Keras
      call's floating-point inputs); return one gradient per tensor, in
      this order.
    outputs: the layer's output tensors.
    upstream: the gradients at ``outputs`` (after the layer's upstream
      transforms, if any); entries may be ``None``.
    upstream_of: ``name -> [grad per output]``: the complete gradient at the
      outputs of a layer above (one that the plan rewrites or that the
      replacement declares in ``cuts``).
    chain_rule: ``() -> [grad per input]``: builds what plain
      backpropagation of ``upstream`` through the layer gives.
    resources: the plan's store, where the replacement keeps what it
      creates once per plan (``resources.get_or_create(name, key, make)``).
    executor: the executor's VJP, variable store and dense-layer view,
      which :meth:`vjp`, :meth:`variable` and :meth:`dense` call.
    labels: the labels given to a ``KerasPlan``'s ``plan.tape(labels=...)``,
      else ``None``.

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
  net: Any
  inputs: Sequence[tf.Tensor]
  outputs: Sequence[tf.Tensor]
  upstream: Sequence[Gradient]
  upstream_of: Callable[[str], List[Gradient]]
  chain_rule: Callable[[], List[Gradient]]
  resources: Resources
  executor: BackwardExecutor
  labels: Optional[tf.Tensor] = None

  def vjp(self, ys: Sequence[tf.Tensor], xs: Sequence[Any],
          grad_ys: Optional[Sequence[Gradient]] = None,
          stop: Sequence[tf.Tensor] = ()) -> List[Gradient]:
    """The gradients of ``ys`` for ``xs``, by the plan's own VJP.

    ``tf.gradients`` through the plan's gradient function (its overrides
    included) in a ``GradientPlan``; the tape that recorded the layer call
    in a ``KerasPlan``, on which everything the replacement builds is
    recorded too.

    Args:
      ys: tensors of the layer (``outputs``) or built by the replacement.
      xs: tensors or variables to differentiate for.
      grad_ys: one gradient per ``ys`` tensor (an entry ``None``: nothing
        flows from that tensor); ``None`` for ones.
      stop: tensors no gradient flows back through, as ``tf.gradients``'
        ``stop_gradients``. On a ``KerasPlan`` these can be only the
        context's ``inputs`` and ``dense().pre``: its tape recorded nothing
        behind them.

    Returns:
      One gradient (or ``None``, where unconnected) per ``xs`` entry.

    Raises:
      GraphGradError: on a ``KerasPlan``, for another ``stop`` tensor.
    """
    ys = list(ys)
    if grad_ys is not None:  # the same on every executor
      pairs = [(y, g) for y, g in zip(ys, grad_ys) if g is not None]
      ys, grad_ys = [y for y, _ in pairs], [g for _, g in pairs]
    return list(self.executor.vjp(ys, list(xs), grad_ys, list(stop)))

  def variable(self, key: str, init: Callable[[], tf.Tensor],
               trainable: bool = False, name: str = "B") -> tf.Variable:
    """The replacement's variable ``key`` of this layer, made once per plan.

    In a ``GradientPlan`` it is kept in ``resources`` under ``(name of the
    layer, key)``; in a ``KerasPlan`` in ``plan.method_variables``, under
    ``"<first part of key>/<layer>/<rest of key>"``, which
    ``tf.train.Checkpoint`` saves.

    Args:
      key: what the variable is, prefixed by the replacement's name
        (``"feedback_alignment"``, ``"synthetic/0/kernel_0"``).
      init: makes its initial value; called once.
      trainable: whether the plan's optimizer may train it.
      name: the variable's own name.
    """
    return self.executor.variable(key, init, trainable, name)

  def dense(self, who: str = "feedback_alignment") -> DenseMatMul:
    """The layer's kernel product, found by the executor.

    In a ``GradientPlan``: the layer's one MatMul against one of its own
    2-D variables, in the op graph. In a ``KerasPlan``: a ``Dense`` layer's
    ``x @ kernel``, recomputed from the call's input, with ``outputs``
    through its bias and activation.

    Args:
      who: names the caller in messages.

    Raises:
      UnsupportedGraphError: for a layer that is not dense.
    """
    return self.executor.dense(who)


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
  variables of its own. It differentiates with ``context.vjp`` and keeps its
  variables with ``context.variable``, so that it runs on both plans.
  :meth:`check` refuses, when the replacement is declared, layers it cannot
  handle; :meth:`cuts` names the layers whose output gradients
  :meth:`backward` reads with ``context.upstream_of``. A plain callable
  taking the context works too.

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
  # Whether what backward() sends below scales with context.upstream (then
  # a loss scale passes through it unchanged).
  homogeneous = False

  def check(self, net: Any, layer: str) -> None:
    """Raises a ``GraphGradError`` if ``layer`` cannot be handled.

    Args:
      net: the plan's layers, as ``context.net``: a ``LayerGraph`` in a
        ``GradientPlan``, the model's layers in a ``KerasPlan``.
      layer: the layer's name.
    """

  def cuts(self, net: Any, layer: str) -> List[str]:
    """The layers whose output gradients ``backward`` reads (``net`` as in
    :meth:`check`)."""
    return []

  def backward(self, context: BackwardContext
               ) -> Union[List[Gradient], BackwardResult]:
    raise NotImplementedError

  def __call__(self, context: BackwardContext
               ) -> Union[List[Gradient], BackwardResult]:
    with tf.name_scope(self.name):
      return self.backward(context)


class FunctionReplacement(Replacement):
  """A plain callable ``fn(context)`` declared as a backward replacement.

  It has the typed attributes of every :class:`Replacement` (reads no other
  layer, not homogeneous), calls ``fn`` as it is, without a name scope of
  its own, and shows as ``fn``.
  """

  def __init__(self, fn: Callable):
    self.fn = fn
    self.name = getattr(fn, "__name__", type(fn).__name__)

  def backward(self, context: BackwardContext):
    return self.fn(context)

  def __call__(self, context: BackwardContext):
    return self.fn(context)

  def __repr__(self) -> str:
    return repr(self.fn)


def as_replacement(fn: Callable) -> Replacement:
  """``fn`` as a :class:`Replacement`: itself, or a plain callable wrapped
  in a :class:`FunctionReplacement`."""
  return fn if isinstance(fn, Replacement) else FunctionReplacement(fn)


def run_replacement(fn: Callable, context: Any, where: str) -> BackwardResult:
  """Calls ``fn(context)`` and checks one gradient per input, shaped like it.

  Every executor runs a replacement through here, with the
  :class:`BackwardContext` it made: the TF1 segment engine and the Keras
  tape.

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
  inputs = context.inputs
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


def kernel_matmul(net: LayerGraph, layer: str, who: str
                  ) -> Tuple[tf.Operation, int]:
  """(op, kernel operand index) of ``layer``'s one MatMul with a kernel.

  Raises:
    UnsupportedGraphError: naming ``who``, if the layer has no such MatMul,
      or several.
  """
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
        f"{who}: layer {layer!r} must be a dense layer, with exactly one "
        f"MatMul against one of its own 2-D variables; found {len(found)} "
        f"such MatMul ops among its op types ({', '.join(types)}). Use "
        f"direct_feedback_alignment() or synthetic() for other layer types, "
        f"or group the layer so that it holds one dense kernel.")
  return found[0]


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


def static_features(t: tf.Tensor, what: str) -> int:
  """The number of features per example of ``t``: its non-batch dims' size.

  Raises:
    UnsupportedGraphError: if a non-batch dimension is unknown.
  """
  dims = t.shape.as_list()[1:] if t.shape.rank else None
  if dims is None or not dims or any(d is None for d in dims):
    name = getattr(t, "name", None)  # an eager tensor has none
    raise _errors.UnsupportedGraphError(
        f"{what}: {'the tensor ' + name if name else 'a tensor'} has shape "
        f"{t.shape}; a fixed random projection needs a batch dimension "
        f"followed by known dimensions. Give the input a static shape "
        f"(tf.ensure_shape or set_shape in a tf.Graph; keras.Input(shape=...) "
        f"for a Keras model).")
  return int(np.prod(dims))
