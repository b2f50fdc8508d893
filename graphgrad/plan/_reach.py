"""Bounded reachability for the segment calls of the segmented backward pass.

``tf.gradients(ys, xs)`` first marks every op reachable *forward* from
``xs`` (``_MarkReachedOps`` in TF's ``gradients_util``), then keeps the ops
that also lie *behind* ``ys``. A segment's ``xs`` sit low in the graph: their
forward cone is every layer above them up to the loss, plus the backward ops
that earlier segments built from those layers' activations. One such walk per
segment makes the whole plan quadratic in depth (on a 128-layer MLP with
every boundary transformed it was 80% of the build time), although each
segment only needs the few ops between its ``xs`` and ``ys``.

:func:`bounded` hands the walk, for one call, the set of ops behind ``ys``
that were created no earlier than the oldest op of ``xs`` (:func:`behind`).
Forward-reachable ops outside that set are never "between" ``xs`` and
``ys``, so TF builds exactly the same gradient ops, in the same order and
with the same names; only the walk is shorter.

The bound rests on TF's creation order being a topological order of the
forward graph, which a ``tf.compat.v1`` while loop breaks (its
``NextIteration`` feeds a ``Merge`` created earlier): the engine only bounds
graphs without loops (:func:`can_bound`). Any other call to ``tf.gradients``,
from another thread or outside :func:`bounded`, walks as usual.
"""

import collections
import contextlib
import threading
from typing import Iterable, Optional, Set

import tensorflow as tf
from tensorflow.python.ops import gradients_util  # pylint: disable=g-direct-tensorflow-import

_ORIGINAL = getattr(gradients_util, "_MarkReachedOps", None)
_is_trainable = gradients_util.backprop_util.IsTrainable
_LOCAL = threading.local()
_LOOP_OPS = frozenset({"NextIteration", "RefNextIteration"})


def _mark_reached_ops(from_ops, reached_ops, func_graphs):
  allowed = getattr(_LOCAL, "allowed", None)
  if allowed is None or func_graphs:
    return _ORIGINAL(from_ops, reached_ops, func_graphs)
  # TF's walk, restricted to ``allowed`` (``from_ops`` are always marked).
  queue = collections.deque(from_ops)
  while queue:
    op = queue.popleft()
    if op not in reached_ops:
      reached_ops.add(op)
      for output in op.outputs:
        if _is_trainable(output):
          queue.extend(c for c in output.consumers() if c in allowed)
  return None


def available() -> bool:
  """True when this TensorFlow has the walk that :func:`bounded` shortens."""
  return _ORIGINAL is not None and hasattr(gradients_util, "_PendingCount")


def can_bound(forward_ops: Iterable[tf.Operation]) -> bool:
  """True when creation order is a topological order of ``forward_ops``."""
  if not available():
    return False
  for op in forward_ops:
    if op.type in _LOOP_OPS:
      return False
    if any(t.op._id > op._id for t in op.inputs):  # pylint: disable=protected-access
      return False
  return True


def behind(ys: Iterable[tf.Tensor], xs: Iterable) -> Set[tf.Operation]:
  """Ops that ``ys`` depend on, created no earlier than the oldest of ``xs``.

  ``xs`` holds tensors or variables (whose op is the variable's own).
  """
  floor = min(x.op._id for x in xs)  # pylint: disable=protected-access
  seen: Set[tf.Operation] = set()
  stack = [y.op for y in ys]
  while stack:
    op = stack.pop()
    if op in seen or op._id < floor:  # pylint: disable=protected-access
      continue
    seen.add(op)
    stack.extend(t.op for t in op.inputs)
  return seen


@contextlib.contextmanager
def bounded(allowed: Optional[Set[tf.Operation]]):
  """Within the block, this thread's ``tf.gradients`` walks only ``allowed``.

  Args:
    allowed: ops the forward walk may mark (see :func:`behind`); ``None``
      leaves the walk unbounded.

  Yields:
    Nothing.
  """
  if allowed is None or not available():
    yield
    return
  if gradients_util._MarkReachedOps is not _mark_reached_ops:  # pylint: disable=protected-access
    gradients_util._MarkReachedOps = _mark_reached_ops  # pylint: disable=protected-access
  previous = getattr(_LOCAL, "allowed", None)
  _LOCAL.allowed = allowed
  try:
    yield
  finally:
    _LOCAL.allowed = previous
