"""Task combination at a shared layer's outputs, and PCGrad.

``plan.combine_tasks(layer, losses, method)`` rewrites the gradient ``g`` at
a shared layer's outputs ``T`` from the per-task gradients
``g_i = dL/dL_i * dL_i/dT``:

    g  <-  g - sum_i g_i + method.combine([g_1, ..., g_n]).

The task-combination contract: ``method.combine(grads)`` takes one list per
task, each holding one gradient per output tensor (``None`` where the task
does not reach the tensor), and returns one combined gradient per tensor
(``None`` where no task reaches it). :class:`PCGrad` is one such method:
gradient surgery (Yu et al., 2020, "Gradient Surgery for Multi-Task
Learning"); ``plan.project_conflicts(layer, losses)`` is
``combine_tasks(layer, losses, pcgrad())``.

Example:
  >>> import tensorflow as tf
  >>> out = pcgrad().combine([[tf.constant([1.0, 0.0])],
  ...                         [tf.constant([-1.0, 1.0])]])
  >>> out[0].numpy().tolist()  # each projected off the other, then summed
  [0.5, 1.5]
"""

from typing import Any, List, Optional, Sequence

import networkx as nx
import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.analysis._layers import LayerGraph


def _dot(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> tf.Tensor:
  return tf.add_n([tf.reduce_sum(x * y) for x, y in zip(a, b)])


def project(per_loss: Sequence[Sequence[Gradient]],
            like: Optional[Sequence[tf.Tensor]] = None, shuffle: bool = True,
            seed: Optional[int] = None) -> List[Gradient]:
  """PCGrad of per-loss gradients, summed over losses.

  Each task gradient ``g_i`` is the list of its gradients at the tensors
  ``like`` (``None``: the loss does not reach that tensor, taken as zero).
  For every ``i``, ``g_i^PC`` starts at ``g_i``; for every other ``j``, in a
  random order drawn anew at each step (``shuffle``) or in list order,

      if g_i^PC . g_j < 0:  g_i^PC <- g_i^PC - (g_i^PC . g_j) / ||g_j||^2 g_j,

  with dot products over all tensors and elements. The result is
  ``sum_i g_i^PC``. A loss whose gradient is ``None`` at every tensor is left
  out: it neither projects nor is projected. A tensor that no loss reaches
  gets ``None``.

  Args:
    per_loss: one list of gradients per loss, aligned with ``like``.
    like: the forward tensors the gradients belong to; by default, the
      zeros of a missing gradient are shaped like another loss's there.
    shuffle: draw the order of the other tasks at random for each task.
    seed: op-level seed of the shuffles.

  Returns:
    One gradient per tensor of ``like``.
  """
  if like is None:
    return _project_reached(per_loss, shuffle, seed)
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


def _project_reached(per_loss, shuffle, seed) -> List[Gradient]:
  """:func:`project` without ``like``: over the tensors some loss reaches.

  A tensor no loss reaches adds nothing to the dot products and gets
  ``None``; a missing gradient elsewhere is the zeros of a present one.
  """
  n_tensors = len(per_loss[0])
  reached = [any(gs[t] is not None for gs in per_loss)
             for t in range(n_tensors)]
  kept = [t for t in range(n_tensors) if reached[t]]
  like = [tf.convert_to_tensor(next(gs[t] for gs in per_loss
                                    if gs[t] is not None)) for t in kept]
  combined = iter(project([[gs[t] for t in kept] for gs in per_loss], like,
                          shuffle, seed))
  return [next(combined) if r else None for r in reached]


class PCGrad:
  """PCGrad as a task-combination method (see :func:`pcgrad`)."""

  name = "pcgrad"

  def __init__(self, shuffle: bool = True, seed: Optional[int] = None):
    self.shuffle, self.seed = shuffle, seed

  def combine(self, grads: Sequence[Sequence[Gradient]]) -> List[Gradient]:
    """The sum of the projected task gradients, one per tensor."""
    return project(grads, shuffle=self.shuffle, seed=self.seed)

  def __repr__(self):
    return f"pcgrad(shuffle={self.shuffle!r}, seed={self.seed!r})"


def pcgrad(shuffle: bool = True, seed: Optional[int] = None) -> PCGrad:
  """PCGrad: each task gradient projected off those it conflicts with.

  For every task ``i``, ``g_i^PC`` starts at ``g_i``; for every other task
  ``j`` (in a random order drawn at each step with ``shuffle``), when
  ``g_i^PC . g_j < 0``, ``g_i^PC <- g_i^PC - (g_i^PC . g_j) / ||g_j||^2 g_j``,
  with dot products over every output tensor, batch included. ``combine``
  returns ``sum_i g_i^PC``.

  Args:
    shuffle: take the other tasks in a random order, drawn at each step
      (with two tasks the order does not matter).
    seed: op-level seed of the shuffles.

  Returns:
    A task-combination method for ``plan.combine_tasks``.

  Example:
    >>> pcgrad(seed=1)
    pcgrad(shuffle=True, seed=1)
  """
  return PCGrad(shuffle, seed)


def output_rewrite(loss: tf.Tensor, losses: Sequence[tf.Tensor], method: Any,
                   scope: str):
  """The engine's rewrite ``(grads, outputs) -> grads`` at a shared layer.

  ``g - sum_i g_i + method.combine([g_i])`` with ``g_i = dL/dL_i * dL_i/dT``.
  """
  def run(grads, outputs):
    with tf.name_scope(scope.replace("/", "_")):
      weights = tf.compat.v1.gradients(loss, list(losses))
      per_loss = [tf.compat.v1.gradients(l, list(outputs), grad_ys=w)
                  if w is not None else [None] * len(outputs)
                  for l, w in zip(losses, weights)]
      combined = list(method.combine(per_loss))
      if len(combined) != len(outputs):
        raise _errors.IncompatibleGradientError(
            f"combine_tasks: {method!r}.combine returned {len(combined)} "
            f"gradients for {len(outputs)} output tensors. Return one "
            f"combined gradient (or None) per tensor, in order.")
      out = []
      for t, (g, p) in enumerate(zip(grads, combined)):
        if g is None or p is None:  # no listed loss reaches this output
          out.append(g)
          continue
        shares = [tf.convert_to_tensor(gs[t]) for gs in per_loss
                  if gs[t] is not None]
        out.append(tf.convert_to_tensor(g) - tf.add_n(shares) + p)
      return out
  return run


def check_losses(net: LayerGraph, layer: str, losses,
                 method: str = "combine_tasks") -> List[tf.Tensor]:
  """Validates task ``losses`` of a plan's ``method``; returns them as a list."""
  if isinstance(losses, tf.Tensor) or not isinstance(losses, (list, tuple)):
    raise _errors.GraphGradError(
        f"{method}: `losses` must be a list of at least two scalar "
        f"loss tensors; got {type(losses).__name__}. Pass e.g. "
        f"losses=[loss_a, loss_b].")
  losses = list(losses)
  if len(losses) < 2:
    raise _errors.GraphGradError(
        f"{method}: `losses` must hold at least two losses to "
        f"project against each other; got {len(losses)}.")
  for i, l in enumerate(losses):
    if not isinstance(l, tf.Tensor) or not l.dtype.is_floating or (
        l.shape.rank != 0):
      raise _errors.GraphGradError(
          f"{method}: `losses[{i}]` must be a floating-point scalar "
          f"tensor; got {l!r}. Reduce each task loss to a scalar "
          f"(tf.reduce_mean).")
    if l.graph is not net.loss.graph or l.op.name not in net.op_graph:
      raise _errors.NotConnectedError(
          f"{method}: the plan's loss {net.loss.name} does not "
          f"depend on `losses[{i}]` {l.name}. List the task losses whose "
          f"(weighted) sum is the plan's loss.")
  names = [l.name for l in losses]
  if len(set(names)) != len(names):
    raise _errors.GraphGradError(
        f"{method}: `losses` lists a tensor twice: {names}. List "
        f"each task loss once.")
  for a in losses:
    for b in losses:
      if a is not b and nx.has_path(net.op_graph, a.op.name, b.op.name):
        raise _errors.GraphGradError(
            f"{method}: `losses` {b.name} depends on {a.name}, so "
            f"their gradients overlap. List task losses that are separate "
            f"terms of the plan's loss, not partial sums.")
  return losses
