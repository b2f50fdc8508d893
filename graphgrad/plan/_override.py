"""Backward passes for ops inside one plan: override_gradient, straight_through.

A plan's override gives an op a gradient function for this plan's backward
pass only. Nothing global changes: TensorFlow's gradient registry, the op's
``_gradient_op_type`` attribute and every other ``tf.gradients`` call on the
same graph are untouched, which ``gradient_override_map`` cannot promise
(it only reaches ops created inside its block, and rewrites their attribute
for every later call). It reaches ops of imported graphs as well.

Every backward call the plan makes (the single ``tf.gradients`` of a plan
without cuts, or each segment of the segment engine) goes through
:func:`gradients`, which cuts the call at the overridden ops it crosses: the
gradient at an overridden op's outputs, summed over all its consumers, goes
through ``fn`` to its inputs, and backpropagation continues below from there.
The overridden ops are taken consumers first, so each one's output gradient
is complete when ``fn`` sees it. Each cut costs one more ``tf.gradients``
call; every forward op is still backpropagated once per segment.
"""

import collections
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util
from graphgrad.analysis._no_gradient import (
  backpropagatable,
  ops_on_path,
  ops_without_gradient,
)
from graphgrad.plan._engine import aggregate

GradFn = Callable[..., object]


def straight_through(op: tf.Operation, *grads):
  """The straight-through estimator: input ``i`` gets output ``i``'s gradient.

  Inputs with no output of the same index, dtype and compatible shape (a
  ``FakeQuant`` op's ``min``/``max``) get ``None``: the identity backward of
  ``gradient_override_map({"Round": "Identity"})``.
  """
  out = []
  for i, t in enumerate(op.inputs):
    g = grads[i] if i < len(grads) else None
    ok = (g is not None and t.dtype == op.outputs[i].dtype
          and t.shape.is_compatible_with(op.outputs[i].shape))
    out.append(g if ok else None)
  return out


class Overrides:
  """The overrides declared on one plan, by op name and by op type."""

  def __init__(self):
    self._by_name: Dict[str, GradFn] = {}
    self._by_type: Dict[str, GradFn] = {}

  def __bool__(self) -> bool:
    return bool(self._by_name or self._by_type)

  def __repr__(self) -> str:
    return repr(sorted(self._by_name) + sorted(self._by_type))

  def declare(self, loss: tf.Tensor, sources, op, fn: GradFn,
              method: str) -> None:
    """Records ``fn`` for ``op`` (an Operation, an op name or an op type).

    Raises:
      GraphGradError: if ``fn`` is not callable, ``op`` names nothing on the
        loss's backward path, or already has an override.
      NotConnectedError: if ``op`` is not on the loss's backward path.
    """
    if not callable(fn):
      raise _errors.GraphGradError(
          f"{method}: `fn` must be a callable fn(op, *output_grads) -> one "
          f"gradient per input of op, like a function registered with "
          f"tf.RegisterGradient; got {type(fn).__name__}.")
    path = ops_on_path(loss, sources)
    key, store = self._key(loss, path, op, method)
    if key in store:
      raise _errors.GraphGradError(
          f"{method}: {key!r} already has a backward pass in this plan; an "
          f"op's gradient is overridden once. Make a new GradientPlan to try "
          f"another.")
    store[key] = fn

  def _key(self, loss, path, op, method):
    if isinstance(op, tf.Operation):
      if op.graph is not loss.graph:
        raise _errors.GraphGradError(
            f"{method}: the op {op.name} belongs to another tf.Graph than the "
            f"loss {loss.name}. Pass an op of the loss's graph.")
      if op not in path:
        raise _not_on_path(method, op.name, loss, path)
      return op.name, self._by_name
    if not isinstance(op, str):
      raise _errors.GraphGradError(
          f"{method}: `op` must be a tf.Operation, an op name or an op type "
          f"(str); got {type(op).__name__}.")
    if any(o.type == op for o in path):
      return op, self._by_type
    try:
      found = loss.graph.get_operation_by_name(op)
    except (KeyError, ValueError):
      found = None
    if found is None:
      types = sorted({o.type for o in path})
      raise _errors.GraphGradError(
          f"{method}: {op!r} is neither an op name of the loss's graph nor "
          f"the type of an op on the backward path of {loss.name}. Types on "
          f"that path: {', '.join(types)}.")
    if found not in path:
      raise _not_on_path(method, op, loss, path)
    return op, self._by_name

  def resolve(self, loss: tf.Tensor, sources,
              layer_of: Callable[[tf.Operation], Optional[str]]
              ) -> Dict[str, GradFn]:
    """Maps each overridden op on the loss's path to its ``fn``.

    Raises:
      GraphGradError: if an op without a gradient is left without one.
      UnsupportedGraphError: for an overridden op inside a loop or cond.
    """
    path = ops_on_path(loss, sources)
    found = {}
    for op in path:
      fn = self._by_name.get(op.name, self._by_type.get(op.type))
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


def _not_on_path(method, name, loss, path) -> _errors.NotConnectedError:
  return _errors.NotConnectedError(
      f"{method}: the op {name} is not on the backward path of {loss.name} "
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
      f"tf.gradients would stop with LookupError: {listed}. Give each one a "
      f"backward pass in this plan: plan.straight_through(op) for the "
      f"identity (the straight-through estimator), or "
      f"plan.override_gradient(op, fn) with fn(op, *output_grads) -> input "
      f"grads; `op` is the op, its name, or its type ({ops[0].type!r}).")


def _input_grads(op: tf.Operation, fn: GradFn, grads) -> List:
  """Calls ``fn`` and checks one gradient per input, of the input's shape."""
  with tf.name_scope(op.name.replace("/", "_") + "_override"):
    out = fn(op, *grads)
  if not isinstance(out, (list, tuple)):
    out = [out]
  name = "straight_through" if fn is straight_through else "override_gradient"
  if len(out) != len(op.inputs):
    raise _errors.IncompatibleGradientError(
        f"{name}: fn returned {len(out)} gradient(s) for {op.name}, which has "
        f"{len(op.inputs)} input(s). Return one gradient (or None) per "
        f"input, in order.")
  checked = []
  for t, g in zip(op.inputs, out):
    if g is not None:
      dense = g.values if isinstance(g, tf.IndexedSlices) else g
      dense = tf.convert_to_tensor(dense)
      if dense.dtype != t.dtype or (not isinstance(g, tf.IndexedSlices)
                                    and not dense.shape.is_compatible_with(
                                        t.shape)):
        raise _errors.IncompatibleGradientError(
            f"{name}: the gradient fn returned for the input {t.name} of "
            f"{op.name} has shape {dense.shape} {dense.dtype.name}; the input "
            f"has shape {t.shape} {t.dtype.name}. Return a gradient of each "
            f"input's shape and dtype.")
      g = dense if not isinstance(g, tf.IndexedSlices) else g
    checked.append(g)
  if fn is straight_through and not any(g is not None for g in checked):
    raise _errors.GraphGradError(
        f"straight_through: no input of {op.name} (type {op.type}) matches an "
        f"output of the same index in dtype and shape, so the identity has "
        f"nowhere to send the gradient. Use plan.override_gradient(op, fn).")
  return checked


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
    floor = min(x.op._id for x in xs)  # pylint: disable=protected-access
  cut = [op for op in ops_on_path(ys, xs, stops, floor)
         if op.name in overrides]
  if not cut:
    return tf.compat.v1.gradients(ys, xs, grad_ys=grad_ys,
                                  stop_gradients=stops, **options)
  cut.sort(key=lambda o: -o._id)  # pylint: disable=protected-access
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
    pairs = [(t, g) for t, g in zip(op.inputs, _input_grads(
        op, overrides[op.name], grads)) if g is not None]
    if pairs:
      run([t for t, _ in pairs],
          [tf.convert_to_tensor(g) for _, g in pairs],
          [t for below in cut[k + 1:] for t in outs[below.name]])
  return [aggregate(gs, like=x) for gs, x in zip(x_grads, xs)]
