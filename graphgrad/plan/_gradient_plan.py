"""GradientPlan: declarative gradient rewrites, built as one backward pass.

The declaring methods, shared with KerasPlan (``core._declaring``), record
each declaration in the plan's
:class:`~graphgrad.core._declaration_model.Declarations`; the plan's hooks
check what only a ``tf.Graph`` plan can check (the layer has a
floating-point output, the layer-graph edge exists; the rest in
:mod:`graphgrad.plan._declaration_checks`). The training methods'
declarations come from the mixin ``TrainingMethods``
(``_training_methods``), the op overrides from ``OpOverriding``
(``_op_override``). :meth:`~GradientPlan.compute_gradients` builds them once
with :func:`graphgrad.plan._executor.build`; the train op, the summaries and
the picture are made from that result.
"""

import dataclasses
import logging
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.analysis import _draw
from graphgrad.analysis._analyze import analyze
from graphgrad.analysis._graph_mode import check_graph_mode
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.core._declaration_model import Declarations
from graphgrad.core._layer_step import TraceRecord
from graphgrad.core._privacy import check_per_example_loss
from graphgrad.core._rules import CompiledRules, PlanRules
from graphgrad.plan import (
  _advice,
  _arguments,
  _declaration_checks,
  _executor,
  _loss_scale_optimizer,
  _optimizer,
  _picture,
  _recompute,
  _summaries,
  _sync_privacy,
)
from graphgrad.plan._executor import GATE_GRAPH, GATE_NONE, GATE_OP
from graphgrad.plan._op_override import OpOverriding
from graphgrad.plan._training_methods import TrainingMethods
from graphgrad.transforms._context import Resources

log = logging.getLogger("graphgrad")

__all__ = ["GATE_GRAPH", "GATE_NONE", "GATE_OP", "GradientPlan"]


class GradientPlan(TrainingMethods, OpOverriding):
  """Rewrites gradients at layer boundaries, then trains with one op.

  A plan is declared, then built once, on the first call to
  :meth:`compute_gradients` or :meth:`apply_gradients`.

  Semantics: see docs/concepts.md, "The semantics, exactly" (the
  documentation site's Concepts page).

  Args:
    loss: a floating-point tensor of a ``tf.Graph``.
    net: the :class:`LayerGraph` of ``loss``; analysed when ``None``.
    var_list: variables to differentiate, as for
      ``Optimizer.compute_gradients``; defaults to the tf.Graph's trainable
      variables. Variables the loss does not reach get ``None``.
    gate_gradients: ``GATE_NONE`` (0), ``GATE_OP`` (1) or ``GATE_GRAPH`` (2),
      as for ``Optimizer.compute_gradients``.
    aggregation_method: passed to ``tf.gradients``.
    colocate_gradients_with_ops: passed to ``tf.gradients``.
    name: name scope for the ops graphgrad adds.
    reduce_fn: the cross-replica reduction of a wrapper that acts in
      ``compute_gradients`` (Horovod's ``allreduce``): a callable taking a
      list of ``(gradient, variable)`` pairs and returning the reduced
      gradients, in order. It is called once per backward segment (one
      ``tf.gradients`` call) with the parameter gradients that segment
      produced, or once with all of them when the plan needs no cut. It must
      be linear (a sum or mean over replicas): a variable reached by several
      segments gets the sum of its reduced contributions. Parameter
      gradients are reduced before ``transform_gradients``, so those
      transforms see the global gradient. Upstream and edge gradients are
      never reduced: they belong to this replica's own examples, and upstream
      transforms act on them per replica. Under ``privatize`` each replica
      clips its own examples, and one more pair in the same call carries a
      float32 vector of its batch size, ``1.0`` and random words for the
      noise's key; its variable is ``dp_replica_stats``, a non-trainable
      local variable of that vector's shape made for the pairing and never
      read, so a reducer that names, shapes or casts by the variable works.
      From the reduced ``1.0`` the plan tells a sum (``replicas``) from a
      mean (``1``), checked when run, and recovers the global clipped sum
      and batch size; every replica then draws the same noise, seeded by
      the bits of the reduced words (which an all-reduce gives every
      replica alike) or by ``seed``, so the global batch gets one draw.
    replicas: the number of replicas ``reduce_fn`` reduces over (Horovod:
      ``hvd.size()``), a positive int; needed by ``privatize`` with a
      ``reduce_fn``, since a mean cannot be told from a sum by its results
      alone, and refused without a ``reduce_fn``.
    loss_scale: a ``tf.compat.v1.mixed_precision.
      MixedPrecisionLossScaleOptimizer`` to train with, or ``None``. The
      plan then builds what its ``minimize()`` builds: it backpropagates the
      scaled loss, its transforms see the unscaled gradient (in float32
      where it is float16), and :meth:`compute_gradients` returns the
      unscaled gradients, the very tensors :meth:`apply_gradients` hands to
      that optimizer, which skips a non-finite step (docs/distributed-
      keras.md). :meth:`apply_gradients` with that optimizer on a plan
      not yet built takes it as ``loss_scale``.

  A linear rewrite (``scale``, ``zero``, ``reverse`` with a number) weights
  the one backward pass of its layer by its factor, and runs of such layers
  share one ``tf.gradients`` call; any other rewrite is called on the
  gradient, with a second backward pass.

  Raises:
    GraphGradError: on a malformed argument (a ``loss_scale`` that is not
      a ``MixedPrecisionLossScaleOptimizer``, a ``replicas`` that is not a
      positive int or comes without ``reduce_fn``); eagerly or inside a
      ``tf.function`` (use ``gg.KerasPlan``); for a finalized ``tf.Graph``.

  Example:
    >>> import tensorflow as tf, graphgrad as gg
    >>> with tf.Graph().as_default():
    ...   loss = gg.demo.two_layer_loss()  # sum((x @ w1) * w2), layers l1, l2
    ...   plan = gg.GradientPlan(loss)
    ...   plan = plan.transform_upstream("l2", gg.transforms.scale(0.5))
    ...   gv = plan.compute_gradients()
    ...   with tf.compat.v1.Session() as s:
    ...     s.run(tf.compat.v1.global_variables_initializer())
    ...     print([s.run(g).tolist() for g, _ in gv])
    [[[1.5], [3.0]], 3.0]
  """

  def __init__(self, loss: tf.Tensor, net: Optional[LayerGraph] = None,
               var_list: Optional[Sequence[tf.Variable]] = None,
               gate_gradients: int = GATE_OP,
               aggregation_method=None,
               colocate_gradients_with_ops: bool = False,
               name: str = "graphgrad",
               reduce_fn=None, loss_scale=None,
               replicas: Optional[int] = None):
    check_graph_mode("gg.GradientPlan", loss)
    _arguments.check_net(loss, net)
    _arguments.check_options(gate_gradients, reduce_fn, replicas)
    self._loss = loss
    self._net = net
    self._var_list = tuple(_arguments.check_var_list(loss, var_list))
    self._options = _executor.Options(
        gate_gradients=gate_gradients, aggregation_method=aggregation_method,
        colocate_gradients_with_ops=colocate_gradients_with_ops, name=name,
        reduce_fn=reduce_fn, replicas=replicas)
    self._declarations = Declarations(
        lambda layer, arg: self.net.lookup(layer, arg), owner="GradientPlan")
    self._loss_scale = None
    if loss_scale is not None:
      self._take_loss_scale(loss_scale, "gg.GradientPlan: `loss_scale`")
    self._resources = Resources()
    self._built: Optional[_executor.Built] = None
    self._rules = CompiledRules(self._declarations, lambda: self.net)
    self._warned_adaptive = False
    # Set when a SyncReplicasOptimizer applies a private plan.
    self._sync: Optional[_sync_privacy.SyncPrivacy] = None

  # -- read-only accessors -------------------------------------------------

  @property
  def loss(self) -> tf.Tensor:
    """The plan's loss."""
    return self._loss

  @property
  def net(self) -> LayerGraph:
    """The plan's :class:`LayerGraph` (analysed on first use)."""
    if self._net is None:
      self._net = analyze(self._loss)
    return self._net

  @property
  def layer_names(self) -> Tuple[str, ...]:
    """Every layer's name, in the layer graph's order."""
    return self.net.names

  @property
  def var_list(self) -> Tuple[tf.Variable, ...]:
    """The variables the plan differentiates, in output order."""
    return self._var_list

  @property
  def name(self) -> str:
    """The name scope of the ops the plan adds."""
    return self._options.name

  @property
  def declarations(self) -> Declarations:
    """Everything declared, in order (read-only accessors)."""
    return self._declarations

  @property
  def rules(self) -> PlanRules:
    """The declarations, compiled (``graphgrad.core._rules``): what the
    plan builds. Compiled once for each state of the declarations: on the
    first read after a declaration (or the loss scale or the
    ``SyncReplicasOptimizer`` that ``apply_gradients`` adopts)."""
    return self._rules.rules()

  @property
  def resources(self) -> Resources:
    """What the plan's transforms and replacements created (feedback
    matrices, synthetic-gradient modules), keyed by ``(layer, name)``;
    filled when the plan is built."""
    return self._resources

  @property
  def trace(self) -> Tuple[TraceRecord, ...]:
    """``(context, before, after)`` of every transform applied when the
    plan was built; empty before."""
    return self._built.trace if self._built is not None else ()

  @property
  def built(self) -> bool:
    """True once :meth:`compute_gradients` has built the plan."""
    return self._built is not None

  def kept_tensors(self) -> List[tf.Tensor]:
    """The tensors the backward pass keeps under :meth:`recompute`.

    Those ``keep`` declared (the layers' outputs and the tensors) or, with
    ``keep=None``, those the plan chose; every other activation between two
    of them is recomputed. Tensors the plan keeps because it reads them (cut
    tensors, task losses) are not listed.

    Returns:
      The kept ``tf.Tensor`` s of the loss's tf.Graph, in forward
      (topological) order, each once.

    Raises:
      GraphGradError: if the plan does not recompute, or is not built yet
        (call :meth:`compute_gradients` first).

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> with tf.Graph().as_default():
      ...   x = tf.ones([2, 3])
      ...   with tf.compat.v1.variable_scope("l1"):
      ...     w = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 3]))
      ...     h = tf.nn.relu(x @ w)
      ...   with tf.compat.v1.variable_scope("l2"):
      ...     v = tf.compat.v1.get_variable("v", initializer=tf.ones([3, 1]))
      ...     loss = tf.reduce_sum(tf.tanh(h @ v))
      ...   plan = gg.GradientPlan(loss).recompute(keep=["l1/Relu:0"])
      ...   _ = plan.compute_gradients()
      ...   [t.name for t in plan.kept_tensors()]
      ['l1/Relu:0']
    """
    if self._declarations.recompute is None:
      raise _errors.GraphGradError(
          "kept_tensors: this GradientPlan does not recompute, so it keeps "
          "every activation. Declare plan.recompute(keep=...) first.")
    if self._built is None:
      raise _errors.GraphGradError(
          "kept_tensors: this GradientPlan is not built yet, so the tensors "
          "it keeps are not chosen. Call plan.compute_gradients() (or "
          "apply_gradients) first.")
    return list(self._built.kept)

  # -- checks of the declarations (core._declaring's hooks) ---------------

  def _keep_reader(self):
    reader = []

    def read(item):
      if not reader:
        reader.append(_recompute.keep_reader(self.net))
      name = reader[0](item)
      return ("layer", item) if name is None else ("tensor", name)

    return read

  def _check_upstream(self, name: str,
                      method: str = "transform_upstream") -> None:
    _declaration_checks.check_declaration(
        self.net, method, name, then=lambda: (
            _declaration_checks.check_float_output(self.net, name, method)))

  def _check_edge(self, lower: str, upper: str) -> None:
    # Raises with the real neighbours when the layer graph has no edge.
    _declaration_checks.check_declaration(
        self.net, "transform_edge", lower, upper,
        then=lambda: self.net.boundary(lower, upper))

  def _check_first(self, method: str, caller: str) -> None:
    if method == "privatize":
      check_per_example_loss(self._loss, caller)
      if self._options.reduce_fn is not None and self._options.replicas is None:
        raise _errors.GraphGradError(
            f"{caller}: with `reduce_fn` the plan needs `replicas`, the "
            f"number of replicas reduce_fn reduces over, to tell a mean "
            f"from a sum and to recover the global batch; got "
            f"replicas=None. Make the plan with gg.GradientPlan(loss, "
            f"reduce_fn=..., replicas=hvd.size()).")

  # -- building and training ----------------------------------------------

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
    return self._build("GradientPlan.compute_gradients", after=())

  def _build(self, caller: str, after: Sequence[tf.Operation]
             ) -> List[Tuple[Gradient, tf.Variable]]:
    """Builds the plan once, its backward pass waiting for ``after``."""
    if self._built is None:
      check_graph_mode(caller, self._loss)
      self._declarations.freeze()
      rules = self.rules
      self._built = _executor.build(
          self._loss, lambda: self.net, self._var_list, rules,
          dataclasses.replace(self._options, after=tuple(after)),
          self._resources)
      _declaration_checks.warn_without_gradient(
          self.net, self._built.grads_and_vars)
      log.info("graphgrad plan on %s: %d variables, %d upstream, %d "
               "parameter, %d edge transforms", self._loss.name,
               len(self._built.grads_and_vars), len(rules.upstream),
               len(rules.parameters), len(rules.edges))
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
        must be the plan's ``loss_scale``; a plan not yet built takes it as
        such (see the class docstring). A private plan applied with a
        ``SyncReplicasOptimizer`` wrapping a ``gg.AfterAggregation`` is
        built so that each worker pushes its clipped sum, without noise
        (what :meth:`compute_gradients` then returns), and that
        ``AfterAggregation`` adds one noise draw per applied step on the
        chief and divides by the global batch (docs/privacy.md).
      global_step: optional variable to increment once per step. When it is
        ``None`` and a transform of the plan reads the tf.Graph's global step
        (annealed ``add_noise(eta=...)``), that global step is incremented,
        so that the schedule advances with training.
      name: name of the returned op.
      update_ops: ops to run before the backward pass and the update;
        defaults to the tf.Graph's ``UPDATE_OPS`` collection (batch-norm
        moving averages). As with tf-slim's ``create_train_op``, the loss's
        gradient is built after them, so no parameter gradient is alive
        while they run (unless the plan was already built by
        :meth:`compute_gradients`; then only the update waits). Pass ``[]``
        to run none.

    Returns:
      The train op.

    Raises:
      GraphGradError: if ``optimizer`` is a class, has no
        ``apply_gradients``, or is a Keras optimizer made outside the loss's
        graph; eagerly, inside a ``tf.function`` or for a finalized
        tf.Graph; if no variable has a gradient; for a loss-scale
        optimizer with task combinations or backward replacements, or one
        that is not the ``loss_scale`` of a plan already built. For a
        private plan (``privatize``) and a ``SyncReplicasOptimizer``: if
        the optimizer it wraps is not a ``gg.AfterAggregation`` (which adds
        the noise once, on the chief, after aggregation; the train op's ops
        are then already in the tf.Graph), the plan was already built (by
        :meth:`compute_gradients`, summaries or a report), it declares
        ``transform_gradients`` (declare them on the ``AfterAggregation``),
        the batch size is not static and no ``expected_batch_size`` was
        declared, or the plan has a ``reduce_fn``; a private plan built
        for a ``SyncReplicasOptimizer`` refuses any other optimizer.
    """
    check_graph_mode("GradientPlan.apply_gradients", self._loss)
    _optimizer.check_optimizer(optimizer)
    update_ops = _optimizer.update_ops_of(self._loss.graph, update_ops)
    self._check_loss_scale(optimizer)
    self._check_sync(optimizer)
    if self._built is not None and update_ops:
      log.info("graphgrad plan on %s: the backward pass was built before "
               "apply_gradients (by compute_gradients, summaries or a "
               "report), so only the update waits for the %d update ops; "
               "gradients may stay alive while they run. Call "
               "apply_gradients first to build the backward pass after "
               "them.", self._loss.name, len(update_ops))
    gv = [(g, v) for g, v in self._build("GradientPlan.apply_gradients",
                                         after=update_ops)
          if g is not None]
    if not gv:
      raise _errors.NotConnectedError(
          f"no variable has a gradient from the loss {self._loss.name}; "
          f"variables: {', '.join(v.name for v in self._var_list)}. Check "
          f"that `var_list` holds variables the loss depends on.")
    graph = self._loss.graph
    if global_step is None and self.rules.reads_global_step:
      # A transform reads the global step: advance it, so that its schedule
      # advances with training.
      global_step = tf.compat.v1.train.get_global_step(graph)
    before = len(graph.get_operations())
    with graph.as_default(), tf.control_dependencies(update_ops):
      if self._sync is None:
        op = _optimizer.apply(optimizer, gv, global_step, name)
      else:
        with _sync_privacy.pending(self._sync) as taken:
          op = _optimizer.apply(optimizer, gv, global_step, name)
        if not taken():
          _sync_privacy.refuse_missing()
    if not self._warned_adaptive:  # read from the update the optimizer built
      self._warned_adaptive = _advice.warn_if_scale_cancels(
          self.rules, optimizer, graph.get_operations()[before:],
          [g for g, _ in gv])
    return op

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
    return _summaries.build(
        self.compute_gradients(), self.net, self.trace, self._loss.graph,
        histograms=histograms, name=name or self._options.name)

  def _check_sync(self, optimizer) -> None:
    """Makes sure a private plan's build is the one ``optimizer`` needs:
    each worker's clipped sum under a ``SyncReplicasOptimizer``, the noised
    mean otherwise."""
    privacy = self._declarations.privacy
    sync = isinstance(optimizer, tf.compat.v1.train.SyncReplicasOptimizer)
    if privacy is None or (sync and self._sync is not None):
      return
    if sync:
      batch = _sync_privacy.check(
          privacy, self._loss, self._built is not None,
          len(self.rules.parameters), self._options.reduce_fn is not None)
      # Each worker's build is then its clipped sum, without noise.
      self._declarations.add_after_aggregation()
      rule = self.rules.privacy
      assert rule is not None and rule.after_aggregation is not None
      self._sync = _sync_privacy.SyncPrivacy(rule.after_aggregation, batch)
    elif self._sync is not None:
      raise _errors.GraphGradError(
          f"apply_gradients: this private plan was built for a "
          f"SyncReplicasOptimizer: its gradients are each worker's clipped "
          f"sum, without noise, and only that optimizer's gg.AfterAggregation"
          f" adds the noise; `optimizer` is {type(optimizer).__name__}. Make "
          f"another plan to apply with it.")

  # -- loss scaling ----------------------------------------------------------

  def _take_loss_scale(self, optimizer, what: str) -> None:
    scale = _loss_scale_optimizer.loss_scale_of(optimizer, what)
    if scale is None:
      raise _errors.GraphGradError(
          f"{what} must be a tf.compat.v1.mixed_precision."
          f"MixedPrecisionLossScaleOptimizer; got {type(optimizer).__name__} "
          f"{optimizer!r}. Pass the loss-scale optimizer the plan is applied "
          f"with, or None (a Keras LossScaleOptimizer goes to a KerasPlan's "
          f"tape(loss_scale=...)).")
    self._loss_scale = optimizer
    self._declarations.add_loss_scale(scale)

  def _check_loss_scale(self, optimizer) -> None:
    """Makes sure the build is the one ``optimizer`` trains."""
    scaling = _loss_scale_optimizer.is_loss_scale_optimizer(optimizer)
    if optimizer is self._loss_scale or (
        not scaling and self._loss_scale is None):
      return
    if scaling and self._loss_scale is None and self._built is None:
      self._take_loss_scale(optimizer, "apply_gradients: `optimizer`")
      return
    if self._loss_scale is None:
      raise _errors.GraphGradError(
          "apply_gradients: `optimizer` is a MixedPrecisionLossScaleOptimizer,"
          " but compute_gradients() already built this plan without a loss "
          "scale. Make the plan with gg.GradientPlan(..., "
          "loss_scale=optimizer), so that compute_gradients() builds what "
          "apply_gradients trains.")
    raise _errors.GraphGradError(
        f"apply_gradients: this plan backpropagates the loss scaled by the "
        f"MixedPrecisionLossScaleOptimizer it was made with "
        f"(loss_scale={self._loss_scale!r}), but `optimizer` is "
        f"{type(optimizer).__name__} {optimizer!r}. Apply it with that "
        f"optimizer, or make a plan with loss_scale=optimizer.")

  # -- what a declaration can change ---------------------------------------

  def passes_gradient(self, layer: str, method: str = "transform_upstream",
                      upper: Optional[str] = None) -> bool:
    """False when ``method`` on ``layer`` can change nothing below the layer.

    Such a declaration is kept and warns once (see
    :meth:`transform_upstream`). True for the bottom layer, below which
    nothing lies.

    Args:
      layer: layer name (the lower one of an edge).
      method: ``"transform_upstream"``, ``"replace_backward"`` or
        ``"transform_edge"``; any other declaration always acts.
      upper: the upper layer, for ``"transform_edge"``.

    Raises:
      LayerNotFoundError: if ``layer`` is unknown.
    """
    name = self._declarations.resolve(layer, "layer")
    return _declaration_checks.no_gradient_reason(
        self.net, method, name, upper) is None

  # -- pictures ------------------------------------------------------------

  def to_dot(self) -> str:
    """DOT text of the layer graph with this plan's transforms marked.

    :meth:`LayerGraph.to_dot`, with transformed layers filled and labelled
    with their transforms, transformed edges thick, and the edges into a
    layer with ``transform_upstream`` dashed.
    """
    return _draw.to_dot(self.net, _picture.highlights(self.rules))

  def draw(self, path, graphviz: bool = True) -> str:
    """Writes a picture of the layer graph with this plan's transforms marked.

    Args:
      path: file name ending in ``.png``, ``.svg`` or ``.dot``.
      graphviz: as :meth:`LayerGraph.draw`.

    Returns:
      ``path``, as a string.

    Raises:
      GraphGradError: as :meth:`LayerGraph.draw`.
    """
    return _draw.draw(self.net, path, _picture.highlights(self.rules),
                      graphviz=graphviz)

  # -- helpers -------------------------------------------------------------

  def __repr__(self):
    return (f"GradientPlan(loss={self._loss.name}, "
            f"{self._declarations.summary()})")
