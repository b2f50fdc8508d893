"""Parameter-gradient transforms after cross-replica aggregation.

A :class:`~graphgrad.GradientPlan`'s transforms run per replica, before any
wrapper aggregates. Wrappers that aggregate inside ``apply_gradients``
(``tf.compat.v1.train.SyncReplicasOptimizer``) hand the aggregated gradients
to the optimizer they wrap; :class:`AfterAggregation` is such an inner
optimizer, so its transforms see the aggregated gradient::

  inner = gg.AfterAggregation(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                              net).transform_gradients("l2_dense", clip)
  sync = tf.compat.v1.train.SyncReplicasOptimizer(inner, 2)
  train_op = plan.apply_gradients(sync, global_step=global_step)

Only parameter gradients exist after aggregation. A private plan adds its
noise here, once per step, before these transforms (``_sync_privacy``).
"""

from typing import Dict, List

import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.plan import _optimizer, _sync_privacy
from graphgrad.transforms._checks import checked as _checked
from graphgrad.transforms._context import Resources
from graphgrad.transforms._transforms import (
  Transform,
  TransformContext,
  as_transform,
)
from graphgrad.transforms._transforms import compose as _compose


class AfterAggregation(tf.compat.v1.train.Optimizer):
  """An optimizer that rewrites parameter gradients by layer, then applies them.

  Wrapped by an aggregating optimizer (``SyncReplicasOptimizer``), its
  transforms run once, on the chief's aggregated gradients, instead of once
  per replica. Used alone, it behaves like ``plan.transform_gradients``.
  Under a ``SyncReplicasOptimizer`` applying a private plan
  (``plan.privatize``), it first adds the plan's noise to the aggregated
  clipped sums and divides by the global batch
  (:mod:`graphgrad.plan._sync_privacy`): its transforms act after the
  noise.

  Args:
    optimizer: the ``tf.compat.v1.train.Optimizer`` that applies the
      rewritten gradients.
    net: the :class:`LayerGraph` that names the layers.
    name: name scope of the transform ops.

  Raises:
    GraphGradError: if ``optimizer`` cannot apply gradients in a TF1 graph
      (see ``GradientPlan.apply_gradients``) or ``net`` is not a LayerGraph.

  Example:
    >>> import tensorflow as tf, graphgrad as gg
    >>> with tf.Graph().as_default():
    ...   with tf.compat.v1.variable_scope("l1"):
    ...     w = tf.compat.v1.get_variable("w", initializer=[3.0, 4.0])
    ...   loss = tf.reduce_sum(w * w)
    ...   opt = gg.AfterAggregation(
    ...       tf.compat.v1.train.GradientDescentOptimizer(1.0), gg.analyze(loss)
    ...   ).transform_gradients("l1", gg.transforms.clip_by_norm(1.0))
    ...   step = opt.apply_gradients(opt.compute_gradients(loss))
    ...   with tf.compat.v1.Session() as s:
    ...     s.run(tf.compat.v1.global_variables_initializer())
    ...     s.run(step)
    ...     print([round(float(v), 2) for v in s.run(w)])
    [2.4, 3.2]
  """

  def __init__(self, optimizer, net: LayerGraph,
               name: str = "AfterAggregation"):
    _optimizer.check_optimizer(optimizer)
    if not isinstance(net, LayerGraph):
      raise _errors.GraphGradError(
          f"`net` must be a gg.LayerGraph from gg.analyze(loss); got "
          f"{type(net).__name__}. Pass the `net` of your GradientPlan.")
    super().__init__(use_locking=False, name=name)
    self._opt = optimizer
    self._net = net
    self._transforms: Dict[str, List[Transform]] = {}
    self._resources = Resources()

  def transform_gradients(self, layer: str, fn) -> "AfterAggregation":
    """Rewrites ``layer``'s parameter gradients when they are applied.

    Args:
      layer: layer name.
      fn: a transform or a callable ``g -> g`` keeping shape and dtype.

    Returns:
      This optimizer, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is unknown.
      GraphGradError: if ``fn`` is not callable.
    """
    name = self._net[layer].name
    self._transforms.setdefault(name, []).append(as_transform(fn))
    return self

  def compute_gradients(self, *args, **kwargs):
    return self._opt.compute_gradients(*args, **kwargs)

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    """Adds a private plan's noise (under ``SyncReplicasOptimizer``),
    rewrites the gradients of transformed layers, then applies all."""
    out = []
    with tf.name_scope(self.get_name()):
      sync = _sync_privacy.take()
      if sync is not None:
        grads_and_vars = sync.noised(grads_and_vars)
      for g, v in grads_and_vars:
        layer = self._net.layer_of_variable(v)
        fns = self._transforms.get(layer)
        if fns and g is not None:
          ctx = TransformContext(layer=layer, role="gradients", variable=v,
                                 global_step=global_step,
                                 resources=self._resources)
          g = _checked(_compose(fns), g, ctx,
                       f"AfterAggregation.transform_gradients({layer!r}) on "
                       f"{v.name}")
        out.append((g, v))
    return _optimizer.apply(self._opt, out, global_step, name)

  def get_slot(self, *args, **kwargs):
    return self._opt.get_slot(*args, **kwargs)

  def get_slot_names(self, *args, **kwargs):
    return self._opt.get_slot_names(*args, **kwargs)

  def variables(self):
    return self._opt.variables()
