"""GradientPlan: declarative gradient rewrites, built as one backward pass.

A thin front: each declaring method checks what only a ``tf.Graph`` plan can
check (the layer has a floating-point output, the layer-graph edge exists,
the replacement can handle the layer, the task losses) and records the
declaration in the plan's :class:`~graphgrad.plan._declarations.Declarations`;
:func:`graphgrad.plan._executor.build` builds them.
"""

from typing import Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util
from graphgrad.analysis._analyze import analyze
from graphgrad.analysis._graph_mode import check_graph_mode
from graphgrad.analysis._layers import LayerGraph
from graphgrad.methods import _pcgrad
from graphgrad.plan import _arguments, _executor
from graphgrad.plan._declarations import Declarations
from graphgrad.plan._executor import GATE_GRAPH, GATE_NONE, GATE_OP, TraceRecord
from graphgrad.plan._override import Overriding
from graphgrad.plan._training import Training
from graphgrad.transforms._context import Resources

__all__ = ["GATE_GRAPH", "GATE_NONE", "GATE_OP", "GradientPlan"]


class GradientPlan(Training, Overriding):
  """Rewrites gradients at layer boundaries, then trains with one op.

  A plan is declared, then built once, on the first call to
  :meth:`compute_gradients` or :meth:`apply_gradients`.

  Semantics:

  * With no transforms, :meth:`compute_gradients` equals
    ``tf.gradients(loss, vars)``, built by the very same single call that
    ``Optimizer.minimize`` makes.
  * ``transform_gradients(L, fn)``: each of ``L``'s parameter gradients ``g``
    (summed over every path) becomes ``fn(g)``.
  * ``transform_upstream(L, fn)``: with ``T`` the outputs of ``L`` and ``g``
    the gradient of the loss at ``T`` (summed over all consumers), ``L``'s own
    variables get their gradients from ``g``; everything below ``L`` gets
    what backpropagating ``fn(g)`` through ``L`` gives. Contributions that
    reach a lower variable by a path that bypasses ``L`` (a skip, a
    regularizer, a second head) are unchanged. Several upstream transforms
    compose top-down: what arrives at a lower layer is computed from the
    already-rewritten gradient above it.
  * ``transform_edge(lower, upper, fn)``: only the gradient ``upper`` sends
    directly into ``lower`` (through glue ops, along the layer-graph edge) is
    rewritten. The order along one path is: ``upper``'s upstream transform,
    then the edge transform, then the sum at ``lower``'s outputs, then
    ``lower``'s upstream transform.
  * Several transforms declared on the same layer (or edge) are chained in
    the order they were declared.
  * ``replace_backward(L, r)``: what ``L`` sends to its inputs is ``r``'s
    result instead of the chain rule; ``L``'s own parameters keep the true
    gradient. ``project_conflicts(L, losses)``: PCGrad on the task gradients
    at ``L``'s outputs, seen by ``L``'s parameters and everything below.
  * ``override_gradient(op, fn)`` / ``straight_through(op)``: the backward
    pass is cut at ``op`` (an op, its name or its type), whose inputs get
    ``fn(op, *output_grads)``, in this plan only.

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
      transforms act on them per replica.

  Raises:
    GraphGradError: on a malformed argument; eagerly or inside a
      ``tf.function`` (use ``gg.KerasPlan``); for a finalized ``tf.Graph``.

  Example:
    >>> import tensorflow as tf, graphgrad as gg
    >>> with tf.Graph().as_default():
    ...   x = tf.constant([[1.0, 2.0]])
    ...   with tf.compat.v1.variable_scope("l1"):
    ...     h = x @ tf.compat.v1.get_variable("w", initializer=[[1.0], [1.0]])
    ...   with tf.compat.v1.variable_scope("l2"):
    ...     y = h * tf.compat.v1.get_variable("w", initializer=3.0)
    ...   plan = gg.GradientPlan(tf.reduce_sum(y))
    ...   gv = plan.transform_upstream("l2", gg.transforms.scale(0.5)).compute_gradients()
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
               reduce_fn=None):
    check_graph_mode("gg.GradientPlan", loss)
    _arguments.check_net(loss, net)
    _arguments.check_options(gate_gradients, reduce_fn)
    self._loss = loss
    self._net = net
    self._var_list = tuple(_arguments.check_var_list(loss, var_list))
    self._options = _executor.Options(
        gate_gradients=gate_gradients, aggregation_method=aggregation_method,
        colocate_gradients_with_ops=colocate_gradients_with_ops, name=name,
        reduce_fn=reduce_fn)
    self._declarations = Declarations(self._resolve, owner="GradientPlan")
    self._resources = Resources()
    self._built: Optional[_executor.Built] = None
    self._warned_adaptive = False

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

  # -- declaring -----------------------------------------------------------

  def transform_upstream(self, layer: str, fn) -> "GradientPlan":
    """Rewrites the gradient that ``layer`` passes to everything below it.

    Args:
      layer: layer name.
      fn: a transform or a callable ``g -> g`` keeping shape and dtype.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is unknown.
      NotConnectedError: if the layer's variables do not reach the loss.
      GraphGradError: if ``fn`` is not callable, the plan is built, or the
        layer has no output tensor to rewrite.
    """
    name = self._declarations.resolve(layer, "layer")

    def has_float_output():
      if not any(_graph_util.differentiable(t) for t in self.net[name].outputs):
        raise _errors.GraphGradError(
            f"transform_upstream: layer {name!r} has no floating-point output "
            f"on the way to the loss, so there is no upstream gradient to "
            f"rewrite. Use transform_gradients({name!r}, fn) for its "
            f"parameter gradients.")
    self._declarations.add_upstream(name, fn, validate=has_float_output)
    return self

  def transform_gradients(self, layer: str, fn) -> "GradientPlan":
    """Rewrites each of ``layer``'s own parameter gradients.

    Args:
      layer: layer name.
      fn: a transform or a callable ``g -> g`` keeping shape and dtype,
        applied to each gradient; or a ``gg.transforms.GroupTransform``
        (``clip_by_global_norm``, ``trust_ratio``), applied to the layer's
        ``(grad, var)`` list at once.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is unknown.
      NotConnectedError: if the layer's variables do not reach the loss.
      GraphGradError: if ``fn`` is not callable or the plan is built.
    """
    self._declarations.add_gradients(layer, fn)
    return self

  def transform_edge(self, lower: str, upper: str, fn) -> "GradientPlan":
    """Rewrites only the gradient ``upper`` sends directly into ``lower``.

    Args:
      lower: the layer nearer the input.
      upper: the layer nearer the loss; ``net.graph`` must have the edge
        ``lower -> upper``.
      fn: a transform or a callable ``g -> g`` keeping shape and dtype.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if either name is unknown.
      GraphGradError: if there is no such edge (the message lists the real
        neighbours), ``fn`` is not callable, or the plan is built.
    """
    lo = self._declarations.resolve(lower, "lower")
    up = self._declarations.resolve(upper, "upper")
    self._declarations.add_edge(
        lo, up, fn,
        # Raises with the real neighbours when the layer graph has no edge.
        validate=lambda: self.net.boundary(lo, up))
    return self

  def replace_backward(self, layer: str, fn) -> "GradientPlan":
    """Computes what ``layer`` sends to its inputs with ``fn``, not W^T.

    ``layer``'s own parameters still get their gradients from the true
    upstream gradient at its outputs; everything below the layer receives,
    at each of the layer's input tensors, what ``fn`` returns (plus,
    unchanged, contributions that bypass the layer). An upstream transform
    on the same layer is applied first: ``fn`` sees the transformed
    gradient. See ``gg.backward`` for feedback alignment, direct feedback
    alignment and synthetic gradients.

    Args:
      layer: layer name.
      fn: a ``gg.backward`` replacement, or a callable mapping a
        ``gg.backward.BackwardContext`` to one gradient per
        ``context.inputs`` tensor.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is unknown.
      GraphGradError: if ``fn`` is not callable, the layer already has a
        replacement, the replacement cannot handle the layer (e.g. feedback
        alignment on a convolution), or the plan is built.
    """
    name = self._declarations.resolve(layer, "layer")
    check = getattr(fn, "check", None)
    self._declarations.add_backward(
        name, fn,
        validate=(lambda: check(self.net, name)) if callable(check) else None)
    return self

  def combine_tasks(self, layer: str, losses: Sequence[tf.Tensor],
                    method) -> "GradientPlan":
    """Combines the task gradients at a shared layer's outputs with ``method``.

    With ``T`` the layer's outputs, ``g`` the gradient at ``T`` and
    ``g_i = dL/dL_i * dL_i/dT`` the share of task loss ``L_i`` in it, the
    gradient at ``T`` becomes

        g - sum_i g_i + method.combine([g_1, ..., g_n]):

    terms of the plan's loss other than the listed losses (a regulariser, an
    unlisted head) pass unchanged, and weights in the loss
    (``L = 0.5 L_a + L_b``) are respected. The layer's own parameters and
    everything below it see the combined gradient (the layer belongs to the
    shared trunk); an upstream transform on the layer acts after it. A task
    loss that does not reach an output has a ``None`` gradient there. The
    ``g_i`` come from plain backpropagation of each loss; rewrites declared
    above the layer act on ``g`` only.

    Args:
      layer: the shared layer, whose outputs feed the task heads.
      losses: two or more scalar task losses; the plan's loss must depend on
        each, and none may depend on another.
      method: a task-combination method: ``method.combine(grads)`` takes one
        list of gradients per task (one per output tensor, ``None`` where
        the task does not reach it) and returns one gradient per tensor.
        :meth:`project_conflicts` uses PCGrad, one such method.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is unknown.
      NotConnectedError: if the plan's loss does not depend on a listed loss.
      GraphGradError: if ``losses`` is not a list of at least two distinct,
        separate scalar losses, ``method`` has no ``combine``, the layer
        already combines task gradients, or the plan is built.
    """
    return self._tasks(layer, losses, method, "combine_tasks")

  def project_conflicts(self, layer: str, losses: Sequence[tf.Tensor],
                        shuffle: bool = True,
                        seed: Optional[int] = None) -> "GradientPlan":
    """Applies PCGrad to the task gradients at a shared layer's outputs.

    ``combine_tasks(layer, losses, pcgrad(shuffle, seed))``: PCGrad (Yu et
    al., 2020, "Gradient Surgery for Multi-Task Learning") projects each
    task gradient ``g_i`` at the layer's outputs ``T`` that conflicts with
    another ``g_j`` (``g_i . g_j < 0``, dot products over all of ``T``, batch
    included) onto the normal plane of ``g_j``, the other tasks taken in
    random order, ``g_i <- g_i - (g_i . g_j) / ||g_j||^2 g_j``; the gradient
    at ``T`` becomes ``g - sum_i g_i + sum_i g_i^PC``. With two tasks, the
    result has a non-negative dot product with both. A task loss that does
    not reach an output counts as a zero gradient there. See
    :meth:`combine_tasks` for what sees the result.

    Args:
      layer: the shared layer, whose outputs feed the task heads.
      losses: two or more scalar task losses; the plan's loss must depend on
        each, and none may depend on another.
      shuffle: take the other tasks in a random order, drawn at each step
        (with two tasks the order does not matter).
      seed: op-level seed of the shuffles.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError, NotConnectedError, GraphGradError: as
        :meth:`combine_tasks`.
    """
    return self._tasks(layer, losses, _pcgrad.pcgrad(shuffle, seed),
                       "project_conflicts")

  def _tasks(self, layer, losses, method, caller: str) -> "GradientPlan":
    name = self._declarations.resolve(layer, "layer")
    losses = _pcgrad.check_losses(self.net, name, losses, caller)
    self._declarations.add_tasks(name, losses, method)
    return self

  # -- helpers -------------------------------------------------------------

  def _resolve(self, name, arg: str) -> str:
    return _arguments.resolve_layer(self._loss, self.net, name, arg)

  def __repr__(self):
    return f"GradientPlan(loss={self._loss.name}, {self._declarations.summary()})"
