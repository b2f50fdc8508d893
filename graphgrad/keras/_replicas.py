"""Parameter transforms on the all-reduced gradient, under ``tf.distribute``.

Inside ``strategy.run`` each replica backpropagates its own examples, and the
gradients a plan tape returns are that replica's *contribution*: summed over
the replicas, as every Keras optimizer does in ``apply_gradients``, they give
the plan's gradients for the global batch. For a variable whose parameter
transform is not linear (a clip, a group transform, noise),
:func:`transform_parameters` first sums the variable's gradient over the
replicas (``ReplicaContext.all_reduce``), transforms the sum, and lets the
first replica contribute the result while the others contribute zeros: the
optimizer's own sum then gives exactly the transformed global gradient, for
any number of replicas, and random transforms are drawn once. Every other
gradient passes unreduced, for the optimizer to sum as usual.
"""

from typing import Callable, List, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad.core._rules import ParameterRule
from graphgrad.keras._layer_index import tf_variable

# Strategies whose replicas do not all-reduce gradients in replica context
# (ParameterServerStrategy applies each worker's own, TPUStrategy is untested).
_REFUSED: Tuple[Tuple[str, Tuple[type, ...]], ...] = (
    ("ParameterServerStrategy", (
        tf.distribute.experimental.ParameterServerStrategy,
        tf.compat.v1.distribute.experimental.ParameterServerStrategy)),
    ("TPUStrategy", (
        tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy,
        tf.compat.v1.distribute.experimental.TPUStrategy)),
)

_WHY = {
    "ParameterServerStrategy": (
        "its workers apply their own gradients to the variables on the "
        "parameter servers, each on its own, and never all-reduce them, so "
        "a parameter transform could not see the global gradient"),
    "TPUStrategy": (
        "a plan's layer interception and all-reduce are not tested under "
        "TPU replication, and graphgrad refuses to risk a wrong gradient"),
}


def check_strategy(strategy) -> None:
  """Refuses a strategy a plan does not support (see ``_REFUSED``).

  Args:
    strategy: a ``tf.distribute.Strategy``, e.g. the current one.

  Raises:
    GraphGradError: for ``ParameterServerStrategy`` and ``TPUStrategy``,
      saying why and what to use instead.
  """
  for name, classes in _REFUSED:
    if isinstance(strategy, classes):
      raise _errors.GraphGradError(
          f"KerasPlan does not support {name} (got "
          f"{type(strategy).__name__}): {_WHY[name]}. Train the plan under "
          f"tf.distribute.MirroredStrategy or MultiWorkerMirroredStrategy, "
          f"where parameter transforms act on the all-reduced gradient, or "
          f"with tf.compat.v1 between-graph replication and a GradientPlan "
          f"(docs/distributed.md).")


def replicas_in_sync() -> int:
  """How many replicas the current step's gradients are summed over.

  1 outside ``strategy.run`` (the default strategy, or cross-replica
  context), else ``num_replicas_in_sync``.

  Raises:
    GraphGradError: under a strategy :func:`check_strategy` refuses.
  """
  check_strategy(tf.distribute.get_strategy())
  ctx = tf.distribute.get_replica_context()
  return 1 if ctx is None else int(ctx.num_replicas_in_sync)


def needs_sum(fns: Sequence) -> bool:
  """Whether transforms ``fns`` must see the sum over replicas.

  A linear transform ``c * g`` gives the same sum whether it acts on each
  replica's gradient or on their sum, so it acts per replica.
  """
  return any(fn.linear_factor is None for fn in fns)


def _dense(g):
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _first_replica_only(g, ctx):
  first = tf.equal(ctx.replica_id_in_sync_group, 0)
  return tf.where(first, g, tf.zeros_like(g))


def transform_parameters(sources, grads, todo: Sequence[ParameterRule],
                         transform: Callable, own_variables: Callable,
                         name: str):
  """Applies the parameter transforms ``todo`` to ``grads``, replica-aware.

  Args:
    sources: what the gradients are of (a structure of variables/tensors).
    grads: the replica's gradients, in the structure of ``sources``.
    todo: the parameter rules, in the order they act.
    transform: ``(flat_sources, flat_grads) -> flat_grads``, which applies
      them (``graphgrad.core._parameters``).
    own_variables: ``path -> [tf.Variable]``, the layer's variables.
    name: the name scope of the ops added.

  Returns:
    The gradients in the structure of ``grads``: with one replica, the
    transformed gradients; with several, this replica's contribution to
    their sum (see the module docstring).

  Raises:
    GraphGradError: under a strategy :func:`check_strategy` refuses.
  """
  count = replicas_in_sync()
  if not todo:
    return grads
  flat_s = tf.nest.flatten(sources)
  flat_g = tf.nest.flatten(grads)
  with tf.name_scope(name):
    summed: List[int] = []
    if count > 1:
      by_layers: dict = {}
      for rule in todo:
        by_layers.setdefault(rule.layers, []).append(rule.transform)
      refs = {v.ref() for layers, fns in by_layers.items() if needs_sum(fns)
              for path in layers for v in own_variables(path)}
      for i, s in enumerate(flat_s):
        v = tf_variable(s)
        if v is not None and v.ref() in refs and flat_g[i] is not None:
          summed.append(i)
    if summed:
      ctx = tf.distribute.get_replica_context()
      with tf.name_scope("all_reduce"):
        total = ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                               [_dense(flat_g[i]) for i in summed])
      for i, g in zip(summed, total):
        flat_g[i] = g
    flat_g = list(transform(flat_s, flat_g))
    if summed:
      ctx = tf.distribute.get_replica_context()
      for i in summed:
        if flat_g[i] is not None:
          flat_g[i] = _first_replica_only(_dense(flat_g[i]), ctx)
  return tf.nest.pack_sequence_as(grads, flat_g)
