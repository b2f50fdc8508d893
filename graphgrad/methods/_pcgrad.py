"""PCGrad (Yu et al., 2020): task gradients projected off their conflicts.

:func:`project` is the projection of per-task gradients at several tensors;
:class:`PCGrad`, made by :func:`pcgrad`, is the task-combination method that
``plan.combine_tasks`` and ``plan.project_conflicts`` apply (the combination
machinery both executors share is ``core._task_combination``'s).

Example:
  >>> import tensorflow as tf
  >>> out = pcgrad().combine([tf.constant([1.0, 0.0]),
  ...                         tf.constant([-1.0, 1.0])])
  >>> out.numpy().tolist()  # each projected off the other, then summed
  [0.5, 1.5]
"""

from typing import List, Optional, Sequence

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.methods._mtl_base import TaskMethod, dense_grads


def _dot(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> tf.Tensor:
  return tf.add_n([tf.reduce_sum(x * y) for x, y in zip(a, b)])


def project(per_loss: Sequence[Sequence[Gradient]],
            like: Sequence[tf.Tensor], shuffle: bool = False,
            seed: Optional[int] = None) -> List[Gradient]:
  """PCGrad of per-loss gradients, summed over losses.

  Each task gradient ``g_i`` is the list of its gradients at the tensors
  ``like`` (``None``: the loss does not reach that tensor, taken as zero).
  For every ``i``, ``g_i^PC`` starts at ``g_i``; for every other ``j``, in
  list order or in a random order drawn anew at each step (``shuffle``),

      if g_i^PC . g_j < 0:  g_i^PC <- g_i^PC - (g_i^PC . g_j) / ||g_j||^2 g_j,

  with dot products over all tensors and elements. The result is
  ``sum_i g_i^PC``. A loss whose gradient is ``None`` at every tensor is left
  out: it neither projects nor is projected. A tensor that no loss reaches
  gets ``None``.

  Args:
    per_loss: one list of gradients per loss, aligned with ``like``.
    like: the forward tensors the gradients belong to (a missing gradient
      is the zeros of its tensor).
    shuffle: draw the order of the other tasks at random for each task.
    seed: op-level seed of the shuffles.

  Returns:
    One gradient per tensor of ``like``.
  """
  active = [i for i, gs in enumerate(per_loss)
            if any(g is not None for g in gs)]
  reached = [any(per_loss[i][t] is not None for i in active)
             for t in range(len(like))]
  dense = {i: [tf.convert_to_tensor(g) if g is not None else tf.zeros_like(x)
               for g, x in zip(per_loss[i], like)] for i in active}
  sq = {i: _dot(dense[i], dense[i]) for i in active}
  total = None
  for n, i in enumerate(active):
    g = list(dense[i])
    others = [j for j in active if j != i]
    if shuffle and len(others) > 1:
      stacks = [tf.stack([dense[j][t] for j in others])
                for t in range(len(like))]
      sq_stack = tf.stack([sq[j] for j in others])
      order = tf.random.shuffle(
          tf.range(len(others)),
          seed=None if seed is None else seed + n, name=f"order_{i}")
      steps = [([tf.gather(s, order[p]) for s in stacks],
                tf.gather(sq_stack, order[p])) for p in range(len(others))]
    else:
      steps = [(dense[j], sq[j]) for j in others]
    for g_j, sq_j in steps:
      d = _dot(g, g_j)
      coef = tf.where(d < 0, tf.math.divide_no_nan(d, sq_j), tf.zeros_like(d))
      g = [a - tf.cast(coef, a.dtype) * b for a, b in zip(g, g_j)]
    total = g if total is None else [a + b for a, b in zip(total, g)]
  if total is None:
    return [None] * len(like)
  return [t if r else None for t, r in zip(total, reached)]


class PCGrad(TaskMethod):
  """PCGrad as a task-combination method (see :func:`pcgrad`)."""

  name = "pcgrad"
  homogeneous = True

  def __init__(self, shuffle: bool = False, seed: Optional[int] = None):
    self.shuffle, self.seed = shuffle, seed

  def combine(self, grads, state=None, name=None):
    """:func:`project` on the gradients in their own shape."""
    del state  # stateless
    with tf.name_scope(name or self.name):
      dense = dense_grads(grads, self.name)
      return project([[g] for g in dense], [dense[0]], self.shuffle,
                     self.seed)[0]

  def _args(self) -> str:
    return f"shuffle={self.shuffle!r}, seed={self.seed!r}"


def pcgrad(shuffle: bool = False, seed: Optional[int] = None) -> PCGrad:
  """PCGrad (Yu et al., 2020, "Gradient Surgery for Multi-Task Learning").

  For every task ``i``, ``g_i^PC`` starts at ``g_i``; for every other task
  ``j`` (in list order, or in a random order drawn at each step with
  ``shuffle``), when ``g_i^PC . g_j < 0``, ``g_i^PC <- g_i^PC - (g_i^PC .
  g_j) / ||g_j||^2 g_j`` (the original ``g_j``), with dot products over the
  whole flattened tensor. ``combine`` returns ``sum_i g_i^PC``: the paper's
  Algorithm 1. The authors' ``PCGrad_tf.py`` takes the tasks in list order
  (its ``tf.random.shuffle`` result is unused), as the default here; its
  loop also visits ``j = i``, which the paper leaves out and this does too.
  With ``plan.combine_tasks(None, losses, pcgrad(), at="parameters")`` it
  is the authors' optimizer; ``plan.project_conflicts`` applies it at a
  layer's outputs instead. TorchJD's ``PCGrad`` draws a random order, as
  ``shuffle=True`` does.

  Args:
    shuffle: take the other tasks in a random order, drawn at each step
      (with two tasks the order does not matter). ``False`` by default, as
      the authors' code.
    seed: op-level seed of the shuffles.

  Returns:
    A task-combination method for ``plan.combine_tasks``.

  Raises:
    GraphGradError: if ``shuffle`` is not a bool.

  Example:
    >>> import graphgrad as gg
    >>> gg.mtl.pcgrad()
    pcgrad(shuffle=False, seed=None)
    >>> g = [tf.constant([1., 0.]), tf.constant([-1., 1.])]
    >>> gg.mtl.pcgrad().combine(g).numpy()
    array([0.5, 1.5], dtype=float32)
  """
  if not isinstance(shuffle, bool):
    raise _errors.GraphGradError(
        f"pcgrad: `shuffle` must be True or False; got {shuffle!r}.")
  return PCGrad(shuffle, seed)
