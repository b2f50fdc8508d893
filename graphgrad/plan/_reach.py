"""Bounded reachability for the segment calls of the segmented backward pass.

``tf.gradients(ys, xs)`` first marks every op reachable forward from ``xs``,
then keeps the ops that also lie behind ``ys``. A segment's ``xs`` sit low in
the graph, so their forward cone holds every layer above them; one such walk
per segment makes the plan quadratic in depth, although each segment only
needs the ops between its ``xs`` and ``ys``. :func:`bounded` hands the walk,
for one call, the ops behind ``ys`` created no earlier than the oldest op of
``xs`` (:func:`behind`): TF builds the same gradient ops, in the same order
and with the same names. The bound rests on creation order being a
topological order, which a ``tf.compat.v1`` while loop breaks, so only graphs
without loops are bounded (:func:`can_bound`). The walk is a private TF
function (``graphgrad._compat``): when its self-test fails, TF's own walk is
kept, which builds the same graph more slowly.
"""

from typing import Iterable, Optional, Set

import tensorflow as tf

from graphgrad import _compat
from graphgrad.analysis import _graph_util

_LOOP_OPS = frozenset({"NextIteration", "RefNextIteration"})


def can_bound(forward_ops: Iterable[tf.Operation]) -> bool:
  """True when creation order is a topological order of ``forward_ops``."""
  if not _compat.usable("reached_walk"):  # the walk's self-test failed
    return False
  for op in forward_ops:
    if op.type in _LOOP_OPS:
      return False
    if any(_graph_util.op_id(t.op) > _graph_util.op_id(op) for t in op.inputs):
      return False
  return True


def behind(ys: Iterable[tf.Tensor], xs: Iterable) -> Set[tf.Operation]:
  """Ops that ``ys`` depend on, created no earlier than the oldest of ``xs``.

  ``xs`` holds tensors or variables (whose op is the variable's own).
  """
  floor = min(_graph_util.op_id(x.op) for x in xs)
  return _graph_util.ops_behind([y.op for y in ys], floor)


def bounded(allowed: Optional[Set[tf.Operation]]):
  """Within the block, this thread's ``tf.gradients`` walks only ``allowed``.

  Args:
    allowed: ops the forward walk may mark (see :func:`behind`); ``None``
      leaves the walk unbounded.

  Returns:
    A context manager.
  """
  return _compat.bounded_walk(allowed)
