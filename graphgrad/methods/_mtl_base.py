"""The task-combination value type of ``gg.mtl`` and its shared helpers.

A :class:`TaskMethod` turns ``k`` task gradients of one shape into one
gradient. Dot products, norms and the Gram matrix ``G = J J^T`` are taken over
the whole flattened tensor (batch included): ``J`` is the ``k x n`` matrix
whose rows are the flattened task gradients.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from graphgrad import _errors


class TaskMethod:
  """A multi-task gradient combination: ``k`` gradients in, one out.

  Subclasses implement :meth:`_combine` on the ``k x n`` matrix ``J``;
  stateful ones also override :meth:`create_state`.
  """

  name = "task_method"
  stateful = False
  # combine(S * J) == S * combine(J) for every S > 0: under a loss scale the
  # method may see loss-scaled task gradients (docs/concepts.md).
  homogeneous = False

  def create_state(self, k: int, name: str | None = None
                   ) -> tf.Module | None:
    """Creates the method's variables for one (plan, layer); ``None`` here.

    Args:
      k: the number of tasks.
      name: a name for the variables' scope.

    Returns:
      A ``tf.Module`` holding non-trainable ``tf.Variable`` s (saved by
      ``Saver`` and ``tf.train.Checkpoint``), or ``None`` for a stateless
      method.
    """
    del k, name
    return None

  def combine(self, grads: Sequence[tf.Tensor], state=None,
              name: str | None = None) -> tf.Tensor:
    """Combines ``k`` task gradients of one shape into one gradient.

    Args:
      grads: the task gradients, tensors of one shape and floating dtype
        (``IndexedSlices`` are densified; ``None`` counts as zero).
      state: what :meth:`create_state` returned, for a stateful method.
      name: name scope of the added ops.

    Returns:
      A tensor of the gradients' shape and dtype.

    Raises:
      GraphGradError: if ``grads`` is empty, mixes shapes or dtypes, or a
        stateful method gets no ``state``.
    """
    with tf.name_scope(name or self.name):
      dense = dense_grads(grads, self.name)
      mat = tf.stack([tf.reshape(g, [-1]) for g in dense])
      shape = tf.shape(dense[0])
      if self.stateful:
        if state is None:
          raise _errors.GraphGradError(
              f"{self.name}: `state` is required, since the method keeps "
              f"variables across steps; got None. Create it once per plan "
              f"and layer with state = method.create_state(k={mat.shape[0]}) "
              f"and pass combine(grads, state=state).")
        k = int(mat.shape[0])
        if getattr(state, "tasks", k) != k:
          raise _errors.GraphGradError(
              f"{self.name}: `state` was made for {state.tasks} tasks but "
              f"`grads` holds {k}. Make one state per plan and layer with "
              f"method.create_state(k={k}).")
        out = self._combine(mat, state)
      else:
        out = self._combine(mat)
      return tf.reshape(out, shape)

  def _combine(self, mat: tf.Tensor, state=None) -> tf.Tensor:
    raise NotImplementedError

  def _args(self) -> str:
    return ""

  def __repr__(self) -> str:
    return f"{self.name}({self._args()})"


class ForeignMethod(TaskMethod):
  """A task-combination method of the user's own, as a :class:`TaskMethod`.

  The protocol (docs/mtl_table.md) asks only for ``combine(grads)``, and
  ``create_state(k, name=None)`` for a method that keeps state, which then
  gets ``combine(grads, state=...)``. This reads those once, where the
  method is declared, and gives it the typed attributes of every method:
  stateful when it has ``create_state``, not homogeneous (nothing says
  ``combine(S J) == S combine(J)``).
  """

  def __init__(self, method: Any, combine, create_state):
    self.method, self._combine_fn, self._create = method, combine, create_state
    self.name = type(method).__name__
    self.stateful = create_state is not None

  def create_state(self, k: int, name: str | None = None):
    return None if self._create is None else self._create(k, name=name)

  def combine(self, grads, state=None, name=None):
    del name  # the method names its own ops
    return (self._combine_fn(grads) if state is None
            else self._combine_fn(grads, state=state))

  def __repr__(self) -> str:
    return repr(self.method)


def as_task_method(method: Any, caller: str = "combine_tasks") -> TaskMethod:
  """``method`` as a :class:`TaskMethod`: itself, or one of the user's own
  wrapped in a :class:`ForeignMethod`.

  Raises:
    GraphGradError: for a value without a callable ``combine``.
  """
  if isinstance(method, TaskMethod):
    return method
  combine = getattr(method, "combine", None)
  if not callable(combine):
    raise _errors.GraphGradError(
        f"{caller}: `method` must be a task-combination method with a "
        f"combine(grads) method, such as gg.mtl.pcgrad(); got "
        f"{type(method).__name__} {method!r}.")
  create = getattr(method, "create_state", None)
  return ForeignMethod(method, combine, create if callable(create) else None)


class GramMethod(TaskMethod):
  """A method whose output is ``w^T J`` with weights ``w`` from ``G``."""

  def _combine(self, mat, state=None):
    gram = tf.cast(tf.matmul(mat, mat, transpose_b=True), tf.float64)
    # The Gram's rounding is the gradients' (eps): rank decisions use it.
    w = self._weights(gram, state, eps=float(np.finfo(
        mat.dtype.as_numpy_dtype).eps))
    return tf.linalg.matvec(mat, tf.cast(w, mat.dtype), transpose_a=True)

  def _weights(self, gram: tf.Tensor, state=None, eps=None) -> tf.Tensor:
    raise NotImplementedError


class _Mean(GramMethod):
  name = "mean"
  homogeneous = True

  def _weights(self, gram, state=None, eps=None):
    k = tf.shape(gram)[0]
    return tf.ones([k], tf.float64) / tf.cast(k, tf.float64)


class _Sum(GramMethod):
  name = "sum"
  homogeneous = True

  def _weights(self, gram, state=None, eps=None):
    return tf.ones([tf.shape(gram)[0]], tf.float64)


def mean() -> TaskMethod:
  """The mean of the task gradients, ``(1/k) sum_i g_i``.

  Example:
    >>> import graphgrad as gg
    >>> g = [tf.constant([1., 0.]), tf.constant([0., 3.])]
    >>> gg.mtl.mean().combine(g).numpy()
    array([0.5, 1.5], dtype=float32)
  """
  return _Mean()


def sum() -> TaskMethod:
  """The sum of the task gradients, what plain backpropagation gives.

  Example:
    >>> import graphgrad as gg
    >>> g = [tf.constant([1., 0.]), tf.constant([0., 3.])]
    >>> gg.mtl.sum().combine(g).numpy()
    array([1., 3.], dtype=float32)
  """
  return _Sum()


def dense_grads(grads, method: str) -> list[tf.Tensor]:
  """The task gradients as dense tensors of one shape (zeros for ``None``)."""
  if isinstance(grads, (tf.Tensor, tf.IndexedSlices)) or not isinstance(
      grads, (list, tuple)):
    raise _errors.GraphGradError(
        f"{method}.combine: `grads` must be a list of task gradients; got "
        f"{type(grads).__name__}. Pass e.g. [g_a, g_b].")
  dense = [None if g is None else tf.convert_to_tensor(g) for g in grads]
  present = [g for g in dense if g is not None]
  if not present:
    raise _errors.GraphGradError(
        f"{method}.combine: `grads` must hold at least one gradient that is "
        f"not None; got {len(grads)} entries. Pass the task gradients at "
        f"one tensor.")
  like = present[0]
  for i, g in enumerate(dense):
    if g is None:
      continue
    if not g.dtype.is_floating or g.dtype != like.dtype or (
        g.shape.is_fully_defined() and like.shape.is_fully_defined()
        and g.shape != like.shape):
      raise _errors.GraphGradError(
          f"{method}.combine: `grads[{i}]` must be a floating-point tensor "
          f"of the shape and dtype of the first gradient ({like.shape}, "
          f"{like.dtype.name}); got {g.shape}, {g.dtype.name}. Pass the "
          f"task gradients at one tensor.")
  return [tf.zeros_like(like) if g is None else g for g in dense]


def check_number(factory: str, arg: str, value, low=None, high=None,
                 integer=False, low_open=False) -> Any:
  """Validates a hyperparameter at factory call; returns it (int or float)."""
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  if ok and integer:
    ok = float(value) == int(value)
  if ok and low is not None:
    ok = value > low if low_open else value >= low
  if ok and high is not None:
    ok = value <= high
  if not ok:
    kind = "an integer" if integer else "a number"
    bounds = []
    if low is not None:
      bounds.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
      bounds.append(f"<= {high}")
    example = low if low is not None and not low_open else 1
    raise _errors.GraphGradError(
        f"{factory}: `{arg}` must be {kind} {' and '.join(bounds)}; got "
        f"{value!r}. Pass e.g. {arg}={example}.")
  return int(value) if integer else float(value)


def check_pref(factory: str, pref_vector) -> list[float] | None:
  """Validates an optional preference vector (a list of numbers)."""
  if pref_vector is None:
    return None
  try:
    values = [float(v) for v in pref_vector]
  except (TypeError, ValueError):
    values = None
  if not values:
    raise _errors.GraphGradError(
        f"{factory}: `pref_vector` must be None or a non-empty list of "
        f"numbers, one per task; got {pref_vector!r}. Pass e.g. "
        f"pref_vector=[0.5, 0.5].")
  return values


def pref_weights(method: str, pref: list[float] | None, k: int,
                 default: float) -> tf.Tensor:
  """The preference weights ``u``: ``pref`` or ``default`` for each task."""
  if pref is None:
    return tf.fill([k], tf.constant(default, tf.float64))
  if len(pref) != k:
    raise _errors.GraphGradError(
        f"{method}.combine: `pref_vector` has {len(pref)} entries but "
        f"`grads` holds {k} task gradients. Give one preference per task.")
  return tf.constant(pref, tf.float64)


def static_k(mat: tf.Tensor) -> int:
  """The task count ``k``, static since ``grads`` is a Python list."""
  return int(mat.shape[0])
