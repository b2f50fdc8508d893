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
from graphgrad.core._task_combination import combined_parameters, output_deltas
from graphgrad.keras._methods import MethodVariables
from graphgrad.keras._tape_vjp import TapeVJP

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
  """Per call and output: ``combine(g_i) - sum_i g_i``, or ``None``
  (``core._task_combination.output_deltas`` over every call's outputs at once).

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
  name = f"combine_tasks_{path}".replace("/", "_")
  with tf.name_scope(name):
    found = output_deltas(
        vjp, target, losses, [flat[i] for i in floats], method,
        lambda make: variables.state(f"combine_tasks/{path}", make), name)
  delta: List[Any] = [None] * len(flat)
  for i, d in zip(floats, found):
    delta[i] = d
  out, start = [], 0
  for outs in calls:
    out.append(delta[start:start + len(outs)])
    start += len(outs)
  return out


def parameter_grads(vjp: TapeVJP, target, losses, flat_s: List[Any],
                    flat_g: List[Any], chosen: List[int], method,
                    variables: MethodVariables) -> List[Any]:
  """``flat_g`` with the task combination in parameter space applied
  (``core._task_combination.combined_parameters``) to the sources at ``chosen``.

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
  new = combined_parameters(
      vjp, target, losses, [flat_s[i] for i in chosen],
      [flat_g[i] for i in chosen], method,
      lambda make: variables.state("combine_tasks/parameters", make))
  for i, g in zip(chosen, new):
    out[i] = g
  return out
