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

``_MarkReachedOps`` is private: when a TensorFlow release drops it or
changes its signature (:func:`graphgrad._compat.mark_reached_ops`), the
engine keeps TensorFlow's own walk, which builds the same graph, and logs
that once.
"""

import collections
import contextlib
from typing import Iterable, Optional, Set

import tensorflow as tf

from graphgrad import _compat
from graphgrad.analysis import _graph_util

try:
  from tensorflow.python.ops import gradients_util  # pylint: disable=g-direct-tensorflow-import
except ImportError:  # a TensorFlow that moved it: keep TF's walk
  gradients_util = None

_AT_IMPORT = getattr(gradients_util, "_MarkReachedOps", None)
# TF's walk and IsTrainable, looked up on first use; (None, None) when this
# TensorFlow lacks them.
_RESOLVED: Optional[tuple] = None


def _tf_walk():
  global _RESOLVED
  if _RESOLVED is None:
    fn = getattr(gradients_util, "_MarkReachedOps", None)
    if fn is _mark_reached_ops:  # replaced by bounded(): the one it replaced
      fn = _AT_IMPORT
    fn = _compat.mark_reached_ops(fn, gradients_util)
    util = getattr(gradients_util, "backprop_util", None)
    trainable = getattr(util, "IsTrainable", None)
    if fn is not None and not callable(trainable):
      _compat.warn_fallback("backprop_util.IsTrainable",
                            "TensorFlow's unbounded walk")
    _RESOLVED = (fn, trainable) if callable(trainable) else (None, None)
  return _RESOLVED


_LOOP_OPS = frozenset({"NextIteration", "RefNextIteration"})


def _mark_reached_ops(from_ops, reached_ops, func_graphs):
  original, is_trainable = _tf_walk()
  allowed = _PATCH.value()
  if allowed is None or func_graphs:
    return original(from_ops, reached_ops, func_graphs)
  # TF's walk, restricted to ``allowed`` (``from_ops`` are always marked).
  queue = collections.deque(from_ops)
  while queue:
    op = queue.popleft()
    if op not in reached_ops:
      reached_ops.add(op)
      for output in op.outputs:
        if is_trainable(output):
          queue.extend(c for c in output.consumers() if c in allowed)
  return None


# Installed by bounded(); bounds the walk of this thread's calls only.
_PATCH = _compat.ThreadPatch("_MarkReachedOps", _mark_reached_ops)


def available() -> bool:
  """True when this TensorFlow has the walk that :func:`bounded` shortens."""
  return _tf_walk()[0] is not None


def can_bound(forward_ops: Iterable[tf.Operation]) -> bool:
  """True when creation order is a topological order of ``forward_ops``."""
  if not available():
    return False
  for op in forward_ops:
    if op.type in _LOOP_OPS:
      return False
    if any(_compat.op_id(t.op) > _compat.op_id(op) for t in op.inputs):
      return False
  return True


def behind(ys: Iterable[tf.Tensor], xs: Iterable) -> Set[tf.Operation]:
  """Ops that ``ys`` depend on, created no earlier than the oldest of ``xs``.

  ``xs`` holds tensors or variables (whose op is the variable's own).
  """
  floor = min(_compat.op_id(x.op) for x in xs)
  return _graph_util.ops_behind([y.op for y in ys], floor)


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
  with _PATCH.active(gradients_util, allowed):
    yield
