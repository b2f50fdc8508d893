"""Backward passes for ops inside one plan: override_gradient, straight_through.

A plan's override gives an op a gradient function for this plan's backward
pass only: TensorFlow's gradient registry, the op's attributes and every
other ``tf.gradients`` call on the graph are untouched, which
``gradient_override_map`` cannot promise; ops of imported graphs work too.
Every backward call the plan makes goes through :func:`gradients`, which
cuts the call at the overridden ops it crosses: the gradient at an
overridden op's outputs, summed over all its consumers, goes through ``fn``
to its inputs, and backpropagation continues below from there, consumers
first, so each ``fn`` sees a complete gradient.
"""

import collections
import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _compat, _errors
from graphgrad.analysis import _graph_util, _lost_overrides
from graphgrad.analysis._no_gradient import (
  backpropagatable,
  ops_on_path,
  ops_without_gradient,
)
from graphgrad.core._gradients import aggregate, input_grads

GradFn = Callable[..., object]


def resolve_op(loss: tf.Tensor, sources, op, caller: str) -> Tuple[str, str]:
  """``(match, key)`` of ``op`` (an Operation, an op name or an op type).

  A string that is the type of an op on the loss's backward path is a type.

  Raises:
    GraphGradError: if ``op`` names nothing on the loss's backward path.
    NotConnectedError: if ``op`` is not on the loss's backward path.
  """
  path = ops_on_path(loss, sources)
  if isinstance(op, tf.Operation):
    if op.graph is not loss.graph:
      raise _errors.GraphGradError(
          f"{caller}: the op {op.name} belongs to another tf.Graph than the "
          f"loss {loss.name}. Pass an op of the loss's graph.")
    if op not in path:
      raise _not_on_path(caller, op.name, loss, path)
    return "name", op.name
  if not isinstance(op, str):
    raise _errors.GraphGradError(
        f"{caller}: `op` must be a tf.Operation, an op name or an op type "
        f"(str); got {type(op).__name__}.")
  if any(o.type == op for o in path):
    return "type", op
  try:
    found = loss.graph.get_operation_by_name(op)
  except (KeyError, ValueError):
    found = None
  if found is None:
    types = sorted({o.type for o in path})
    raise _errors.GraphGradError(
        f"{caller}: {op!r} is neither an op name of the loss's graph nor "
        f"the type of an op on the backward path of {loss.name}. Types on "
        f"that path: {', '.join(types)}.")
  if found not in path:
    raise _not_on_path(caller, op, loss, path)
  return "name", op


def on_path(loss: tf.Tensor, sources, overrides: Dict[Tuple[str, str], GradFn],
            layer_of: Callable[[tf.Operation], Optional[str]]
            ) -> Dict[str, GradFn]:
  """Maps each overridden op on the loss's path to its ``fn``.

  Args:
    loss: the plan's loss.
    sources: the variables differentiated.
    overrides: ``(match, key) -> fn``, ``match`` ``"name"`` or ``"type"``.
    layer_of: the layer of an op, or ``None``, for the error message.

  Raises:
    GraphGradError: if an op without a gradient is left without one.
    UnsupportedGraphError: for an overridden op inside a loop or cond.
  """
  by_name = {k: fn for (m, k), fn in overrides.items() if m == "name"}
  by_type = {k: fn for (m, k), fn in overrides.items() if m == "type"}
  found = {}
  for op in ops_on_path(loss, sources):
    fn = by_name.get(op.name, by_type.get(op.type))
    if fn is None:
      continue
    if _graph_util.in_control_flow(op):
      raise _errors.UnsupportedGraphError(
          f"the overridden op {op.name} lies inside a tf.compat.v1 while "
          f"loop or cond, where the backward pass cannot be cut. Override "
          f"an op outside the loop.")
    found[op.name] = fn
  missing = [op for op in ops_without_gradient(loss, sources)
             if op.name not in found]
  if missing:
    raise no_gradient_error(loss, missing, layer_of)
  return found


def gradients_fn(loss: tf.Tensor, sources,
                 overrides: Dict[Tuple[str, str], GradFn],
                 layer_of: Callable[[tf.Operation], Optional[str]]
                 ) -> Tuple[Callable, Tuple[str, ...]]:
  """What a plan calls instead of ``tf.gradients``, and the ops it overrides.

  :func:`gradients` with the plan's overridden ops on the loss's path, or
  ``tf.gradients`` itself without any.
  """
  found = on_path(loss, sources, overrides, layer_of) if overrides else {}
  if not found:
    return tf.compat.v1.gradients, ()
  return functools.partial(gradients, overrides=found), tuple(found)


def _not_on_path(caller, name, loss, path) -> _errors.NotConnectedError:
  return _errors.NotConnectedError(
      f"{caller}: the op {name} is not on the backward path of {loss.name} "
      f"(between the differentiated variables and the loss), so its gradient "
      f"is never computed. Override an op the loss's gradient passes "
      f"through; {len(path)} ops do.")


def no_gradient_error(loss: tf.Tensor, ops: Sequence[tf.Operation],
                      layer_of) -> _errors.GraphGradError:
  """The build-time error listing every op without a gradient."""
  listed = ", ".join(
      f"{op.name} (type {op.type}, "
      f"{'layer ' + repr(layer_of(op)) if layer_of(op) else 'glue'})"
      for op in ops)
  return _errors.GraphGradError(
      f"the backward path of {loss.name} crosses {len(ops)} op"
      f"{'s' if len(ops) != 1 else ''} with no registered gradient, where "
      f"tf.gradients would stop with LookupError: {listed}."
      f"{_lost_override_note(ops)} Give each one a "
      f"backward pass in this plan: plan.straight_through(op) for the "
      f"identity (the straight-through estimator), or "
      f"plan.override_gradient(op, fn) with fn(op, *output_grads) -> input "
      f"grads; `op` is the op, its name, or its type ({ops[0].type!r}).")


def _lost_override_note(ops) -> str:
  """Why the ops have no gradient when they carry an override name."""
  by_name: Dict[str, List[str]] = collections.defaultdict(list)
  for op in ops:
    name = _lost_overrides.override_name(op)
    if name is not None:
      by_name[name].append(op.name)
  return "".join(
      f" {', '.join(names)} carried the gradient override {name!r} when the "
      f"graph was built; no gradient function of that name is registered in "
      f"this process (@tf.RegisterGradient({name!r}) ran only in the process "
      f"that built it)."
      for name, names in by_name.items()) + (
          " gg.analyze(loss).lost_overrides suggests the declaration that "
          "restores each one." if by_name else "")


def gradients(ys, xs, grad_ys=None, stop_gradients=None, *,
              overrides: Dict[str, GradFn], **options) -> List:
  """``tf.gradients`` with the ops in ``overrides`` cut and sent through fn.

  Args:
    ys, xs, grad_ys, stop_gradients: as for ``tf.compat.v1.gradients``.
    overrides: op name -> ``fn(op, *output_grads) -> input grads``.
    **options: more keyword arguments for ``tf.compat.v1.gradients``.

  Returns:
    One gradient (or None) per ``xs``.
  """
  ys = list(ys) if isinstance(ys, (list, tuple)) else [ys]
  xs = list(xs)
  stops = list(stop_gradients or [])
  floor = -1
  if xs and not any(_graph_util.in_control_flow(x.op) for x in xs):
    floor = min(_compat.op_id(x.op) for x in xs)
  cut = [op for op in ops_on_path(ys, xs, stops, floor)
         if op.name in overrides]
  if not cut:
    return tf.compat.v1.gradients(ys, xs, grad_ys=grad_ys,
                                  stop_gradients=stops, **options)
  cut.sort(key=lambda o: -_compat.op_id(o))
  outs = {op.name: [t for t in op.outputs if backpropagatable(t)]
          for op in cut}
  stops += [t for op in cut for t in outs[op.name]]
  acc: Dict[str, List] = collections.defaultdict(list)
  x_grads: List[List] = [[] for _ in xs]

  def run(ys_, grad_ys_, targets):
    res = tf.compat.v1.gradients(ys_, xs + targets, grad_ys=grad_ys_,
                                 stop_gradients=stops, **options)
    for i, g in enumerate(res[:len(xs)]):
      if g is not None:
        x_grads[i].append(g)
    for t, g in zip(targets, res[len(xs):]):
      if g is not None:
        acc[t.name].append(g)

  run(ys, grad_ys, [t for op in cut for t in outs[op.name]])
  for k, op in enumerate(cut):
    grads = [aggregate(acc.get(t.name, ()), like=t) for t in op.outputs]
    if all(g is None for g in grads):
      continue
    grads = [tf.zeros_like(t) if g is None and t.dtype.is_floating else g
             for t, g in zip(op.outputs, grads)]
    pairs = [(t, g) for t, g in zip(op.inputs, input_grads(
        op, overrides[op.name], grads)) if g is not None]
    if pairs:
      run([t for t, _ in pairs],
          [tf.convert_to_tensor(g) for _, g in pairs],
          [t for below in cut[k + 1:] for t in outs[below.name]])
  return [aggregate(gs, like=x) for gs, x in zip(x_grads, xs)]

