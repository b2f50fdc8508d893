"""DP-SGD on a ``tf.Graph``: where the plan's variables meet the examples.

:class:`GraphUses` is the TF1 plan's :class:`~graphgrad.core._privacy.Uses`:
for each variable, the ops that consume it on the way to the loss (through
its read, ``Identity`` and ``Cast``) and the form of each
(:mod:`graphgrad.core._forms`), by the rule :data:`RULES` registers for
the op's type: a dense op (``MatMul``, ``BatchMatMulV2``, a two-operand
``Einsum``, a ``MatMul`` on a sequence reshaped to 2-D), ``Conv2D``, an
embedding lookup (``ResourceGather``, ``GatherV2``), a broadcast
elementwise op (``BiasAdd``, ``Add``, ``Mul``...). A variable whose uses
have no rule gets
the exact per-example gradient of those ops only (the VJP's
``per_example``), logged once. The algorithm is
:func:`graphgrad.core._privacy.private_gradients`.
"""

import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.analysis import _graph_util
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
from graphgrad.plan._backprop import GraphVJP

log = logging.getLogger("graphgrad")

_PASS = ("Identity", "Cast", "ReadVariableOp")
_LOOPS = ("While", "StatelessWhile", "Enter", "If", "StatelessIf",
          "PartitionedCall", "StatefulPartitionedCall")
_warned: set = set()

# One use of a variable: the consuming op and the index of the input that
# carries the variable.
Use = Tuple[tf.Operation, int]


class GraphUses:
  """Where the plan's variables meet the examples in a ``tf.Graph``.

  The :class:`~graphgrad.core._privacy.Uses` of a ``GradientPlan``: for
  each variable, the ops on the loss path that consume it (through its
  read, ``Identity`` and ``Cast``), and the form of each
  (:func:`_form`), or the variable's exact per-example gradient through
  those ops by the plan's VJP where one has none.

  Args:
    loss: the vector of per-example losses ``[B]``.
    var_list: the plan's variables.
    vjp: the plan's VJP (with its overrides; recomputing under
      ``plan.recompute``), for the exact fallback.
  """

  def __init__(self, loss: tf.Tensor, var_list: Sequence[tf.Variable],
               vjp: GraphVJP):
    self.loss, self.var_list, self._vjp = loss, list(var_list), vjp
    self._on_path = {op.name for op in _graph_util.forward_ops(loss)}
    self._uses = {v.op.name: self._find(v) for v in self.var_list}
    self._outputs = sorted({t for us in self._uses.values() for op, _ in us
                            for t in op.outputs if t.dtype.is_floating},
                           key=lambda t: t.name)

  def outputs(self) -> List[tf.Tensor]:
    return list(self._outputs)

  def forms(self, grads: Sequence[Gradient], batch) -> Dict[str, list]:
    by_output = dict(zip(self._outputs, grads))
    forms = {}
    for v in self.var_list:
      used = [(op, i) for op, i in self._uses[v.op.name]
              if any(by_output.get(y) is not None for y in op.outputs)]
      if used:
        forms[v.op.name] = self._var_forms(v, used, by_output, batch)
    if not forms:
      raise _errors.NotConnectedError(
          f"privatize: no variable of the plan reaches the loss "
          f"{self.loss.name}; variables: "
          f"{', '.join(v.name for v in self.var_list)}.")
    return forms

  def key(self, variable) -> str:
    return variable.op.name

  def refuse_outside(self, variable) -> None:
    raise _errors.UnsupportedGraphError(
        f"privatize: the variable {variable.name} reaches the loss "
        f"{self.loss.name} other than through an op that consumes it on the "
        f"loss path, so its per-example gradient is unknown.")

  # -- the boundary tensors ------------------------------------------------

  def _find(self, var: tf.Variable) -> List[Use]:
    """The ops on the loss path that consume ``var`` (or its reads)."""
    found: List[Use] = []
    stack = [var.op.outputs[0]]
    seen = set()
    while stack:
      t = stack.pop()
      for op in t.consumers():
        if op.name in seen or op.name not in self._on_path:
          continue
        seen.add(op.name)
        if op.type in _PASS:
          stack.extend(op.outputs)
        elif op.type in _LOOPS:
          # tf.compat.v1.nn.dynamic_rnn (and raw_rnn, bidirectional_...)
          # loop over time in a while op; static_rnn unrolls the same cell.
          rnn = (" (for tf.compat.v1.nn.dynamic_rnn: "
                 "tf.compat.v1.nn.static_rnn(cell, tf.unstack(x, axis=1)) "
                 "runs the same cell unrolled)"
                 if "While" in op.type else "")
          raise _errors.UnsupportedGraphError(
              f"privatize: the variable {var.name} is read inside the "
              f"{op.type} op {op.name} (a tf.while_loop, tf.cond or "
              f"function), where no per-example gradient can be taken. "
              f"Unroll the loop with a Python for loop{rnn} (each step then "
              f"is an op on the batch), or train without privatize.")
        else:
          found += [(op, i) for i, x in enumerate(op.inputs) if x is t]
    return found

  def _var_forms(self, var, uses: List[Use], grads, batch) -> list:
    """The forms of ``var``'s uses, or its exact per-example gradients."""
    with tf.name_scope(var.op.name.replace(":", "_") + "_uses"):
      dtype = norm_dtype(var.dtype)
      forms = [_form(op, i, grads.get(op.outputs[0]), batch, dtype)
               for op, i in uses]
      if all(f is not None for f in forms):
        return forms
      return [PerExampleForm(self._fallback(var, uses, grads, batch, dtype))]

  def _fallback(self, var, uses: List[Use], grads, batch, dtype
                ) -> tf.Tensor:
    """``[B, *var.shape]``: exact per-example gradients of ``var`` through
    its uses only."""
    kinds = sorted({op.type for op, _ in uses})
    key = (var.op.name, tuple(kinds))
    if key not in _warned:
      _warned.add(key)
      log.warning("privatize: no norm rule for the uses of %s (%s); its "
                  "per-example gradients are computed one example at a "
                  "time through those ops only.", var.name, ", ".join(kinds))
    ys, gs = [], []
    for op, _ in uses:
      for y in op.outputs:
        g = grads.get(y)
        if g is None:
          continue
        if y.shape.rank is None or y.shape.rank < 1:
          raise _errors.UnsupportedGraphError(
              f"privatize: the variable {var.name} reaches the loss through "
              f"{op.type} op {op.name}, whose output {y.name} has no batch "
              f"dimension (shape {y.shape}): its share of the loss is not "
              f"per example (a weight penalty added to the loss?). Apply "
              f"weight decay in the optimizer or with "
              f"transform_gradients, and keep the loss per example.")
        ys.append(y)
        gs.append(tf.convert_to_tensor(g))
    xs = list({id(x): x for op, i in uses for x in [op.inputs[i]]}.values())
    parts = [tf.cast(p, dtype) for p in
             self._vjp.per_example(ys, xs, gs, batch) if p is not None]
    return tf.reshape(tf.add_n(parts), [-1] + var.shape.as_list())


# -- the rules: a form per use, registered by op type --------------------------


def _batch_rows(x: tf.Tensor, batch, of: Optional[tf.Tensor] = None
                ) -> tf.Tensor:
  """``x`` after checking that the leading axis of ``of`` (``x`` by
  default) is the batch (``core._forms.examples_first``)."""
  of = x if of is None else of
  return after(examples_first(of, batch, of.name), x)


# Ops whose output rows are their inputs' rows, in place (unary and
# elementwise ops; MatMul's first operand is followed by name).
_ROWWISE = frozenset({
    "Identity", "Cast", "StopGradient", "Relu", "Relu6", "Elu", "Selu",
    "LeakyRelu", "Tanh", "Sigmoid", "Softplus", "Softsign", "Erf", "Exp",
    "Log", "Sqrt", "Rsqrt", "Square", "Neg", "Abs", "Softmax", "LogSoftmax",
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "BiasAdd", "SquaredDifference",
    "Maximum", "Minimum", "Pow"})


def _merged_rows(t: tf.Tensor) -> Optional[tf.Tensor]:
  """The tensor ``[B, T, ..., d]`` whose leading axes a ``Reshape`` merged
  into the rows of ``t`` (``[B*T..., d]``), found through ops that keep
  rows in place (:data:`_ROWWISE`, a ``MatMul``'s first operand); ``None``
  when ``t``'s rows come from no such merge. A row-major reshape keeps
  each example's rows together, so ``t``'s rows are then the examples'
  in order (BERT's TF1 code computes its layers on such rows)."""
  for _ in range(100000):  # a bound, never reached by a real graph
    op = t.op
    if op.type == "Reshape":
      src = op.inputs[0]
      if (t.shape.rank == 2 and src.shape.rank is not None
          and src.shape.rank >= 3 and src.shape[-1] == t.shape[-1]):
        return src
      return None
    if op.type == "MatMul" and not op.get_attr("transpose_a"):
      t = op.inputs[0]
    elif op.type in _ROWWISE:
      same = [x for x in op.inputs
              if x.dtype.is_floating and x.shape.rank == t.shape.rank]
      if not same:
        return None
      t = same[0]
    else:
      return None
  return None


def _form(op: tf.Operation, index: int, g, batch, dtype) -> Optional[Form]:
  """The form of one use (``op``'s input ``index`` carries the variable)
  by the rule registered for ``op``'s type (:data:`RULES`); ``None`` where
  none applies."""
  rule = RULES.get(op.type)
  if g is None or rule is None:
    return None
  if isinstance(g, tf.IndexedSlices):
    g = tf.convert_to_tensor(g)
  return rule(op, index, g, batch, dtype)


def _matmul(op, index, g, batch, dtype):
  """``MatMul`` of the examples' rows (maybe a sequence reshaped to 2-D)
  by the variable."""
  if index != 1 or op.get_attr("transpose_a") or op.get_attr("transpose_b"):
    return None
  a = op.inputs[0]
  # Rows [B*T, p] of a sequence: checked at their source [B, T, ...].
  a = _batch_rows(a, batch, of=_merged_rows(a))
  return DenseForm(rows(a, batch, dtype), rows(g, batch, dtype))


def _batch_matmul(op, index, g, batch, dtype):
  if (index != 1 or op.inputs[1].shape.rank != 2 or op.get_attr("adj_x")
      or op.get_attr("adj_y")):
    return None
  return DenseForm(rows(_batch_rows(op.inputs[0], batch), batch, dtype),
                   rows(g, batch, dtype))


def _einsum(op, index, g, batch, dtype):
  """A two-operand einsum that is a dense op on trailing axes
  (:func:`~graphgrad.core._forms.einsum_dense`)."""
  if index != 1 or len(op.inputs) != 2:
    return None
  return einsum_dense(op.get_attr("equation").decode(),
                      _batch_rows(op.inputs[0], batch), g,
                      op.inputs[1].shape, batch, dtype)


def _conv2d(op, index, g, batch, dtype):
  del dtype  # the form casts where it reads
  if (index != 1 or op.get_attr("data_format") != b"NHWC"
      or op.get_attr("padding") not in (b"SAME", b"VALID")
      or any(d != 1 for d in op.get_attr("dilations"))):
    return None
  x, w = op.inputs
  if not w.shape.is_fully_defined():
    return None
  return Conv2DForm(x, g, w.shape.as_list(), op.get_attr("strides"),
                    op.get_attr("padding").decode())


def _gather(op, index, g, batch, dtype):
  """A lookup of rows of the variable at the examples' ids."""
  if (index != 0 or op.get_attr("batch_dims") != 0
      or (op.type == "GatherV2" and tf.get_static_value(op.inputs[2]) != 0)):
    return None
  ids = tf.reshape(tf.cast(op.inputs[1], tf.int64), [batch, -1])
  return EmbeddingForm(ids, rows(g, batch, dtype))


def _elementwise(op, index, g, batch, dtype):
  """The per-example gradient of a variable broadcast into ``op``."""
  if op.type == "BiasAdd" and op.get_attr("data_format") != b"NHWC":
    return None
  p = tf.cast(g, dtype)  # a loss-scaled float16 product could overflow
  if op.type == "Mul":
    p = p * tf.cast(op.inputs[1 - index], dtype)
  elif op.type == "Sub" and index == 1:
    p = -p
  merged = (_merged_rows(op.inputs[1 - index]) if len(op.inputs) == 2
            else None)
  if merged is not None:  # rows [B*T, ...] of a sequence: [B, T, ...]
    p = tf.reshape(_batch_rows(p, batch, of=merged), tf.concat(
        [tf.stack([batch, -1]), tf.shape(p)[1:]], 0))
  out = broadcast_per_example(p, op.inputs[index].shape, batch)
  return None if out is None else PerExampleForm(out)


# The form of a use by the consuming op's type: ``rule(op, index, g, batch,
# dtype)``, with ``g`` the gradient at the op's output and ``dtype`` the
# norms'; ``None`` where the rule does not apply (the exact fallback then).
RULES: Dict[str, Callable[..., Optional[Form]]] = {
    "MatMul": _matmul,
    "BatchMatMulV2": _batch_matmul,
    "BatchMatMulV3": _batch_matmul,
    "Einsum": _einsum,
    "Conv2D": _conv2d,
    "ResourceGather": _gather,
    "GatherV2": _gather,
    **{t: _elementwise for t in ("BiasAdd", "Add", "AddV2", "Sub", "Mul")},
}
