"""``gg.mtl`` methods at a shared layer: the rewrite of its output gradient.

With ``T`` the layer's outputs, ``g`` the gradient of the plan's loss at
``T`` and ``g_i = dL/dL_i * dL_i/dT`` task loss ``L_i``'s share of it, the
gradient at ``T`` becomes ``g - sum_i g_i + method.combine([g_1 .. g_k])``.
Each task loss is backpropagated once, from the loss to ``T`` only. With
several outputs, a task's gradient is the concatenation of its flattened
gradients at all of them (dot products over all tensors, as PCGrad's).
A task loss that reaches none of ``T`` is left out (``k`` counts the tasks
that reach it); one that reaches some outputs counts as zero at the others.
"""

from collections.abc import Sequence

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.methods import _pcgrad
from graphgrad.methods._mtl_base import TaskMethod
from graphgrad.methods._mtl_methods import _PCGrad


def check_method(method, where: str) -> TaskMethod:
  """Validates a ``gg.mtl`` method argument."""
  if not isinstance(method, TaskMethod):
    raise _errors.GraphGradError(
        f"{where}: `method` must be a gg.mtl method such as "
        f"gg.mtl.upgrad(); got {method!r}. Make one with a gg.mtl factory.")
  return method


def combine_shares(per_task: Sequence[Sequence[Gradient]],
                   outputs: Sequence[tf.Tensor], method: TaskMethod,
                   state=None) -> list[Gradient]:
  """``method.combine`` of the tasks' gradients at ``outputs``, per output.

  Args:
    per_task: one list of gradients per task, aligned with ``outputs``
      (``None``: the task does not reach that output).
    outputs: the layer's output tensors.
    method: a ``gg.mtl`` method.
    state: the method's state, for a stateful method.

  Returns:
    The combined gradient at each output; ``None`` where no task reaches it.
  """
  active = [gs for gs in per_task if any(g is not None for g in gs)]
  reached = [any(gs[t] is not None for gs in active)
             for t in range(len(outputs))]
  if not active:
    return [None] * len(outputs)
  if isinstance(method, _PCGrad):
    return _pcgrad.project(per_task, outputs, method.shuffle, method.seed)
  flat = []
  for gs in active:
    flat.append(tf.concat([
        tf.reshape(tf.convert_to_tensor(g) if g is not None
                   else tf.zeros_like(y), [-1])
        for g, y in zip(gs, outputs)], 0))
  combined = method.combine(flat, state=state)
  sizes = [tf.size(y) for y in outputs]
  parts = tf.split(combined, tf.stack(sizes)) if len(outputs) > 1 else [
      combined]
  return [tf.reshape(p, tf.shape(y)) if r else None
          for p, y, r in zip(parts, outputs, reached)]


def rewrite_total(grads: Sequence[Gradient],
                  per_task: Sequence[Sequence[Gradient]],
                  combined: Sequence[Gradient]) -> list[Gradient]:
  """``g - sum_i g_i + combined`` at each output (``g`` where none reach)."""
  out = []
  for t, (g, c) in enumerate(zip(grads, combined)):
    if g is None or c is None:
      out.append(g)
      continue
    shares = [tf.convert_to_tensor(gs[t]) for gs in per_task
              if gs[t] is not None]
    out.append(tf.convert_to_tensor(g) - tf.add_n(shares) + c)
  return out


def task_rewrite(loss: tf.Tensor, losses: Sequence[tf.Tensor],
                 method: TaskMethod, scope: str):
  """The TF1 engine's ``outputs_fn`` rewrite ``(grads, outputs) -> grads``.

  A stateful method's state is created when the rewrite is built, once per
  plan and layer, named after ``scope``.
  """
  if isinstance(method, _PCGrad):
    return _pcgrad.output_rewrite(loss, losses, method.shuffle, method.seed,
                                  scope)

  def run(grads, outputs):
    with tf.name_scope(scope.replace("/", "_")):
      weights = tf.compat.v1.gradients(loss, list(losses))
      per_task = [tf.compat.v1.gradients(l, list(outputs), grad_ys=w)
                  if w is not None else [None] * len(outputs)
                  for l, w in zip(losses, weights)]
      k = sum(any(g is not None for g in gs) for gs in per_task)
      state = method.create_state(k, name=scope.replace("/", "_") + "_state")
      combined = combine_shares(per_task, outputs, method, state)
      return rewrite_total(grads, per_task, combined)
  return run


def tape_combined_gradient(tape: tf.GradientTape, loss: tf.Tensor,
                           losses: Sequence[tf.Tensor],
                           outputs: Sequence[tf.Tensor], method: TaskMethod,
                           state=None) -> list[Gradient]:
  """TF2: the rewritten gradient of ``loss`` at a layer's ``outputs``.

  For a Keras model trained under a tape: the same rewrite as
  ``GradientPlan.combine_tasks``, from a ``persistent=True`` tape that
  watched ``losses``' and ``outputs``' computation. Backpropagate the result
  from ``outputs`` (``tape.gradient(outputs, vars, output_gradients=...)``)
  for the layer and everything below. Works eagerly and in ``tf.function``.

  Args:
    tape: a persistent ``tf.GradientTape``.
    loss: the total loss, a weighted sum of ``losses`` and other terms.
    losses: the task losses.
    outputs: the shared layer's output tensors.
    method: a ``gg.mtl`` method.
    state: ``method.create_state(k)``, made once, for a stateful method.

  Returns:
    One gradient per output.

  Example:
    >>> import graphgrad as gg
    >>> from graphgrad.methods import _mtl_plan
    >>> h0 = tf.constant([1., 1.])
    >>> with tf.GradientTape(persistent=True) as tape:
    ...   tape.watch(h0)
    ...   h = 2. * h0
    ...   la, lb = tf.reduce_sum(h * [1., 0.]), tf.reduce_sum(h * [-1., 1.])
    ...   loss = la + lb
    >>> g = _mtl_plan.tape_combined_gradient(
    ...     tape, loss, [la, lb], [h], gg.mtl.pcgrad())
    >>> g[0].numpy()
    array([0.5, 1.5], dtype=float32)
  """
  method = check_method(method, "tape_combined_gradient")
  outputs = list(outputs)
  grads = tape.gradient(loss, outputs)
  weights = tape.gradient(loss, list(losses))
  per_task = [tape.gradient(l, outputs, output_gradients=w)
              if w is not None else [None] * len(outputs)
              for l, w in zip(losses, weights)]
  combined = combine_shares(per_task, outputs, method, state)
  return rewrite_total(grads, per_task, combined)

