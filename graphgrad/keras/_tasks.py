"""Task combination on a KerasPlan: ``gg.mtl`` methods, PCGrad among them.

A task-combination method has ``combine(grads)``: ``k`` task gradients of
one shape in, one out (see ``graphgrad.methods._pcgrad``). The plan rewrites
the gradient ``g`` at a shared layer's outputs (over all its calls) to
``g - sum_i g_i + combine([g_1, g_2, ...])``, as ``GradientPlan`` does, with
each task's gradients at the output tensors flattened and concatenated into
one vector (:func:`~graphgrad.methods._pcgrad.combine_flat`); in parameter
space, the gradients of the layers' variables the same way
(:func:`parameter_grads`). A stateful method's state is made once per plan
and layer in the plan's tracked
:class:`~graphgrad.keras._methods.MethodVariables`.
"""

from typing import Any, List

import tensorflow as tf

from graphgrad import _errors
from graphgrad.core._gradients import is_float
from graphgrad.keras._methods import MethodVariables
from graphgrad.keras._tape_vjp import TapeVJP
from graphgrad.methods import _pcgrad

# The key of the parameter-level task losses in a ``task_losses`` dict.
PARAMETERS = "parameters"


def losses_by_layer(tasks, task_losses, parameters: bool = False):
  """``layer -> [task loss]`` for every task declaration, or raises.

  With ``parameters`` (a combination in parameter space is declared), its
  losses are under the key :data:`PARAMETERS`.
  """
  if parameters:
    tasks = list(tasks) + [PARAMETERS]
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
      what = (f"layer {layer!r}" if layer != PARAMETERS or not parameters
              else f"the combination at='parameters' (dict key "
                   f"{PARAMETERS!r})")
      raise _errors.GraphGradError(
          f"tape.gradient: `task_losses` must be a list of at least two "
          f"scalar task losses for {what}; got {losses!r}. Pass "
          f"e.g. task_losses=[loss_a, loss_b].")
    out[layer] = list(losses)
  return out


def task_deltas(vjp: TapeVJP, target, losses, calls, method, path: str,
                variables: MethodVariables) -> List[list]:
  """Per call and output: ``combine(g_i) - sum_i g_i``, or ``None``.

  Args:
    vjp: the outer-tape VJP of the step.
    target: the plan's loss.
    losses: the task losses.
    calls: the flat outputs of each call of the task layer.
    method: the task-combination method.
    path: the task layer's path, which keys the method's state.
    variables: the plan's method variables, where the state lives.
  """
  flat = [t for outs in calls for t in outs]
  floats = [i for i, t in enumerate(flat) if is_float(t)]
  like = [flat[i] for i in floats]
  per_task = vjp.task_vjps(target, losses, like)
  name = f"combine_tasks_{path}".replace("/", "_")
  state = _pcgrad.task_state(
      method, _pcgrad.active_tasks(per_task),
      lambda make: variables.state(f"combine_tasks/{path}", make),
      f"{name}_state")
  with tf.name_scope(name):
    combined = _pcgrad.combine_flat(method, per_task, like, state)
  delta = [None] * len(flat)
  for t, i in enumerate(floats):
    if combined[t] is not None:
      delta[i] = combined[t] - tf.add_n([tf.convert_to_tensor(gs[t])
                                         for gs in per_task
                                         if gs[t] is not None])
  out, start = [], 0
  for outs in calls:
    out.append(delta[start:start + len(outs)])
    start += len(outs)
  return out


def parameter_grads(vjp: TapeVJP, target, losses, flat_s: List[Any],
                    flat_g: List[Any], chosen: List[int], method,
                    variables: MethodVariables) -> List[Any]:
  """``flat_g`` with the task combination in parameter space applied.

  For the sources at ``chosen``: ``G - sum_i g_i + combine([g_i])``, with
  ``g_i = dL/dL_i * dL_i/dtheta`` from the tape, one pass per task loss.

  Args:
    vjp: the outer-tape VJP of the step.
    target: the plan's loss.
    losses: the task losses.
    flat_s: the gradient's sources, flattened.
    flat_g: the plan's gradients of them.
    chosen: the positions in ``flat_s`` of the combined variables.
    method: the task-combination method.
    variables: the plan's method variables, where the state lives.
  """
  out = list(flat_g)
  if not chosen:
    return out
  sources = [flat_s[i] for i in chosen]
  per_task = vjp.task_vjps(target, losses, sources)
  state = _pcgrad.task_state(
      method, _pcgrad.active_tasks(per_task),
      lambda make: variables.state("combine_tasks/parameters", make),
      "combine_tasks_parameters_state")
  with tf.name_scope("combine_tasks_parameters"):
    rest = _pcgrad.without_tasks([flat_g[i] for i in chosen], per_task)
    new = _pcgrad.combine_parameters(method, per_task, rest, sources, state)
  for i, g in zip(chosen, new):
    out[i] = g
  return out
