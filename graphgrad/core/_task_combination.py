"""Task combination, written once for both executors against their VJP.

``combine_tasks`` at a layer's outputs replaces the tasks' share of the
gradient there, ``sum_i g_i``, by ``combine(g_1, ..., g_k)``; in parameter
space it does the same for the gradients of the chosen variables. The task
gradients ``g_i = d target / d l_i * d l_i / d x`` come from the executor's
:class:`~graphgrad.core._vjp.VJP` (``task_vjps``): one backward pass per
task loss, in the units of the plan's own gradient (loss-scaled under a
loss scale). :func:`combine_flat` hands them to the method (``gg.mtl``'s,
or the caller's own), flattened into one vector per task; a stateful method
keeps its state where the executor's ``state_of`` puts it. :func:`check_at`
checks the level a ``combine_tasks`` declaration names.
"""

from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.core._gradients import is_float
from graphgrad.core._vjp import VJP

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


def call_deltas(vjp: VJP, target, layer: str, losses: Sequence,
                calls: Sequence[Sequence], method: Any, state_of: Callable
                ) -> List[List[Optional[tf.Tensor]]]:
  """Per call of ``layer``, per output: ``combine(g_1, ..., g_k) - sum_i
  g_i``, combined over every call's floating-point outputs at once (a layer
  called twice is one combination), ``None`` for an output that is not
  floating-point or that no task reaches. What both executors hand core's
  layer step (``core._layer_step``), which adds it to the gradient there.

  Args:
    vjp: the executor's VJP.
    target: the plan's loss, as it is backpropagated.
    layer: the layer whose outputs the tasks are combined at; names the
      scope ``combine_tasks_<layer>`` and the method's state.
    losses: the task losses.
    calls: per call of the layer, its outputs.
    method: the task-combination method.
    state_of: ``make -> state``, the executor's store of the method's state
      for this plan and layer.
  """
  flat = [t for outs in calls for t in outs]
  floats = [i for i, t in enumerate(flat) if is_float(t)]
  name = f"combine_tasks_{layer}".replace("/", "_")
  with tf.name_scope(name):
    found = output_deltas(vjp, target, losses, [flat[i] for i in floats],
                          method, state_of, name)
  delta: List[Optional[tf.Tensor]] = [None] * len(flat)
  for i, d in zip(floats, found):
    delta[i] = d
  out, start = [], 0
  for outs in calls:
    out.append(delta[start:start + len(outs)])
    start += len(outs)
  return out


def output_deltas(vjp: VJP, target, losses: Sequence, outputs: Sequence,
                  method: Any, state_of: Callable, name: str
                  ) -> List[Optional[tf.Tensor]]:
  """Per output: ``combine(g_1, ..., g_k) - sum_i g_i``, or ``None`` where
  no task reaches it. The caller opens the name scope.

  Args:
    vjp: the executor's VJP.
    target: the plan's loss, as it is backpropagated.
    losses: the task losses.
    outputs: the layer's floating-point outputs.
    method: the task-combination method.
    state_of: ``make -> state``, the executor's store of the method's state
      for this plan and layer.
    name: names the method's state.
  """
  per_task = vjp.task_vjps(target, list(losses), list(outputs))
  state = _state(method, per_task, state_of, f"{name}_state")
  combined = combine_flat(method, per_task, outputs, state)
  # Where no task reaches an output, nothing is combined there.
  return [None if c is None else d
          for c, d in zip(combined, _without_tasks(combined, per_task))]


def combined_parameters(vjp: VJP, target, losses: Sequence,
                        variables: Sequence, grads: Optional[Sequence],
                        method: Any, state_of: Callable,
                        reduce: Optional[Callable] = None,
                        rest: Optional[Callable[[], List[Gradient]]] = None
                        ) -> List[Gradient]:
  """The gradients of ``variables`` with their tasks' shares combined.

  Each variable gets ``G - sum_i g_i + combine(g_1, ..., g_k)``, the task
  gradients of all ``variables`` flattened into one vector each.

  Args:
    vjp: the executor's VJP.
    target: the plan's loss, as it is backpropagated.
    losses: the task losses.
    variables: the combined variables.
    grads: the plan's gradient ``G`` of each, or ``None`` where the plan made
      none (then ``rest()`` gives ``G - sum_i g_i`` directly).
    method: the task-combination method.
    state_of: ``make -> state``, the executor's store of the method's state.
    reduce: ``(variables, grads) -> grads``, applied to each task's
      gradients as to the plan's own (a TF1 ``reduce_fn``), or ``None``.
    rest: with ``grads`` ``None``, what the loss gives besides the tasks.
  """
  variables = list(variables)
  with tf.name_scope("combine_tasks_parameters"):
    per_task = [_reduced(reduce, gs, variables)
                for gs in vjp.task_vjps(target, list(losses), variables)]
    if grads is None:
      assert rest is not None  # the caller gives one of the two
      others = _reduced(reduce, rest(), variables)
    else:
      others = _without_tasks(grads, per_task)
    state = _state(method, per_task, state_of,
                   "combine_tasks_parameters_state")
    like = [tf.convert_to_tensor(v) for v in variables]
    combined = combine_flat(method, per_task, like, state)
    # Dense where a task reaches a variable; the rest alone where none does.
    return [r if c is None else c if r is None else tf.convert_to_tensor(r) + c
            for r, c in zip(others, combined)]


def _state(method: Any, per_task: Sequence[Sequence[Gradient]],
           state_of: Callable, name: str):
  """A stateful method's state for this plan and layer, made on first use
  for the tasks that reach a tensor; ``None`` for a stateless method."""
  if not method.stateful:
    return None
  k = sum(any(g is not None for g in gs) for gs in per_task)
  return state_of(lambda: method.create_state(k, name=name))


def _without_tasks(grads: Sequence[Gradient],
                   per_task: Sequence[Sequence[Gradient]]) -> List[Gradient]:
  """``G - sum_i g_i`` per tensor: the gradient less the tasks' shares."""
  out: List[Gradient] = []
  for t, g in enumerate(grads):
    shares = [tf.convert_to_tensor(gs[t]) for gs in per_task
              if gs[t] is not None]
    if not shares:
      out.append(g)
    elif g is None:
      out.append(-tf.add_n(shares))
    else:
      out.append(tf.convert_to_tensor(g) - tf.add_n(shares))
  return out


def _reduced(reduce: Optional[Callable], gs: Sequence[Gradient],
             variables: Sequence) -> List[Gradient]:
  """``gs`` through ``reduce``, for the entries that have a gradient."""
  out = list(gs)
  found = [t for t, g in enumerate(gs) if g is not None]
  if reduce is not None and found:
    for t, r in zip(found, reduce([variables[t] for t in found],
                                  [gs[t] for t in found])):
      out[t] = r
  return out


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
