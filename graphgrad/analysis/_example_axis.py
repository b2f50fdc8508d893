"""The example axis of a per-example loss, and the ops that mix examples.

DP-SGD's clip bounds each example's influence only if the loss of example
``i`` depends on example ``i`` alone. :func:`mixing_ops` walks back from the
loss ``[B]`` and gives each tensor its demand: the axis that holds the
example, or ``SHARED`` where one value serves every example (a weight). Each
op type maps its output's demand to its inputs (:data:`_RULES`). Examples
mix where one tensor is demanded both per example and shared
(``h - reduce_mean(h, axis=0)``), or where an op works along the example
axis (a softmax, sort or top-k over it, batch norm in training mode, a
concatenation, tile or positional slice of examples). An op without a rule
is assumed to keep examples apart, logged once. ``privatize`` checks every
graph loss with it, on both plans.
"""

import dataclasses
import logging
import re
from typing import Any, Callable, Dict, List, Optional, Set, Union

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util

log = logging.getLogger("graphgrad")

SHARED = "shared"
Demand = Union[int, str]  # an axis, or SHARED

_warned: Set[str] = set()

# Leaves (data, constants, variables) and ops whose value is a shape only.
_NO_VALUE = frozenset({
    "Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike", "NoOp",
    "VarHandleOp", "VariableV2", "ReadVariableOp", "Const", "Placeholder",
    "PlaceholderWithDefault", "BroadcastArgs", "BroadcastGradientArgs",
    "IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue"})

_ELEMENTWISE = frozenset({
    "Add", "AddV2", "Sub", "Mul", "Div", "RealDiv", "DivNoNan", "Maximum",
    "Minimum", "Pow", "SquaredDifference", "FloorDiv", "FloorMod", "Mod",
    "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual",
    "LogicalAnd", "LogicalOr", "LogicalNot", "Select", "SelectV2", "AddN",
    "BiasAdd", "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Sigmoid",
    "Tanh", "Softplus", "Softsign", "Exp", "Expm1", "Log", "Log1p", "Sqrt",
    "Rsqrt", "Square", "Abs", "Neg", "Reciprocal", "Sign", "Floor", "Ceil",
    "Round", "Rint", "Sin", "Cos", "Tan", "Atan", "Atan2", "Erf", "Erfc",
    "Cast", "Identity", "StopGradient", "PreventGradient", "CheckNumerics",
    "ClipByValue", "Snapshot", "EnsureShape", "Gelu", "Xlogy", "Xdivy",
    "IsNan", "IsFinite", "IsInf", "Inv", "BroadcastTo", "Sinh", "Cosh",
    "Asinh", "Acosh", "Atanh", "Lgamma", "Digamma"})

_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any",
                         "EuclideanNorm", "ArgMax", "ArgMin"})

_SPATIAL = frozenset({
    "Conv2D", "Conv3D", "Conv1D", "DepthwiseConv2dNative", "MaxPool",
    "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D", "LRN",
    "ResizeBilinear", "ResizeNearestNeighbor", "ExtractImagePatches",
    "Conv2DBackpropInput", "Conv3DBackpropInputV2",
    "DepthwiseConv2dNativeBackpropInput"})
# Transposed convolutions: (output shape, filter, data).
_BACKPROP_INPUT = frozenset({"Conv2DBackpropInput", "Conv3DBackpropInputV2",
                             "DepthwiseConv2dNativeBackpropInput"})

_FIX = ("Use a per-example operation instead (LayerNormalization or "
        "GroupNormalization instead of batch statistics, a reduction over "
        "the other axes), or train without privatize.")


@dataclasses.dataclass(frozen=True)
class Mixing:
  """An op through which one example's loss depends on other examples.

  Attributes:
    op: the op that reads across examples.
    why: what it does, in words.
  """
  op: tf.Operation
  why: str

  def message(self) -> str:
    return (f"privatize: the {self.op.type} op {self.op.name!r} {self.why}, "
            f"so one example changes every other example's loss and "
            f"clipping each example's gradient bounds nothing. {_FIX}")


def mixing_ops(loss: tf.Tensor) -> List[Mixing]:
  """The ops through which ``loss`` (``[B]``, one value per example) mixes
  examples, the nearest the loss first (empty when each example's loss
  depends on that example alone).

  Example:
    >>> import tensorflow as tf
    >>> with tf.Graph().as_default():
    ...   h = tf.compat.v1.placeholder(tf.float32, [None, 3])
    ...   ok = mixing_ops(tf.reduce_sum(tf.square(h), axis=1))
    ...   bad = mixing_ops(tf.reduce_sum(h - tf.reduce_mean(h, 0), axis=1))
    >>> ok, [m.op.type for m in bad]
    ([], ['Mean'])
  """
  walk = _Walk()
  walk.demand(loss, 0, None)
  for op in sorted(_graph_util.forward_ops(loss), key=_graph_util.op_id,
                   reverse=True):
    walk.visit(op)
  found = {id(m.op): m for m in walk.mixed}
  for ref, demands in walk.demands.items():
    axes = {d for d in demands if d != SHARED}
    if (SHARED in demands and axes) or len(axes) > 1:
      op = walk.shared_by.get(ref) or ref.deref().op
      if id(op) not in found:
        found[id(op)] = Mixing(op, "reads values of several examples into "
                                   "one that reaches every example's loss")
  # Nearest the loss first: a shared value also makes everything behind it
  # shared, so the ops further back are the same mixing seen again.
  return sorted(found.values(), key=lambda m: -_graph_util.op_id(m.op))


class _Walk:
  """The demands found so far, and the ops that mix."""

  def __init__(self):
    # Keyed by tensor.ref(): graph tensors are not hashable under TF2.
    self.demands: Dict[Any, Set[Demand]] = {}
    self.shared_by: Dict[Any, tf.Operation] = {}
    self.mixed: List[Mixing] = []

  def demand(self, t: tf.Tensor, d: Optional[Demand],
             by: Optional[tf.Operation]) -> None:
    if d is None or t.dtype == tf.resource or t.dtype == tf.variant:
      return
    self.demands.setdefault(t.ref(), set()).add(d)
    if d == SHARED and by is not None:
      self.shared_by.setdefault(t.ref(), by)

  def mix(self, op: tf.Operation, why: str) -> None:
    self.mixed.append(Mixing(op, why))

  def visit(self, op: tf.Operation) -> None:
    if op.type in _NO_VALUE:
      return
    for out in op.outputs:
      for d in self.demands.get(out.ref(), ()):
        if isinstance(d, int):
          self._axis(op, out, d)
        else:
          for x in op.inputs:
            self.demand(x, SHARED, op)

  def _axis(self, op: tf.Operation, out: tf.Tensor, k: int) -> None:
    rule = _RULES.get(op.type)
    if rule is None and op.type in _ELEMENTWISE:
      rule = _elementwise
    elif rule is None and op.type in _REDUCTIONS:
      rule = _reduction
    elif rule is None and op.type in _SPATIAL:
      rule = _spatial
    if rule is None:
      _unknown(self, op, out, k)
      return
    why = rule(self, op, out, k)
    if why:
      self.mix(op, why)


# -- the rules: (walk, op, output, example axis k) -> why it mixes, or None --


def _static(t: tf.Tensor, depth: int = 8):
  """``t``'s value as a list when the graph fixes it: a constant, or a small
  integer computation of constants (the permutation ``tf.nn.softmax(h,
  axis=0)`` builds from ranges, which ``tf.get_static_value`` leaves)."""
  value = tf.get_static_value(t)
  if value is not None:
    return value.tolist()
  op = t.op
  fold = _FOLD.get(op.type)
  if fold is None or depth == 0:
    return None
  args = [_static(x, depth - 1) for x in op.inputs]
  if any(a is None for a in args):
    return None
  try:
    return np.asarray(fold(op, *args), t.dtype.as_numpy_dtype).tolist()
  except (ValueError, TypeError, IndexError):
    return None


_FOLD: Dict[str, Callable[..., Any]] = {
    "Range": lambda op, a, b, d: np.arange(a, b, d),
    "Pack": lambda op, *xs: np.stack(xs, axis=op.get_attr("axis")),
    "ConcatV2": lambda op, *xs: np.concatenate(
        [np.atleast_1d(x) for x in xs[:-1]], axis=xs[-1]),
    "Sub": lambda op, a, b: np.subtract(a, b),
    "AddV2": lambda op, a, b: np.add(a, b),
    "Add": lambda op, a, b: np.add(a, b),
    "Mul": lambda op, a, b: np.multiply(a, b),
}


def _elementwise(w: _Walk, op, out, k):
  rank = out.shape.rank
  for x in op.inputs:
    r = x.shape.rank
    if rank is None or r is None:
      w.demand(x, k, op)
      continue
    ax = k - (rank - r)
    broadcast = ax < 0 or (x.shape[ax] == 1 and out.shape[k] != 1)
    w.demand(x, SHARED if broadcast else ax, op)
  return None


def _reduction(w: _Walk, op, out, k):
  x, axes_t = op.inputs[0], op.inputs[1]
  axes = _static(axes_t)
  rank = x.shape.rank
  if axes is None or rank is None:
    return ("reduces over axes unknown until run time, which may include "
            "the example axis")
  axes = {a % rank for a in (axes if isinstance(axes, list) else [axes])}
  keep = (op.get_attr("keep_dims")
          if op.type not in ("ArgMax", "ArgMin") else False)
  j = k if keep else [a for a in range(rank) if a not in axes][k]
  if j in axes:
    return "reduces over the example axis"
  w.demand(x, j, op)
  return None


def _matmul(w: _Walk, op, out, k):
  a, b = op.inputs
  ta, tb = op.get_attr("transpose_a"), op.get_attr("transpose_b")
  if k == 0:
    w.demand(a, 1 if ta else 0, op)
    w.demand(b, SHARED, op)
  else:
    w.demand(b, 0 if tb else 1, op)
    w.demand(a, SHARED, op)
  return None


def _batch_matmul(w: _Walk, op, out, k):
  x, y = op.inputs[:2]
  rank = out.shape.rank
  adj_x = op.get_attr("adj_x")
  adj_y = op.get_attr("adj_y")
  if rank is None or x.shape.rank is None or y.shape.rank is None:
    w.demand(x, k, op)
    w.demand(y, k, op)
    return None
  rx, ry = x.shape.rank, y.shape.rank
  if k < rank - 2:
    for t, r in ((x, rx), (y, ry)):
      ax = k - (rank - r)
      w.demand(t, SHARED if ax < 0 or t.shape[ax] == 1 else ax, op)
  elif k == rank - 2:
    w.demand(x, rx - 1 if adj_x else rx - 2, op)
    w.demand(y, SHARED, op)
  else:
    w.demand(y, ry - 2 if adj_y else ry - 1, op)
    w.demand(x, SHARED, op)
  return None


_EINSUM_TERM = re.compile(r"^[a-zA-Z]*$")


def _einsum(w: _Walk, op, out, k):
  equation = op.get_attr("equation").decode().replace(" ", "")
  ins, _, result = equation.partition("->")
  terms = ins.split(",")
  if not result or not all(_EINSUM_TERM.match(t) for t in terms + [result]):
    return _unknown(w, op, out, k)
  letter = result[k]
  for x, term in zip(op.inputs, terms):
    w.demand(x, term.index(letter) if letter in term else SHARED, op)
  return None


def _transpose(w: _Walk, op, out, k):
  perm = _static(op.inputs[1])
  if perm is None:
    return _unknown(w, op, out, k)
  w.demand(op.inputs[0], perm[k], op)
  return None


def _reshape(w: _Walk, op, out, k):
  """The example axis is the outermost axis of size other than 1 on both
  sides (a flatten, or tf-keras' layer norm's ``[1, B, ...]``)."""
  x = op.inputs[0]
  if x.shape.rank == 0:
    return None
  if x.shape.rank is None or not all(out.shape[a] == 1 for a in range(k)):
    return _unknown(w, op, out, k)
  w.demand(x, next((a for a in range(x.shape.rank) if x.shape[a] != 1), 0),
           op)
  return None


def _expand_dims(w: _Walk, op, out, k):
  d = _static(op.inputs[1])
  rank = out.shape.rank
  if d is None or rank is None:
    return _unknown(w, op, out, k)
  d = d % rank
  if k != d:
    w.demand(op.inputs[0], k if k < d else k - 1, op)
  else:
    w.demand(op.inputs[0], SHARED, op)
  return None


def _squeeze(w: _Walk, op, out, k):
  x = op.inputs[0]
  rank = x.shape.rank
  dims = op.get_attr("squeeze_dims")
  if rank is None or (not dims and not x.shape.is_fully_defined()):
    return _unknown(w, op, out, k)
  dims = ({d % rank for d in dims} if dims
          else {a for a in range(rank) if x.shape[a] == 1})
  w.demand(x, [a for a in range(rank) if a not in dims][k], op)
  return None


def _concat(w: _Walk, op, out, k):
  values, axis = op.inputs[:-1], _static(op.inputs[-1])
  if axis is None or out.shape.rank is None:
    return _unknown(w, op, out, k)
  if axis % out.shape.rank == k:
    return ("concatenates along the example axis, so the loss's rows are "
            "no longer one per example")
  for v in values:
    w.demand(v, k, op)
  return None


def _pack(w: _Walk, op, out, k):
  axis = op.get_attr("axis") % out.shape.rank
  if axis == k:
    return ("stacks tensors along the example axis, so the loss's rows are "
            "no longer one per example")
  for v in op.inputs:
    w.demand(v, k if k < axis else k - 1, op)
  return None


def _split(w: _Walk, op, out, k):
  if op.type == "Split":
    axis_t, value = op.inputs
  else:
    value, _, axis_t = op.inputs
  axis = _static(axis_t)
  if axis is None or value.shape.rank is None:
    return _unknown(w, op, out, k)
  if axis % value.shape.rank == k:
    return "splits the examples into parts used apart"
  w.demand(value, k, op)
  return None


def _gather(w: _Walk, op, out, k):
  if op.type == "ResourceGather":
    params, indices, axis, batch_dims = None, op.inputs[1], 0, 0
  elif op.type == "Gather":
    params, indices, axis, batch_dims = op.inputs[0], op.inputs[1], 0, 0
  else:
    params, indices = op.inputs[0], op.inputs[1]
    axis = _static(op.inputs[2])
    batch_dims = op.get_attr("batch_dims")
  ri = indices.shape.rank
  if axis is None or ri is None or (
      params is not None and params.shape.rank is None):
    return _unknown(w, op, out, k)
  if params is not None:
    axis %= params.shape.rank
  if batch_dims and k < batch_dims:
    w.demand(indices, k, op)
    w.demand(params, k, op)
  elif k < axis:
    w.demand(params, k, op)
    w.demand(indices, SHARED, op)
  elif k < axis + ri - batch_dims:
    w.demand(indices, k - axis + batch_dims, op)
    if params is not None:
      w.demand(params, SHARED, op)
  else:
    w.demand(params, k - ri + 1 + batch_dims, op)
    w.demand(indices, SHARED, op)
  return None


def _last_axis(why: str):
  def rule(w: _Walk, op, out, k):
    rank = op.inputs[0].shape.rank
    if rank is None or k == rank - 1:
      return why
    for x in op.inputs:
      w.demand(x, k if x.shape.rank == rank else SHARED, op)
    return None
  return rule


def _rows(w: _Walk, op, out, k):
  """A per-row op (a cross-entropy of logits and labels): every input's
  rows are the output's."""
  for x in op.inputs:
    w.demand(x, k, op)
  return None


def _spatial(w: _Walk, op, out, k):
  """A spatial op on ``[B, ...]`` data and shared filters. A transposed
  convolution (``*BackpropInput``) reads its data third; its first input
  is the output's shape (``tf.stack([tf.shape(x)[0], h, w, c])``), which
  holds no example's values, so it is demanded nothing."""
  data_format = (op.get_attr("data_format").decode()
                 if "data_format" in op.node_def.attr else "NHWC")
  if k != 0 or not data_format.startswith("N"):
    return _unknown(w, op, out, k)
  data = 2 if op.type in _BACKPROP_INPUT else 0
  w.demand(op.inputs[data], 0, op)
  for i, x in enumerate(op.inputs):
    if i != data and not (data and i == 0):
      w.demand(x, SHARED, op)
  return None


def _batch_norm(w: _Walk, op, out, k):
  """Statistics per channel: examples on the channel axis are normalized
  apart (tf-keras' layer norm runs this way); on another axis in training
  mode, with the whole batch's."""
  data_format = op.get_attr("data_format").decode()
  channel = 1 if data_format.startswith("NC") else out.shape.rank - 1
  if k == channel:
    for x in op.inputs:
      w.demand(x, 0 if x.shape.rank == 1 else k, op)
    return None
  if op.get_attr("is_training"):
    return ("is batch normalization in training mode: it normalizes each "
            "example with the mean and variance of the whole batch (batch "
            "norm in inference mode keeps examples apart)")
  w.demand(op.inputs[0], k, op)
  for x in op.inputs[1:]:
    w.demand(x, SHARED, op)
  return None


def _tile(w: _Walk, op, out, k):
  multiples = _static(op.inputs[1])
  if multiples is None:
    return _unknown(w, op, out, k)
  if multiples[k] != 1:
    return "repeats the examples, so one example appears in several rows"
  w.demand(op.inputs[0], k, op)
  return None


def _pad(w: _Walk, op, out, k):
  w.demand(op.inputs[0], k, op)
  return None


def _strided_slice(w: _Walk, op, out, k):
  x = op.inputs[0]
  begin, end, strides = (_static(t) for t in op.inputs[1:4])
  masks = {m: op.get_attr(m) for m in (
      "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask",
      "shrink_axis_mask")}
  rank = x.shape.rank
  if (rank is None or begin is None or end is None or strides is None
      or masks["ellipsis_mask"] or masks["new_axis_mask"]):
    return _unknown(w, op, out, k)
  shrunk = masks["shrink_axis_mask"]
  kept = [a for a in range(rank) if not shrunk >> a & 1]
  j = kept[k]
  if j < len(begin):
    full = ((masks["begin_mask"] >> j & 1 or begin[j] == 0)
            and (masks["end_mask"] >> j & 1) and strides[j] == 1)
    if not full:
      return ("selects examples by position, so a row of the loss may "
              "hold another example")
  w.demand(x, j, op)
  return None


def _slice(w: _Walk, op, out, k):
  begin, size = _static(op.inputs[1]), _static(op.inputs[2])
  if begin is None or size is None:
    return _unknown(w, op, out, k)
  if begin[k] != 0 or size[k] != -1:
    return ("selects examples by position, so a row of the loss may hold "
            "another example")
  w.demand(op.inputs[0], k, op)
  return None


def _one_hot(w: _Walk, op, out, k):
  indices = op.inputs[0]
  axis = op.get_attr("axis")
  axis = out.shape.rank - 1 if axis == -1 else axis
  if k == axis:
    return _unknown(w, op, out, k)
  w.demand(indices, k if k < axis else k - 1, op)
  for x in op.inputs[1:]:
    w.demand(x, SHARED, op)
  return None


def _fill(w: _Walk, op, out, k):
  w.demand(op.inputs[1], SHARED, op)
  return None


def _unknown(w: _Walk, op, out, k) -> None:
  """An op without a rule: its inputs of the output's rank keep the axis,
  logged once per op type."""
  if op.type not in _warned:
    _warned.add(op.type)
    log.warning("privatize: no example-axis rule for %s ops (%r); assumed "
                "to keep each example's values apart.", op.type, op.name)
  for x in op.inputs:
    if x.shape.rank is not None and x.shape.rank == out.shape.rank:
      w.demand(x, k, op)
  return None


_RULES = {
    "MatMul": _matmul,
    "BatchMatMul": _batch_matmul, "BatchMatMulV2": _batch_matmul,
    "BatchMatMulV3": _batch_matmul,
    "Einsum": _einsum,
    "Transpose": _transpose,
    "Reshape": _reshape,
    "ExpandDims": _expand_dims,
    "Squeeze": _squeeze,
    "ConcatV2": _concat,
    "Pack": _pack,
    "Split": _split, "SplitV": _split,
    "GatherV2": _gather, "ResourceGather": _gather, "Gather": _gather,
    "Softmax": _last_axis("normalizes across examples (a softmax over the "
                          "example axis)"),
    "LogSoftmax": _last_axis("normalizes across examples (a log-softmax "
                             "over the example axis)"),
    "TopKV2": _last_axis("sorts or ranks the examples (top-k over the "
                         "example axis)"),
    "FusedBatchNorm": _batch_norm, "FusedBatchNormV2": _batch_norm,
    "FusedBatchNormV3": _batch_norm,
    "Tile": _tile,
    "Pad": _pad, "PadV2": _pad, "MirrorPad": _pad,
    "StridedSlice": _strided_slice,
    "Slice": _slice,
    "Fill": _fill,
    "OneHot": _one_hot,
    "SoftmaxCrossEntropyWithLogits": _rows,
    "SparseSoftmaxCrossEntropyWithLogits": _rows,
}


def refuse_mixing(loss: tf.Tensor) -> None:
  """Raises for the first op through which ``loss`` mixes examples.

  Raises:
    UnsupportedGraphError: naming the op, what it does and the fix.
  """
  found = mixing_ops(loss)
  if found:
    raise _errors.UnsupportedGraphError(found[0].message())
