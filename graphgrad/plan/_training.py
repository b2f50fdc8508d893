"""Building and training of a GradientPlan.

compute_gradients, apply_gradients, summaries.

:class:`Training` is the half of :class:`~graphgrad.GradientPlan` that runs
the TF1 executor (:func:`graphgrad.plan._executor.build`) on the plan's
declarations once, and makes the train op and the summaries from its result.
"""

import dataclasses
import logging
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.analysis._graph_mode import check_graph_mode
from graphgrad.analysis._layers import LayerGraph
from graphgrad.plan import _advice, _executor, _loss_scale, _optimizer
from graphgrad.plan._declarations import Declarations
from graphgrad.transforms._context import Resources

log = logging.getLogger("graphgrad")


class Training:
  """compute_gradients, apply_gradients and summaries of a GradientPlan.

  The plan sets ``_loss``, ``_var_list``, ``_declarations``, ``_options``,
  ``_resources``, ``_built`` and ``_warned_adaptive`` and the ``net``
  property.
  """

  _loss: tf.Tensor
  _var_list: Tuple[tf.Variable, ...]
  _declarations: Declarations
  _options: _executor.Options
  _resources: Resources
  _built: Optional[_executor.Built]
  _warned_adaptive: bool

  @property
  def net(self) -> LayerGraph:
    """The plan's layer graph; the plan defines it."""
    raise NotImplementedError

  def compute_gradients(self) -> List[Tuple[Gradient, tf.Variable]]:
    """Builds the plan; returns ``(gradient, variable)`` pairs.

    The list has the order of ``var_list`` (or of the tf.Graph's trainable
    variables), like ``Optimizer.compute_gradients``. A variable the loss
    does not reach gets ``None``.

    Raises:
      GraphGradError: when first called eagerly, inside a ``tf.function``
        or after the tf.Graph was finalized; for an exception a transform
        or replacement raised, naming its declaration and layer.
      IncompatibleGradientError: if a transform changes a shape, dtype or
        tf.Graph.
      UnsupportedGraphError: for an op-graph shape the plan cannot rewrite
        correctly.
    """
    if self._built is None:
      check_graph_mode("GradientPlan.compute_gradients", self._loss)
      self._declarations.freeze()
      self._built = _executor.build(
          self._loss, lambda: self.net, self._var_list, self._declarations,
          self._options, self._resources)
      d = self._declarations
      log.info("graphgrad plan on %s: %d variables, %d upstream, %d "
               "gradient, %d edge transforms", self._loss.name,
               len(self._built.grads_and_vars), len(d.upstream),
               len(d.gradients), len(d.edges))
    return list(self._built.grads_and_vars)

  def apply_gradients(self, optimizer, global_step=None,
                      name: Optional[str] = None,
                      update_ops: Optional[Sequence] = None) -> tf.Operation:
    """Builds the plan and one ``optimizer.apply_gradients`` op.

    Args:
      optimizer: a ``tf.compat.v1.train.Optimizer`` or a wrapper of one,
        a tf-keras or Keras 3 optimizer made in the loss's graph (run inside
        a ``tf.function``, whose call op is then the train op), or anything
        with an ``apply_gradients(grads_and_vars, global_step, name)``.
        A ``tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer``
        is applied as its ``minimize()`` does: the plan backpropagates the
        scaled loss, its transforms see the unscaled gradient (in float32
        where it is float16), and a non-finite step is skipped
        (docs/distributed-keras.md).
      global_step: optional variable to increment once per step. When it is
        ``None`` and a transform of the plan reads the tf.Graph's global step
        (annealed ``add_noise(eta=...)``), that global step is incremented,
        so that the schedule advances with training.
      name: name of the returned op.
      update_ops: ops to run before the update; defaults to the tf.Graph's
        ``UPDATE_OPS`` collection (batch-norm moving averages), as tf-slim's
        ``create_train_op`` does. Pass ``[]`` to run none.

    Returns:
      The train op.

    Raises:
      GraphGradError: if ``optimizer`` is a class, has no
        ``apply_gradients``, or is a Keras optimizer made outside the loss's
        graph; eagerly, inside a ``tf.function`` or for a finalized
        tf.Graph; if no variable has a gradient; or for a loss-scale
        optimizer with task combinations or backward replacements.
    """
    check_graph_mode("GradientPlan.apply_gradients", self._loss)
    _optimizer.check_optimizer(optimizer)
    scale = _loss_scale.loss_scale_of(optimizer)
    if scale is None:
      gv = [(g, v) for g, v in self.compute_gradients() if g is not None]
    else:  # as its minimize(): the gradients of loss * S, then / S
      self._declarations.freeze()
      _loss_scale.check_declarations(self._declarations)
      with self._loss.graph.as_default():
        options = dataclasses.replace(self._options, loss_scale=scale())
      built = _executor.build(self._loss, lambda: self.net, self._var_list,
                              self._declarations, options, self._resources)
      gv = [(g, v) for g, v in _loss_scale.unscale(
          optimizer, built.grads_and_vars) if g is not None]
    if not gv:
      raise _errors.NotConnectedError(
          f"no variable has a gradient from the loss {self._loss.name}; "
          f"variables: {', '.join(v.name for v in self._var_list)}. Check "
          f"that `var_list` holds variables the loss depends on.")
    if not self._warned_adaptive:
      self._warned_adaptive = _advice.warn_if_scale_cancels(self, optimizer)
    graph = self._loss.graph
    if update_ops is None:
      update_ops = graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
    if global_step is None and self._declarations.reads_global_step:
      # An annealed transform reads the global step: the train op advances it.
      global_step = tf.compat.v1.train.get_global_step(graph)
    with graph.as_default():
      with tf.control_dependencies(list(update_ops)):
        return _optimizer.apply(optimizer, gv, global_step, name)

  def summaries(self, histograms: bool = False,
                name: Optional[str] = None) -> tf.Tensor:
    """TensorBoard summaries of what the plan does to gradient norms.

    Adds, under a ``graphgrad/`` name scope, scalar summaries of

    * ``grad_norm/<layer>/before`` and ``.../after``: the global norm of each
      layer's parameter gradients before and after its
      ``transform_gradients`` (equal for a layer without them);
    * ``upstream_norm/<layer>/before`` and ``.../after``: the norm of the
      gradient at the outputs of every layer with ``transform_upstream``;
    * ``edge_norm/<lower>_to_<upper>/before`` and ``.../after``: the norm of
      the gradient along every transformed edge;

    and with ``histograms=True`` a histogram of each final parameter
    gradient. Builds the plan if it is not built yet.

    Args:
      histograms: also add gradient histograms.
      name: name scope; defaults to the plan's (``"graphgrad"``).

    Returns:
      The merged summary op (a string tensor) for ``FileWriter.add_summary``.
      The summaries are also added to the tf.Graph's ``SUMMARIES`` collection.

    Raises:
      IncompatibleGradientError, UnsupportedGraphError: as
        :meth:`compute_gradients`.

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> with tf.Graph().as_default():
      ...   plan = gg.GradientPlan(gg.demo.two_layer_loss())
      ...   plan = plan.transform_upstream("l2", gg.transforms.scale(0.5))
      ...   op = plan.summaries()
      ...   with tf.compat.v1.Session() as s:
      ...     s.run(tf.compat.v1.global_variables_initializer())
      ...     summary = tf.compat.v1.Summary.FromString(s.run(op))
      >>> for v in summary.value:
      ...   print(v.tag, round(v.simple_value, 3))
      graphgrad/grad_norm/l1/before 3.354
      graphgrad/grad_norm/l1/after 3.354
      graphgrad/grad_norm/l2/before 3.0
      graphgrad/grad_norm/l2/after 3.0
      graphgrad/upstream_norm/l2/before 1.0
      graphgrad/upstream_norm/l2/after 0.5
    """
    from graphgrad.plan import _summaries  # pylint: disable=g-import-not-at-top
    self.compute_gradients()
    return _summaries.build(self, histograms=histograms,
                            name=name or self._options.name)
