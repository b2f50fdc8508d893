"""Ops on a tensor's backward path that have no registered gradient.

``tf.gradients`` looks up a gradient function for every op that lies between
the differentiated variables and the tensor along floating-point (or
resource, or variant) tensors, and stops with ``LookupError: No gradient
defined for operation ...`` at the first op it finds none for: a custom op,
or a ``CustomGradient-NNNN`` op of a graph imported into a process that never
registered that function. :func:`ops_without_gradient` finds all of them at
once, without building any op, so that an error can list every one.
"""

from typing import Iterable, List, Optional, Sequence, Set

import tensorflow as tf

from graphgrad import _compat
from graphgrad.analysis import _graph_util


def backpropagatable(t: tf.Tensor) -> bool:
  """True for the tensors ``tf.gradients`` sends gradients along."""
  dtype = t.dtype.base_dtype
  return (dtype.is_floating or dtype.is_complex
          or dtype in (tf.resource, tf.variant))


def ops_on_path(tensor, sources: Optional[Iterable] = None,
                stops: Sequence[tf.Tensor] = (),
                floor: int = -1) -> List[tf.Operation]:
  """Ops between ``sources`` and ``tensor`` along backpropagatable tensors.

  Args:
    tensor: the tensor differentiated (a loss, an output), or a list.
    sources: variables or tensors differentiated against; defaults to the
      graph's trainable variables.
    stops: tensors the backward walk does not cross (``stop_gradients``).
    floor: ops created before the op with this id are not walked: an op
      between ``sources`` and ``tensor`` is created after one of the sources,
      so the oldest source's id bounds the walk (outside while loops, whose
      ``Merge`` is created before the ``NextIteration`` that feeds it).

  Returns:
    The ops, in graph order.
  """
  tensors = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
  if sources is None:
    sources = _graph_util.trainable_variables(tensors[0].graph)
  stop_names = {t.name for t in stops}
  behind = _graph_util.ops_behind(
      [t.op for t in tensors], floor,
      lambda t: t.name not in stop_names and backpropagatable(t))
  reached: Set[tf.Operation] = set()
  # A source tensor may be a stop itself (a cut the caller differentiates
  # against): the path starts at its consumers.
  stack = [c for s in sources
           for t in (s.op.outputs if isinstance(s, tf.Variable) else [s])
           for c in t.consumers() if c in behind]
  stack += [s.op for s in sources if isinstance(s, tf.Variable)
            and s.op in behind]
  while stack:
    op = stack.pop()
    if op in reached:
      continue
    reached.add(op)
    for t in op.outputs:
      if backpropagatable(t):
        stack.extend(c for c in t.consumers() if c in behind)
  return sorted(reached, key=_graph_util.op_id)


def has_gradient(op: tf.Operation) -> bool:
  """False when ``tf.gradients`` would raise LookupError on ``op``."""
  return _compat.has_gradient_function(op)


def ops_without_gradient(tensor: tf.Tensor, sources: Optional[Iterable] = None,
                         stops: Sequence[tf.Tensor] = ()
                         ) -> List[tf.Operation]:
  """The ops on ``tensor``'s backward path that have no gradient function.

  Args:
    tensor: the tensor to differentiate (a loss, or a model output).
    sources: variables or tensors to differentiate against; defaults to the
      graph's trainable variables.
    stops: tensors the backward pass does not cross.

  Returns:
    Every op ``tf.gradients(tensor, sources)`` would stop at with a
    ``LookupError``, in graph order; ``[]`` when the path is differentiable.

  Example:
    >>> import tensorflow as tf
    >>> with tf.Graph().as_default() as g:
    ...   w = tf.compat.v1.get_variable("w", initializer=[1.0, 2.0])
    ...   with g.gradient_override_map({"Identity": "NoSuchGradient"}):
    ...     q = tf.identity(w * 2.0, name="quantize")
    ...   print([op.name for op in ops_without_gradient(tf.reduce_sum(q))])
    ['quantize']
  """
  return [op for op in ops_on_path(tensor, sources, stops)
          if op.inputs and not has_gradient(op)]


# Ops whose registered gradient is None or zero: everything below them gets
# nothing through them. Quantizers are built from these.
ZERO_GRADIENT_TYPES = frozenset({"Round", "Rint", "Floor", "Ceil", "Sign"})


def ops_with_zero_gradient(tensor: tf.Tensor,
                           sources: Optional[Iterable] = None
                           ) -> List[tf.Operation]:
  """The ops on ``tensor``'s backward path whose gradient is None or zero.

  ``Round``, ``Rint``, ``Floor``, ``Ceil`` and ``Sign``: ``tf.gradients``
  raises nothing at them, but sends nothing below them either.

  Example:
    >>> import tensorflow as tf
    >>> with tf.Graph().as_default():
    ...   w = tf.compat.v1.get_variable("w", initializer=[0.4, 1.6])
    ...   y = tf.reduce_sum(tf.round(w * 255.0) * w)
    ...   print([op.type for op in ops_with_zero_gradient(y)])
    ['Round']
  """
  return [op for op in ops_on_path(tensor, sources)
          if op.type in ZERO_GRADIENT_TYPES]
