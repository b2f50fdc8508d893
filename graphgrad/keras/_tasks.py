"""Task combination on a KerasPlan: PCGrad and ``combine(grads)`` methods.

A task-combination method has ``combine(grads)``: ``grads`` holds, for each
task, its list of gradients at the shared layer's output tensors (dense,
zeros where the task does not reach a tensor); it returns one combined
gradient per tensor. The plan rewrites the gradient ``g`` at the outputs to
``g - sum_i g_i + combine([g_1, g_2, ...])``, as ``GradientPlan`` does.
"""

from typing import List

import tensorflow as tf

from graphgrad import _errors
from graphgrad.keras._backward import is_float


def losses_by_layer(tasks, task_losses):
  """``layer -> [task loss]`` for every task declaration, or raises."""
  if not tasks:
    if task_losses is not None:
      raise _errors.GraphGradError(
          "tape.gradient: `task_losses` was given, but the plan declares no "
          "task combination. Declare plan.project_conflicts(layer) or "
          "plan.combine_tasks(layer, method) first, or drop task_losses.")
    return {}
  if task_losses is None:
    raise _errors.GraphGradError(
        f"tape.gradient: the plan combines task gradients at "
        f"{', '.join(map(repr, sorted(tasks)))}, whose task losses only exist "
        f"in the training step. Pass them: tape.gradient(loss, "
        f"task_losses=[loss_a, loss_b]) (or a dict layer -> losses).")
  out = {}
  for layer in tasks:
    losses = (task_losses.get(layer) if isinstance(task_losses, dict)
              else task_losses)
    if (losses is None or tf.is_tensor(losses)
        or not isinstance(losses, (list, tuple)) or len(losses) < 2):
      raise _errors.GraphGradError(
          f"tape.gradient: `task_losses` must be a list of at least two "
          f"scalar task losses for layer {layer!r}; got {losses!r}. Pass "
          f"e.g. task_losses=[loss_a, loss_b].")
    out[layer] = list(losses)
  return out


def task_deltas(tape, target, losses, calls, method) -> List[list]:
  """Per call and output: ``combine(g_i) - sum_i g_i``, or ``None``.

  Args:
    tape: the persistent tape that recorded the step.
    target: the plan's loss.
    losses: the task losses.
    calls: the flat outputs of each call of the task layer.
    method: the task-combination method.
  """
  weights = tape.gradient(target, losses)
  for i, w in enumerate(weights):
    if w is None:
      raise _errors.NotConnectedError(
          f"tape.gradient: the loss does not depend on `task_losses[{i}]`. "
          f"List the task losses whose (weighted) sum is the loss.")
  flat = [t for outs in calls for t in outs]
  floats = [i for i, t in enumerate(flat) if is_float(t)]
  like = [flat[i] for i in floats]
  per_task = [tape.gradient(l, like, output_gradients=w)
              for l, w in zip(losses, weights)]
  reached = [any(gs[t] is not None for gs in per_task)
             for t in range(len(like))]
  dense = [[tf.zeros_like(x) if g is None else tf.convert_to_tensor(g)
            for g, x in zip(gs, like)] for gs in per_task]
  combined = list(method.combine(dense))
  delta = [None] * len(flat)
  for t, i in enumerate(floats):
    if reached[t]:
      delta[i] = combined[t] - tf.add_n([gs[t] for gs in dense])
  out, start = [], 0
  for outs in calls:
    out.append(delta[start:start + len(outs)])
    start += len(outs)
  return out
