"""PCGrad at a layer boundary: project conflicting per-loss gradients.

``plan.project_conflicts(layer, losses)`` applies gradient surgery (Yu et al.,
2020, "Gradient Surgery for Multi-Task Learning") to the gradients that the
listed losses send to a shared layer's outputs.
"""

from typing import List, Optional, Sequence

import networkx as nx
import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.analysis._layers import LayerGraph


def _dot(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> tf.Tensor:
  return tf.add_n([tf.reduce_sum(x * y) for x, y in zip(a, b)])


def project(per_loss: Sequence[Sequence[Gradient]],
            like: Sequence[tf.Tensor], shuffle: bool = True,
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
    like: the forward tensors the gradients belong to.
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


def output_rewrite(loss: tf.Tensor, losses: Sequence[tf.Tensor],
                   shuffle: bool, seed: Optional[int], scope: str):
  """The engine's rewrite ``(grads, outputs) -> grads`` at a shared layer.

  ``g - sum_i g_i + sum_i g_i^PC`` with ``g_i = dL/dL_i * dL_i/dT``.
  """
  def run(grads, outputs):
    with tf.name_scope(scope.replace("/", "_")):
      weights = tf.compat.v1.gradients(loss, list(losses))
      per_loss = [tf.compat.v1.gradients(l, list(outputs), grad_ys=w)
                  if w is not None else [None] * len(outputs)
                  for l, w in zip(losses, weights)]
      projected = project(per_loss, outputs, shuffle, seed)
      out = []
      for t, (g, p) in enumerate(zip(grads, projected)):
        if g is None or p is None:  # no listed loss reaches this output
          out.append(g)
          continue
        shares = [tf.convert_to_tensor(gs[t]) for gs in per_loss
                  if gs[t] is not None]
        out.append(tf.convert_to_tensor(g) - tf.add_n(shares) + p)
      return out
  return run


def check_losses(net: LayerGraph, layer: str, losses,
                 where: str = "project_conflicts") -> List[tf.Tensor]:
  """Validates ``losses`` for ``where``; returns them as a list."""
  if isinstance(losses, tf.Tensor) or not isinstance(losses, (list, tuple)):
    raise _errors.GraphGradError(
        f"{where}: `losses` must be a list of at least two scalar "
        f"loss tensors; got {type(losses).__name__}. Pass e.g. "
        f"losses=[loss_a, loss_b].")
  losses = list(losses)
  if len(losses) < 2:
    raise _errors.GraphGradError(
        f"{where}: `losses` must hold at least two losses to "
        f"project against each other; got {len(losses)}.")
  for i, l in enumerate(losses):
    if not isinstance(l, tf.Tensor) or not l.dtype.is_floating or (
        l.shape.rank != 0):
      raise _errors.GraphGradError(
          f"{where}: `losses[{i}]` must be a floating-point scalar "
          f"tensor; got {l!r}. Reduce each task loss to a scalar "
          f"(tf.reduce_mean).")
    if l.graph is not net.loss.graph or l.op.name not in net.op_graph:
      raise _errors.NotConnectedError(
          f"{where}: the plan's loss {net.loss.name} does not "
          f"depend on `losses[{i}]` {l.name}. List the task losses whose "
          f"(weighted) sum is the plan's loss.")
  names = [l.name for l in losses]
  if len(set(names)) != len(names):
    raise _errors.GraphGradError(
        f"{where}: `losses` lists a tensor twice: {names}. List "
        f"each task loss once.")
  for a in losses:
    for b in losses:
      if a is not b and nx.has_path(net.op_graph, a.op.name, b.op.name):
        raise _errors.GraphGradError(
            f"{where}: `losses` {b.name} depends on {a.name}, so "
            f"their gradients overlap. List task losses that are separate "
            f"terms of the plan's loss, not partial sums.")
  return losses
