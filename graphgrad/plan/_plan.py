"""GradientPlan: declarative gradient rewrites, built as one backward pass.

A thin front: each declaring method checks what only a ``tf.Graph`` plan can
check (the layer has a floating-point output, the layer-graph edge exists,
the replacement can handle the layer, the task losses) and records the
declaration in the plan's :class:`~graphgrad.plan._declarations.Declarations`;
:func:`graphgrad.plan._executor.build` builds them.
"""

import dataclasses
from typing import Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util
from graphgrad.analysis._analyze import analyze
from graphgrad.analysis._graph_mode import check_graph_mode
from graphgrad.analysis._layers import LayerGraph
from graphgrad.methods import _pcgrad
from graphgrad.plan import _arguments, _executor, _recompute
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

    A layer no gradient can pass through (no path from its inputs to its
    outputs, or all glue) *warns once* (``graphgrad`` logger) rather than
    raising, so one transform on every layer keeps working; the bottom
    layer is quiet.

    Args:
      layer: layer name.
      fn: a transform or a callable ``g -> g`` keeping shape and dtype.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is unknown (or all non-trainable).
      NotConnectedError: if the layer's variables do not reach the loss.
      UnsupportedGraphError: if the layer is applied inside a v2 ``tf.cond``
        or ``tf.while_loop`` with other layers (the message names the op).
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
    self._declarations.add_upstream(
        name, fn, validate=lambda: self.net.check_declaration(
            "transform_upstream", name, then=has_float_output))
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

    An edge whose boundary depends on no trainable variable warns once.

    Raises:
      LayerNotFoundError: if either name is unknown.
      UnsupportedGraphError: as :meth:`transform_upstream`, for ``lower``.
      GraphGradError: if there is no such edge (the message lists the real
        neighbours), ``fn`` is not callable, or the plan is built.
    """
    lo = self._declarations.resolve(lower, "lower")
    up = self._declarations.resolve(upper, "upper")
    self._declarations.add_edge(
        lo, up, fn,
        # Raises with the real neighbours when the layer graph has no edge.
        validate=lambda: self.net.check_declaration(
            "transform_edge", lo, up, then=lambda: self.net.boundary(lo, up)))
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

    A layer with nowhere to send the result (no input, or no float input
    above other layers) warns once, as :meth:`transform_upstream` does.

    Raises:
      LayerNotFoundError: if ``layer`` is unknown.
      UnsupportedGraphError: as :meth:`transform_upstream`.
      GraphGradError: if ``fn`` is not callable, the layer already has a
        replacement, the replacement cannot handle the layer (e.g. feedback
        alignment on a convolution), or the plan is built.
    """
    name = self._declarations.resolve(layer, "layer")
    check = getattr(fn, "check", None)
    then = (lambda: check(self.net, name)) if callable(check) else None
    self._declarations.add_backward(name, fn, validate=lambda: (
        self.net.check_declaration("replace_backward", name, then=then)))
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
    shared trunk); an upstream transform on the layer acts after it, on the
    combined gradient. With several output tensors, each ``g_i`` is the
    concatenation of the task's flattened gradients at all of them (zeros
    where the task does not reach one), so the method's dot products run
    over all of ``T``, batch included; a task loss that reaches none of
    ``T`` is left out. Each task loss is backpropagated once, from the loss
    to ``T`` only; rewrites declared above the layer act on ``g`` only. A
    stateful method (``gg.mtl.gradvac``, ``gg.mtl.nash_mtl``) gets its
    state made once for this plan and layer, in :attr:`resources`.

    Args:
      layer: the shared layer, whose outputs feed the task heads.
      losses: two or more scalar task losses; the plan's loss must depend on
        each, and none may depend on another.
      method: a task-combination method such as ``gg.mtl.upgrad()``:
        ``method.combine(grads)`` takes ``k`` task gradients of one shape
        and returns one gradient of that shape; one with
        ``create_state(k, name=None)`` gets ``combine(grads, state=...)``.
        :meth:`project_conflicts` uses ``gg.mtl.pcgrad()``.

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
    self._declarations.add_tasks(
        name, losses, method,
        validate=lambda: self.net.check_declaration(caller, name))
    return self

  def recompute(self, keep: Optional[Sequence[str]] = None
                ) -> "GradientPlan":
    """Recomputes forward ops in the backward pass instead of keeping them.

    The backward pass keeps the outputs of the layers in ``keep``, plus the
    tensors the loss and the plan's declarations read (cut tensors, task
    losses). Every other forward op between two kept tensors is recomputed,
    segment by segment, just before its backward, and the copy is
    differentiated; gradients equal the plan's without recompute. Random
    ops are not recomputed: their forward values are reused. Variable
    reads, stateful ops, loops, conds and overridden ops are never
    recomputed; a segment holding a stateful op, a loop or an overridden
    op keeps its activations.

    Args:
      keep: layer names whose outputs are kept; ``None`` picks about
        ``sqrt(n)`` of the ``n`` layers, each one an articulation point of
        the layer graph (a layer that no skip connection jumps over).

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if a name in ``keep`` is unknown.
      GraphGradError: if ``keep`` is not a sequence of names, or the plan is
        built.
      UnsupportedGraphError: when the plan is built, for a random op whose
        value depends on the parameters (it can neither be reused nor
        recomputed).
    """
    if self._built is not None:
      raise _errors.GraphGradError(
          "recompute: the plan is already built (compute_gradients or "
          "apply_gradients was called). Declare recompute before building.")
    if keep is not None:
      if isinstance(keep, str) or not isinstance(keep, (list, tuple, set)):
        raise _errors.GraphGradError(
            f"recompute: `keep` must be a list of layer names or None; got "
            f"{type(keep).__name__} {keep!r}. Pass keep=[{keep!r}] for one "
            f"layer.")
      keep = tuple(self._declarations.resolve(k, "keep") for k in keep)
    self._options = dataclasses.replace(
        self._options, recompute=_recompute.Recompute(keep))
    return self

  # -- helpers -------------------------------------------------------------

  def _resolve(self, name, arg: str) -> str:
    return _arguments.resolve_layer(self.net, name, arg)

  def __repr__(self):
    return (f"GradientPlan(loss={self._loss.name}, "
            f"{self._declarations.summary()})")
