"""Backward passes for ops inside one plan: override_gradient, straight_through.

A plan's override gives an op a gradient function for this plan's backward
pass only: TensorFlow's gradient registry, the op's attributes and every
other ``tf.gradients`` call on the graph are untouched, which
``gradient_override_map`` cannot promise; ops of imported graphs work too.
GradientPlan declares overrides through its mixin :class:`OpOverriding`.
This module resolves and checks the overridden ops (:func:`substitutions`);
the plan's VJP substitutes each ``fn`` for the registered gradient function
in every call that crosses its op (``_backprop.hooked``), so the gradient at
an overridden op's outputs, summed over its consumers in that call, goes through
``fn`` to its inputs. It also words the error for ops without a gradient.
"""

import collections
import dataclasses
import functools
from typing import (
  Callable,
  Dict,
  FrozenSet,
  List,
  Optional,
  Sequence,
  Tuple,
  TypeVar,
)

import tensorflow as tf

from graphgrad import _errors, _installed
from graphgrad.analysis import _lost_overrides
from graphgrad.analysis._no_gradient import ops_on_path, ops_without_gradient
from graphgrad.core._declaration_model import Declarations
from graphgrad.core._gradients import input_grads, straight_through
from graphgrad.plan._backprop import hooks_available

GradFn = Callable[..., object]

_P = TypeVar("_P", bound="OpOverriding")


class OpOverriding:
  """``override_gradient`` and ``straight_through`` of a GradientPlan.

  The plan sets ``_loss``, ``_var_list`` and ``_declarations``.
  """

  _loss: tf.Tensor
  _var_list: Tuple[tf.Variable, ...]
  _declarations: Declarations

  def override_gradient(self: _P, op, fn) -> _P:
    """Gives ``op`` the backward pass ``fn`` inside this plan only.

    In every ``tf.gradients`` call of the plan that crosses the op, ``fn``
    takes the place of its registered gradient function (or of none): the
    gradient at its outputs (summed over all consumers, after every rewrite
    above it) goes through ``fn`` to its inputs, and backpropagation
    continues below. TensorFlow's gradient registry and the op's attributes
    are not changed, so other ``tf.gradients`` calls on the graph are
    unaffected; ops of imported graphs, and ops inside ``tf.compat.v1``
    loops, work alike. Every other declaration composes with it.

    Args:
      op: a ``tf.Operation``, an op name, or an op type (``"Round"``): a
        type applies to every op of that type on the loss's backward path.
        A string that is the type of an op on that path is a type.
      fn: ``fn(op, *output_grads) -> input grads``, the signature of a
        function registered with ``tf.RegisterGradient``: one gradient (or
        None) per input of ``op``.

    Returns:
      The plan, for chaining.

    Raises:
      NotConnectedError: if ``op`` is not on the loss's backward path.
      GraphGradError: if ``op`` names nothing there, already has an
        override, ``fn`` is not callable, or the plan is built; when the
        plan is built, on a TensorFlow whose gradient lookup fails
        graphgrad's self-test.

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> with tf.Graph().as_default():
      ...   with tf.compat.v1.variable_scope("l1"):
      ...     w = tf.compat.v1.get_variable("w", initializer=[0.4, 1.6])
      ...   with tf.compat.v1.variable_scope("l2"):
      ...     y = tf.round(w) * tf.compat.v1.get_variable("v", initializer=3.0)
      ...   plan = gg.GradientPlan(tf.reduce_sum(y))
      ...   plan = plan.override_gradient("Round", lambda op, g: 0.5 * g)
      ...   gv = plan.compute_gradients()
      ...   with tf.compat.v1.Session() as s:
      ...     s.run(tf.compat.v1.global_variables_initializer())
      ...     print([s.run(g).tolist() for g, _ in gv])
      [[1.5, 1.5], 2.0]
    """
    return self._override(op, fn, "override_gradient")

  def straight_through(self: _P, op) -> _P:
    """Gives ``op`` an identity backward pass (the straight-through estimator).

    ``override_gradient(op, fn)`` with ``fn`` passing each output's gradient
    to the input of the same index (``None`` to inputs without one, such as
    a ``FakeQuant`` op's ``min`` and ``max``): what
    ``gradient_override_map({"Round": "Identity"})`` gives, for this plan
    only.

    Args:
      op: a ``tf.Operation``, an op name, or an op type (``"Round"``).

    Returns:
      The plan, for chaining.

    Raises:
      GraphGradError: as :meth:`override_gradient` raises it.
    """
    return self._override(op, straight_through, "straight_through")

  def _override(self: _P, op, fn, caller: str) -> _P:
    if self._declarations.frozen:
      raise _errors.GraphGradError(
          f"{caller}: this plan is already built (compute_gradients or "
          f"apply_gradients was called); declare every override before "
          f"building, or make a new GradientPlan.")
    key = resolve_op(self._loss, self._var_list, op, caller)
    self._declarations.add_override(key, fn, caller)
    return self


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
  """
  by_name = {k: fn for (m, k), fn in overrides.items() if m == "name"}
  by_type = {k: fn for (m, k), fn in overrides.items() if m == "type"}
  found = {}
  for op in ops_on_path(loss, sources):
    fn = by_name.get(op.name, by_type.get(op.type))
    if fn is None:
      continue
    found[op.name] = fn
  missing = [op for op in ops_without_gradient(loss, sources)
             if op.name not in found]
  if missing:
    raise no_gradient_error(loss, missing, layer_of)
  return found


@dataclasses.dataclass(frozen=True)
class Substitutions:
  """The overridden ops on a plan's backward path, as the engine takes them.

  Attributes:
    fns: op name -> the checked gradient function that replaces the
      registered one in every segment call crossing the op.
    linear: the names of the ops whose function is linear in the gradient
      (``straight_through``): a linear factor may be moved past them.
  """
  fns: Dict[str, GradFn] = dataclasses.field(default_factory=dict)
  linear: FrozenSet[str] = frozenset()


def substitutions(loss: tf.Tensor, sources,
                  overrides: Dict[Tuple[str, str], GradFn],
                  layer_of: Callable[[tf.Operation], Optional[str]]
                  ) -> Substitutions:
  """The plan's overridden ops on the loss's path, with their functions.

  Raises:
    GraphGradError: as :func:`on_path`, and for an override on a
      TensorFlow whose gradient lookup fails graphgrad's self-test.
  """
  found = on_path(loss, sources, overrides, layer_of) if overrides else {}
  if found and not hooks_available():
    raise _errors.GraphGradError(
        f"TensorFlow {tf.__version__} fails graphgrad's self-test of its "
        f"gradient-function lookup (see the logged warning), through which a "
        f"plan gives the ops {', '.join(sorted(found))} their overridden "
        f"backward pass. Install a tested TensorFlow "
        f"({_installed.OLDEST[0]}.{_installed.OLDEST[1]} to "
        f"{_installed.NEWEST[0]}.{_installed.NEWEST[1]}), or "
        f"build those ops with gradient_override_map instead of "
        f"override_gradient / straight_through.")
  return Substitutions(
      {name: functools.partial(_checked, fn) for name, fn in found.items()},
      frozenset(n for n, fn in found.items() if fn is straight_through))


def _checked(fn: GradFn, op: tf.Operation, *grads) -> List:
  return input_grads(op, fn, grads)


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
