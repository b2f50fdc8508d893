"""Which optimizers can apply a plan's gradients in a tf.compat.v1 graph.

The train op of ``GradientPlan.apply_gradients`` must update the variables:

* ``tf.compat.v1.train.Optimizer`` and its wrappers (``SyncReplicasOptimizer``,
  Horovod's, ``gg.AfterAggregation``) are called as they are;
* one that ignores ``global_step`` (BERT's), and tf-keras' legacy
  ``OptimizerV2``, get the step incremented after their update;
* the newer Keras optimizers (tf-keras' and Keras 3's) rely on the automatic
  control dependencies of ``tf.function``, so they run inside one, whose
  call op is the train op; their variables live in the tf.Graph;
* refused: an optimizer class, an object without ``apply_gradients``, and
  a wrapper acting in ``compute_gradients`` (Horovod, DP, PCGrad), which a
  plan never calls.
"""

import logging
from typing import List, Optional

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import GradsAndVars
from graphgrad.analysis import _graph_util

_FIX = ("Pass an optimizer instance, e.g. "
        "tf.compat.v1.train.AdamOptimizer(1e-3) or "
        "tf.keras.optimizers.SGD(0.1).")

log = logging.getLogger("graphgrad")

V1, KERAS_V2, KERAS, OTHER = "v1", "keras_v2", "keras", "other"

# Wrappers whose compute_gradients hands back the gradients of the optimizer
# they wrap unchanged: the aggregation (or the loss scaling, which the plan
# applies itself) happens in apply_gradients.
_PASS_THROUGH = (tf.compat.v1.train.SyncReplicasOptimizer,
                 tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer)


def _is_keras(cls) -> bool:
  return any(c.__module__.split(".")[0] in ("keras", "tf_keras")
             for c in cls.__mro__)


def _is_v2(cls) -> bool:
  return _is_keras(cls) and any(c.__name__ == "OptimizerV2"
                                for c in cls.__mro__)


def check_optimizer(optimizer) -> str:
  """Refuses an optimizer that cannot take a step in a TF1 graph.

  Args:
    optimizer: what was passed as ``optimizer``.

  Returns:
    ``"v1"`` for a ``tf.compat.v1.train.Optimizer``, ``"keras_v2"`` for a
    tf-keras legacy ``OptimizerV2``, ``"keras"`` for a newer tf-keras or
    Keras 3 optimizer, ``"other"`` for another object with an
    ``apply_gradients(grads_and_vars, global_step, name)`` method.

  Raises:
    GraphGradError: for a class, or an object without ``apply_gradients``.

  Example:
    >>> check_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    'v1'
    >>> check_optimizer(tf.compat.v1.train.AdamOptimizer)
    Traceback (most recent call last):
    ...
    graphgrad._errors.GraphGradError: `optimizer` must be an optimizer instance;
    got the class AdamOptimizer. Create one: AdamOptimizer(learning_rate=...).
  """
  if isinstance(optimizer, type):
    raise _errors.GraphGradError(
        f"`optimizer` must be an optimizer instance; got the class "
        f"{optimizer.__name__}. Create one: "
        f"{optimizer.__name__}(learning_rate=...).")
  if isinstance(optimizer, tf.compat.v1.train.Optimizer):
    _check_gradient_step(optimizer)
    return V1
  cls = type(optimizer)
  if _is_v2(cls):
    return KERAS_V2
  if _is_keras(cls) and callable(getattr(optimizer, "apply_gradients", None)):
    return KERAS
  if not callable(getattr(optimizer, "apply_gradients", None)):
    raise _errors.GraphGradError(
        f"`optimizer` must have an apply_gradients(grads_and_vars, "
        f"global_step, name) method, like tf.compat.v1.train.AdamOptimizer; "
        f"got {cls.__name__}. {_FIX}")
  _check_gradient_step(optimizer)
  return OTHER


def _check_gradient_step(optimizer) -> None:
  """Refuses an optimizer whose class does its own work in
  ``compute_gradients``, which a plan never calls.

  Raises:
    GraphGradError: naming the class and what to declare instead.
  """
  owner = next((c for c in type(optimizer).__mro__
                if "compute_gradients" in vars(c)), None)
  if (owner is None or owner is tf.compat.v1.train.Optimizer
      or issubclass(owner, _PASS_THROUGH)
      or owner.__module__.split(".")[0] == "graphgrad"):
    return
  cls = type(optimizer)
  raise _errors.GraphGradError(
      f"`optimizer` {cls.__module__}.{cls.__name__} overrides "
      f"compute_gradients (in {owner.__name__}), which a plan never calls: "
      f"the plan computes the gradients itself and calls only "
      f"apply_gradients, so that method's work would be skipped. Declare "
      f"it in the plan and apply with the optimizer it wraps: for an "
      f"all-reduce (Horovod's DistributedOptimizer), "
      f"gg.GradientPlan(loss, reduce_fn=...); for a differential-privacy "
      f"optimizer, plan.privatize(l2_norm_clip, noise_multiplier); for "
      f"PCGrad, plan.combine_tasks(layers, losses, gg.mtl.pcgrad(), "
      f"at=\"parameters\"). Wrappers that act in apply_gradients "
      f"(SyncReplicasOptimizer, gg.AfterAggregation) are accepted.")


def update_ops_of(graph: tf.Graph, update_ops=None) -> List[tf.Operation]:
  """``update_ops`` as ops; ``None`` gives the tf.Graph's ``UPDATE_OPS``.

  Example:
    >>> with tf.Graph().as_default() as g:
    ...   v = tf.Variable(0.0)
    ...   tf.compat.v1.add_to_collection("update_ops", v.assign(1.0))
    ...   print([op.type for op in update_ops_of(g)], update_ops_of(g, []))
    ['AssignVariableOp'] []
  """
  if update_ops is None:
    update_ops = graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  return [u if isinstance(u, tf.Operation) else u.op for u in update_ops]


def apply(optimizer, grads_and_vars: GradsAndVars, global_step=None,
          name: Optional[str] = None):
  """Checks ``optimizer`` and builds its update of ``grads_and_vars``.

  Args:
    optimizer: as for :func:`check_optimizer`.
    grads_and_vars: ``(gradient, variable)`` pairs.
    global_step: optional variable incremented once per run, after the
      update.
    name: name of the returned op.

  Returns:
    The train op: running it updates the variables (and the step).

  Raises:
    GraphGradError: as :func:`check_optimizer`.

  Example:
    >>> with tf.Graph().as_default():
    ...   w = tf.compat.v1.get_variable("w", initializer=[1.0, 2.0])
    ...   op = apply(tf.compat.v1.train.GradientDescentOptimizer(0.5),
    ...              [(tf.constant([1.0, 1.0]), w)])
    ...   with tf.compat.v1.Session() as s:
    ...     s.run(tf.compat.v1.global_variables_initializer())
    ...     s.run(op)
    ...     print(s.run(w).tolist())
    [0.5, 1.5]
  """
  kind = check_optimizer(optimizer)
  named = {"name": name} if name else {}
  grads_and_vars = list(grads_and_vars)
  if kind in (V1, OTHER):
    graph = (global_step.graph if global_step is not None
             else tf.compat.v1.get_default_graph())
    before = len(graph.get_operations())
    update = optimizer.apply_gradients(grads_and_vars,
                                       global_step=global_step, **named)
    if global_step is None or writes_variable(
        graph.get_operations()[before:], global_step):
      return update
    # BERT's AdamWeightDecayOptimizer takes global_step and ignores it.
    log.info("%s.apply_gradients did not increment global_step %s; the plan "
             "increments it after the update.", type(optimizer).__name__,
             global_step.name)
  elif kind == KERAS_V2:
    update = optimizer.apply_gradients(grads_and_vars)
  else:
    _check_same_graph(optimizer, tf.compat.v1.get_default_graph())
    update = _in_function(optimizer, grads_and_vars)
  if global_step is None:
    return tf.group(update, name=name) if name else update
  # As tf.compat.v1.train.Optimizer does: the step after the update.
  with tf.control_dependencies([update]):
    step = tf.compat.v1.assign_add(global_step, 1, name=name)
  return step if isinstance(step, tf.Operation) else step.op


def writes_variable(ops, variable) -> bool:
  """True when one of ``ops`` assigns to ``variable`` (``AssignAdd``,
  ``AssignVariableOp``, a fused ``Apply*`` kernel...): a structural check,
  without running anything.

  Example:
    >>> with tf.Graph().as_default() as g:
    ...   step = tf.compat.v1.train.get_or_create_global_step()
    ...   n = len(g.get_operations())
    ...   _ = tf.compat.v1.assign_add(step, 1)
    ...   print(writes_variable(g.get_operations()[n:], step))
    True
  """
  target = variable.op
  calls = []
  for op in ops:
    if op.inputs and op.inputs[0].op is target and op.type.startswith(
        _WRITES):
      return True
    if any(t.op is target for t in op.inputs) and any(
        a.func.name for a in op.node_def.attr.values()):
      calls.append(op)  # a v2 cond or a function that takes the variable
  # A v2 cond's branch writes it: apply_if_finite increments the step so.
  return _graph_util.calls_node(calls, lambda t: t.startswith(_WRITES))


_WRITES = ("Assign", "ResourceApply", "Apply", "ScatterAdd",
           "ResourceScatter")


def _check_same_graph(optimizer, graph: tf.Graph) -> None:
  """Refuses a Keras optimizer whose step counter lives in another tf.Graph
  (made there, or in the global graph after ``disable_eager_execution``):
  traced into ``graph``, its update would be an invalid op, and the session
  would fail with "Graph is invalid, contains a cycle".

  Raises:
    GraphGradError: saying where to create the optimizer.
  """
  step = optimizer.iterations  # a tf.Variable, or Keras 3's wrapping one
  step = step if isinstance(step, tf.Variable) else getattr(step, "value",
                                                            step)
  try:
    home = step.graph
  except AttributeError:  # made eagerly: _in_function says so
    return
  if isinstance(home, tf.Graph) and home is not graph and not getattr(
      home, "building_function", False):
    cls = type(optimizer)
    raise _errors.GraphGradError(
        f"`optimizer` {cls.__module__}.{cls.__name__} was created in another "
        f"tf.Graph than the loss's: its step counter {step.name} lives "
        f"there, and the loss's graph cannot use it. Create the optimizer "
        f"inside `with loss.graph.as_default():` (after "
        f"tf.compat.v1.disable_eager_execution(), the global graph is not "
        f"the loss's when the loss was built in a `with tf.Graph()` block).")


def _in_function(optimizer, grads_and_vars) -> tf.Operation:
  """A Keras optimizer's step, traced by tf.function, as one graph op."""
  variables = [v for _, v in grads_and_vars]

  def step(*grads):
    optimizer.apply_gradients(zip(grads, variables))
    return tf.constant(0)  # an output, so that the call op can be returned

  # Gradients are arguments, not captures: tf.function takes IndexedSlices.
  try:
    return tf.function(step, autograph=False)(
        *[g for g, _ in grads_and_vars]).op
  except (RuntimeError, ValueError) as e:
    cls = type(optimizer)
    raise _errors.GraphGradError(
        f"`optimizer` {cls.__module__}.{cls.__name__} could not update the "
        f"variables in the tf.Graph of the gradients ({type(e).__name__}: "
        f"{e}). A Keras optimizer made outside that graph, eagerly or in "
        f"another tf.Graph, holds variables (its learning rate, step "
        f"counter) the graph cannot use: create the optimizer inside "
        f"`with loss.graph.as_default():`.") from e
