"""Task combination, at a layer's outputs or in parameter space, and PCGrad.

``plan.combine_tasks(layer, losses, method)`` makes the gradient ``g`` at
the layer's outputs ``T`` ``g - sum_i g_i + method.combine([g_1, ...])``,
``g_i = dL/dL_i * dL_i/dT``; ``at="parameters"`` does it for the layers'
variables. Both executors call :func:`combine_flat`, which flattens each
task's gradients into one vector (zeros where a task does not reach one).
:class:`PCGrad` (Yu et al., 2020) is one method.

Example:
  >>> import tensorflow as tf
  >>> out = pcgrad().combine([tf.constant([1.0, 0.0]),
  ...                         tf.constant([-1.0, 1.0])])
  >>> out.numpy().tolist()  # each projected off the other, then summed
  [0.5, 1.5]
"""

from typing import Any, List, Optional, Sequence

import networkx as nx
import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.analysis._layer_graph import LayerGraph
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


# -- the executors' adapter ----------------------------------------------------

# Where ``combine_tasks`` combines the task gradients (its ``at=``).
LEVELS = ("output", "parameters")


def check_at(at, layers) -> str:
  """``at`` if it names a level of task combination, and ``layers`` is one
  layer for ``"output"``; else raises (``combine_tasks`` of both plans)."""
  if not isinstance(at, str) or at not in LEVELS:
    raise _errors.GraphGradError(
        f"combine_tasks: `at` must be one of {', '.join(map(repr, LEVELS))}; "
        f"got {at!r}. Pass at='output' (the default: the task gradients at "
        f"the layer's outputs) or at='parameters' (the task gradients of the "
        f"layers' variables, as one vector, as PCGrad_tf.py does).")
  if at == "output" and (isinstance(layers, (list, tuple)) or layers is None):
    raise _errors.GraphGradError(
        f"combine_tasks: with at='output' `layers` must be one layer, at "
        f"whose outputs the task gradients are combined; got {layers!r}. "
        f"Name one layer, or pass at='parameters' to combine the task "
        f"gradients of several layers' variables.")
  return at


def combine_flat(method: Any, per_task: Sequence[Sequence[Gradient]],
                 like: Sequence[tf.Tensor], state=None) -> List[Gradient]:
  """``method.combine`` of the tasks' gradients at several tensors.

  With several tensors, each task's gradients at ``like`` are flattened and
  concatenated into one vector (zeros where the task does not reach a
  tensor), and the combined vector is split back; one tensor is combined
  in its own shape. A task that reaches none of them is left out.

  Args:
    method: a task-combination method.
    per_task: one list of gradients per task, aligned with ``like``.
    like: the layer's output tensors.
    state: the method's state for this plan and layer, or ``None``.

  Returns:
    The combined gradient at each tensor; ``None`` where no task reaches it.

  Raises:
    IncompatibleGradientError: if ``method.combine`` returns something not
      shaped like the task gradients.
  """
  active = [gs for gs in per_task if any(g is not None for g in gs)]
  if not active:
    return [None] * len(like)
  reached = [any(gs[t] is not None for gs in active) for t in range(len(like))]
  flat = [_concat([tf.convert_to_tensor(g) if g is not None
                   else tf.zeros_like(y) for g, y in zip(gs, like)])
          for gs in active]
  out = (method.combine(flat) if state is None
         else method.combine(flat, state=state))
  out = _checked_result(method, out, flat[0])
  if len(like) == 1:  # one tensor: combined in its own shape
    return [out]
  parts = tf.split(out, tf.stack([tf.size(y) for y in like]))
  return [tf.reshape(p, tf.shape(y)) if r else None
          for p, y, r in zip(parts, like, reached)]


def _concat(grads: Sequence[tf.Tensor]) -> tf.Tensor:
  if len(grads) == 1:
    return grads[0]
  return tf.concat([tf.reshape(g, [-1]) for g in grads], 0)


def _checked_result(method, out, like: tf.Tensor) -> tf.Tensor:
  if out is not None and not isinstance(out, (list, tuple)):
    out = tf.convert_to_tensor(out)
    if out.dtype == like.dtype and out.shape.is_compatible_with(like.shape):
      return out
  what = (f"{type(out).__name__}" if not tf.is_tensor(out)
          else f"a tensor of shape {out.shape} {out.dtype.name}")
  raise _errors.IncompatibleGradientError(
      f"combine_tasks: {method!r}.combine returned {what} for task "
      f"gradients of shape {like.shape} {like.dtype.name}. Return one "
      f"combined gradient shaped like each task gradient.")


def check_losses(net: LayerGraph, layer: str, losses,
                 method: str = "combine_tasks") -> List[tf.Tensor]:
  """Checks the task ``losses`` of a plan's ``method``; returns a list."""
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
