"""GradientPlan: declarative gradient rewrites, built as one backward pass."""

import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.analysis import _graph_util
from graphgrad.analysis._analyze import analyze, check_loss
from graphgrad.analysis._layers import LayerGraph, scope_of
from graphgrad.methods import _backward, _pcgrad
from graphgrad.plan import _advice
from graphgrad.plan._engine import Rewrite, Segments, aggregate
from graphgrad.transforms import _checks
from graphgrad.transforms._group import GroupTransform
from graphgrad.transforms._transforms import (
  EXTRA_GRADS_AND_VARS,
  USES_GLOBAL_STEP,
  Transform,
  TransformContext,
  as_transform,
  is_identity,
)

log = logging.getLogger("graphgrad")

GATE_NONE, GATE_OP, GATE_GRAPH = 0, 1, 2


class GradientPlan:
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

  Args:
    loss: a floating-point tensor of a ``tf.Graph``.
    net: the :class:`LayerGraph` of ``loss``; analysed when ``None``.
    var_list: variables to differentiate, as for
      ``Optimizer.compute_gradients``; defaults to the graph's trainable
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
    GraphGradError: on a malformed argument.

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
               reduce_fn: Optional[Callable] = None):
    if net is None:
      # Analysed on first use: a plan without transforms needs no analysis,
      # so it costs exactly what Optimizer.minimize costs.
      check_loss(loss)
    elif not isinstance(net, LayerGraph):
      raise _errors.GraphGradError(
          f"`net` must be a gg.LayerGraph from gg.analyze(loss); got "
          f"{type(net).__name__}. Pass net=gg.analyze(loss) or leave it None.")
    elif net.loss is not loss:
      raise _errors.GraphGradError(
          f"`net` was analysed for the loss {net.loss.name}, not for `loss` "
          f"{getattr(loss, 'name', loss)!r}. Pass net=gg.analyze(loss) for "
          f"this loss.")
    if reduce_fn is not None and not callable(reduce_fn):
      raise _errors.GraphGradError(
          f"`reduce_fn` must be a callable mapping a list of (gradient, "
          f"variable) pairs to the list of reduced gradients; got "
          f"{type(reduce_fn).__name__}. Pass e.g. "
          f"`lambda gv: [hvd.allreduce(g) for g, _ in gv]`, or None.")
    if gate_gradients not in (GATE_NONE, GATE_OP, GATE_GRAPH):
      raise _errors.GraphGradError(
          f"`gate_gradients` must be GATE_NONE (0), GATE_OP (1) or GATE_GRAPH "
          f"(2); got {gate_gradients!r}.")
    self.loss = loss
    self._net = net
    self._var_list = self._check_var_list(var_list)
    self._gate = gate_gradients
    self._options = dict(
        gate_gradients=(gate_gradients == GATE_OP),
        aggregation_method=aggregation_method,
        colocate_gradients_with_ops=colocate_gradients_with_ops)
    self._name = name
    self._reduce_fn = reduce_fn
    self._upstream: Dict[str, List[Transform]] = {}
    self._gradients: Dict[str, List[Transform]] = {}
    self._edges: Dict[Tuple[str, str], List[Transform]] = {}
    self._backward: Dict[str, Callable] = {}
    self._conflicts: Dict[str, tuple] = {}
    self._built: Optional[List[Tuple[Gradient, tf.Variable]]] = None
    self._state: dict = {}
    # (context, gradient before, gradient after) of every transform applied,
    # for plan.summaries().
    self._trace: List[Tuple[TransformContext, Gradient, Gradient]] = []
    self._warned_adaptive = False

  @property
  def net(self) -> LayerGraph:
    """The plan's :class:`LayerGraph` (analysed on first use)."""
    if self._net is None:
      self._net = analyze(self.loss)
    return self._net

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
    name = self._layer(layer, "layer")
    _checks.not_group(fn, "transform_upstream")
    if not any(_differentiable(t) for t in self.net[name].outputs):
      raise _errors.GraphGradError(
          f"transform_upstream: layer {name!r} has no floating-point output "
          f"on the way to the loss, so there is no upstream gradient to "
          f"rewrite. Use transform_gradients({name!r}, fn) for its "
          f"parameter gradients.")
    self._upstream.setdefault(name, []).append(as_transform(fn))
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
    name = self._layer(layer, "layer")
    if not isinstance(fn, GroupTransform):
      fn = as_transform(fn)
    self._gradients.setdefault(name, []).append(fn)
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
    lo = self._layer(lower, "lower")
    up = self._layer(upper, "upper")
    if lo == up:
      raise _errors.GraphGradError(
          f"transform_edge: `lower` and `upper` are both {lo!r}; an edge joins "
          f"two layers. Use transform_upstream({lo!r}, fn) instead.")
    self.net.boundary(lo, up)  # raises with the real neighbours
    _checks.not_group(fn, "transform_edge")
    self._edges.setdefault((lo, up), []).append(as_transform(fn))
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
    name = self._layer(layer, "layer")
    if not callable(fn) or isinstance(fn, (Transform, GroupTransform)):
      raise _errors.GraphGradError(
          f"replace_backward: `fn` must be a gg.backward replacement or a "
          f"callable mapping a gg.backward.BackwardContext to one gradient "
          f"per input tensor; got {fn!r}. Pass e.g. "
          f"gg.backward.feedback_alignment(seed=0).")
    if name in self._backward:
      raise _errors.GraphGradError(
          f"replace_backward: layer {name!r} already has the replacement "
          f"{self._backward[name]!r}; a layer's backward pass is replaced "
          f"once. Make a new GradientPlan to try another.")
    check = getattr(fn, "check", None)
    if callable(check):
      check(self.net, name)
    self._backward[name] = fn
    return self

  def project_conflicts(self, layer: str, losses: Sequence[tf.Tensor],
                        shuffle: bool = True,
                        seed: Optional[int] = None) -> "GradientPlan":
    """Applies PCGrad to the task gradients at a shared layer's outputs.

    PCGrad (Yu et al., 2020, "Gradient Surgery for Multi-Task Learning"):
    with ``T`` the layer's outputs, ``g`` the gradient at ``T`` and
    ``g_i = dL/dL_i * dL_i/dT`` the share of task loss ``L_i`` in it, each
    ``g_i`` that conflicts with another ``g_j`` (``g_i . g_j < 0``, dot
    products over all of ``T``, batch included) is projected onto the normal
    plane of ``g_j``, the other tasks taken in random order:

        g_i <- g_i - (g_i . g_j) / ||g_j||^2 g_j.

    The gradient at ``T`` becomes ``g - sum_i g_i + sum_i g_i^PC``: terms of
    the plan's loss other than the listed losses (a regulariser, an
    unlisted head) pass unprojected, and weights in the loss
    (``L = 0.5 L_a + L_b``) are respected. With two tasks, the result has a
    non-negative dot product with both. The layer's own parameters and
    everything below it see the projected gradient (the layer belongs to
    the shared trunk); an upstream transform on the layer acts after the
    projection. A task loss that does not reach the layer (or one of its
    outputs) counts as a zero gradient there. The ``g_i`` come from plain
    backpropagation of each loss; rewrites declared above the layer act on
    ``g`` only.

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
      LayerNotFoundError: if ``layer`` is unknown.
      NotConnectedError: if the plan's loss does not depend on a listed loss.
      GraphGradError: if ``losses`` is not a list of at least two distinct,
        separate scalar losses, the layer already projects conflicts, or the
        plan is built.
    """
    name = self._layer(layer, "layer")
    losses = _pcgrad.check_losses(self.net, name, losses)
    if name in self._conflicts:
      raise _errors.GraphGradError(
          f"project_conflicts: layer {name!r} already projects conflicts "
          f"between {[l.name for l in self._conflicts[name][0]]}; declare it "
          f"once, with every task loss.")
    self._conflicts[name] = (losses, shuffle, seed)
    return self

  # -- building ------------------------------------------------------------

  def compute_gradients(self) -> List[Tuple[Gradient, tf.Variable]]:
    """Builds the plan; returns ``(gradient, variable)`` pairs.

    The list has the order of ``var_list`` (or of the graph's trainable
    variables), like ``Optimizer.compute_gradients``. A variable the loss
    does not reach gets ``None``.

    Raises:
      IncompatibleGradientError: if a transform changes a shape or dtype.
      UnsupportedGraphError: for a graph shape the plan cannot rewrite
        correctly.
    """
    if self._built is not None:
      return list(self._built)
    graph = self.loss.graph
    with graph.as_default(), tf.name_scope(self._name):
      if not (self._upstream or self._edges or self._backward
              or self._conflicts):
        # The very call Optimizer.compute_gradients makes; unreached
        # variables get None from it.
        by_name = self._whole(self._var_list)
      else:
        known = self.net.op_graph
        by_name = self._segmented(
            [v for v in self._var_list if v.op.name in known])
      out = [(by_name.get(v.op.name), v) for v in self._var_list]
      for layer, fns in self._gradients.items():
        self._transform_layer(layer, fns, out)
      out += self._state.get(EXTRA_GRADS_AND_VARS, [])
      if self._gate == GATE_GRAPH:
        present = [(i, g) for i, (g, _) in enumerate(out) if g is not None]
        gated = tf.tuple([g for _, g in present]) if present else []
        for (i, _), g in zip(present, gated):
          out[i] = (g, out[i][1])
    self._built = out
    log.info("graphgrad plan on %s: %d variables, %d upstream, %d gradient, "
             "%d edge transforms", self.loss.name, len(out),
             len(self._upstream), len(self._gradients), len(self._edges))
    return list(out)

  def _transform_layer(self, layer, fns, out) -> None:
    """Applies ``layer``'s parameter transforms to its entries of ``out``."""
    idx = [i for i, (_, v) in enumerate(out)
           if self.net.layer_of_variable(v) == layer]
    for fn in fns:
      if isinstance(fn, GroupTransform):
        ctx = self._context(layer, "gradients")
        new = fn([out[i] for i in idx], ctx)
        for i, g in zip(idx, new):
          where = f"transform_gradients({layer!r}, {fn!r}) on {out[i][1].name}"
          out[i] = (_checks.check_result(out[i][0], g, where), out[i][1])
        continue
      for i in idx:
        g, v = out[i]
        if g is not None:
          ctx = self._context(layer, "gradients", variable=v)
          out[i] = (self._apply(fn, g, ctx,
                             f"transform_gradients({layer!r}) on {v.name}"), v)

  def _segmented(self, reached) -> Dict[str, Gradient]:
    def rewrite(fn, ctx, where):
      # A linear rewrite reaches the engine as its factor; the engine weights
      # instead of calling fn, and `observe` records the rewrite lazily for
      # summaries (the trace's `after` is then built only if read).
      apply = lambda g, t: self._apply(fn, g, ctx(t), where(t))  # noqa: E731
      observe = lambda g, t: self._trace.append(  # noqa: E731
          (ctx(t), g, self._later(fn, g, ctx(t), where(t))))
      return Rewrite(apply, fn.linear_factor, observe)

    def upstream(name):
      fn = _checks.compose(self._upstream[name])
      if is_identity(fn):
        return None
      return rewrite(fn, lambda t: self._context(name, "upstream", tensor=t),
                     lambda t: f"transform_upstream({name!r}) on {t.name}")

    def edge(key):
      fn = _checks.compose(self._edges[key])
      return rewrite(
          fn, lambda t: self._context(key[0], "edge", tensor=t, edge=key),
          lambda t: f"transform_edge({key[0]!r}, {key[1]!r}) on {t.name}")

    ups = {n: f for n in self._upstream for f in [upstream(n)] if f}
    # A layer with only identity upstream transforms needs no cut at all.
    edges = {k: edge(k) for k in self._edges}
    backward = {n: self._replacement(n, f) for n, f in self._backward.items()}
    cuts = [c for n, f in self._backward.items()
            for c in (f.cuts(self.net, n) if hasattr(f, "cuts") else [])]
    conflicts = {n: self._projection(n) for n in self._conflicts}
    if not ups and not edges and not backward and not conflicts:
      return self._whole(reached)
    segments = Segments(self.net, reached, ups, edges, self._options,
                        backward=backward, outputs_fn=conflicts, cuts=cuts)
    by_name = {v.op.name: v for v in reached}
    reduce = None
    if self._reduce_fn is not None:
      reduce = lambda names, grads: self._reduce(  # noqa: E731
          [by_name[n] for n in names], grads)
    contributions = segments.build(tf.ones_like(self.loss, name="seed"),
                                   reduce=reduce)
    return {v.op.name: aggregate(contributions.get(v.op.name, ()), like=v)
            for v in reached}

  def _projection(self, name: str) -> Callable:
    losses, shuffle, seed = self._conflicts[name]
    return _pcgrad.output_rewrite(self.loss, losses, shuffle, seed,
                                  f"project_conflicts_{name}")

  def _replacement(self, name: str, fn) -> Callable:
    return _backward.engine_hook(self.net, name, fn, self._state)

  def _whole(self, variables) -> Dict[str, Gradient]:
    """One tf.gradients call, as Optimizer.minimize builds, then reduce_fn."""
    grads = tf.compat.v1.gradients(self.loss, variables, **self._options)
    found = [(v, g) for v, g in zip(variables, grads) if g is not None]
    if self._reduce_fn is not None and found:
      found = list(zip([v for v, _ in found],
                       self._reduce([v for v, _ in found],
                                    [g for _, g in found])))
    return {v.op.name: g for v, g in found}

  def _reduce(self, variables, grads) -> List[Gradient]:
    """Calls reduce_fn on one segment's parameter gradients and checks it."""
    with tf.name_scope("reduce"):
      out = self._reduce_fn(list(zip(grads, variables)))
    out = list(out) if isinstance(out, (list, tuple)) else out
    if not isinstance(out, list) or len(out) != len(grads):
      got = (f"{len(out)} gradients" if isinstance(out, list)
             else type(out).__name__)
      raise _errors.GraphGradError(
          f"`reduce_fn` must return one reduced gradient per (gradient, "
          f"variable) pair it receives, in order; it received {len(grads)} "
          f"pairs ({', '.join(v.op.name for v in variables)}) and returned "
          f"{got}.")
    return [_checks.checked(lambda g, ctx, r=r: r, g, None,
                     f"reduce_fn on {v.name}")
            for g, r, v in zip(grads, out, variables)]

  def apply_gradients(self, optimizer, global_step=None,
                      name: Optional[str] = None,
                      update_ops: Optional[Sequence] = None) -> tf.Operation:
    """Builds the plan and one ``optimizer.apply_gradients`` op.

    Args:
      optimizer: a ``tf.compat.v1.train.Optimizer`` (or anything with its
        ``apply_gradients(grads_and_vars, global_step, name)``).
      global_step: optional variable to increment once per step. When it is
        ``None`` and a transform of the plan reads the graph's global step
        (annealed ``add_noise(eta=...)``), that global step is incremented,
        so that the schedule advances with training.
      name: name of the returned op.
      update_ops: ops to run before the update; defaults to the graph's
        ``UPDATE_OPS`` collection (batch-norm moving averages), as tf-slim's
        ``create_train_op`` does. Pass ``[]`` to run none.

    Returns:
      The train op.

    Raises:
      GraphGradError: if ``optimizer`` has no ``apply_gradients``, or no
        variable has a gradient.
    """
    if not callable(getattr(optimizer, "apply_gradients", None)):
      raise _errors.GraphGradError(
          f"`optimizer` must have an apply_gradients(grads_and_vars, "
          f"global_step, name) method, like tf.compat.v1.train.AdamOptimizer; "
          f"got {type(optimizer).__name__}.")
    gv = [(g, v) for g, v in self.compute_gradients() if g is not None]
    if not gv:
      raise _errors.NotConnectedError(
          f"no variable has a gradient from the loss {self.loss.name}; "
          f"variables: {', '.join(v.name for v in self._var_list)}. Check "
          f"that `var_list` holds variables the loss depends on.")
    if not self._warned_adaptive:
      self._warned_adaptive = _advice.warn_if_scale_cancels(self, optimizer)
    if update_ops is None:
      update_ops = self.loss.graph.get_collection(
          tf.compat.v1.GraphKeys.UPDATE_OPS)
    if global_step is None and self._state.get(USES_GLOBAL_STEP):
      # An annealed transform reads the global step: the train op advances it.
      global_step = tf.compat.v1.train.get_global_step(self.loss.graph)
    with self.loss.graph.as_default():
      with tf.control_dependencies(list(update_ops)):
        return optimizer.apply_gradients(gv, global_step=global_step,
                                         **({"name": name} if name else {}))

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
      The summaries are also added to the graph's ``SUMMARIES`` collection.

    Raises:
      IncompatibleGradientError, UnsupportedGraphError: as
        :meth:`compute_gradients`.

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> with tf.Graph().as_default():
      ...   x = tf.constant([[1.0, 2.0]])
      ...   with tf.compat.v1.variable_scope("l1"):
      ...     h = x @ tf.compat.v1.get_variable("w", initializer=[[1.0], [1.0]])
      ...   with tf.compat.v1.variable_scope("l2"):
      ...     y = h * tf.compat.v1.get_variable("w", initializer=3.0)
      ...   plan = gg.GradientPlan(tf.reduce_sum(y))
      ...   op = plan.transform_upstream("l2", gg.transforms.scale(0.5)).summaries()
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
                            name=name or self._name)

  # -- helpers -------------------------------------------------------------

  def _apply(self, fn: Transform, grad: Gradient, ctx: TransformContext,
             where: str) -> Gradient:
    out = _checks.checked(fn, grad, ctx, where)
    self._trace.append((ctx, grad, out))
    return out

  def _later(self, fn: Transform, grad: Gradient, ctx: TransformContext,
             where: str) -> Callable[[], Gradient]:
    def build():
      with self.loss.graph.as_default():
        return _checks.checked(fn, grad, ctx, where)
    return build

  def _layer(self, name, arg: str) -> str:
    if self._built is not None:
      raise _errors.GraphGradError(
          "this plan is already built (compute_gradients or apply_gradients "
          "was called); declare every transform before building, or make a "
          "new GradientPlan.")
    if isinstance(name, str) and name not in self.net:
      scoped = [v.name for v in _graph_util.trainable_variables(self.loss.graph)
                if scope_of(v.op.name) == name
                or v.op.name.startswith(name + "/")]
      if scoped:
        raise _errors.NotConnectedError(
            f"`{arg}` {name!r} names variables ({', '.join(scoped)}) that the "
            f"loss {self.loss.name} does not depend on, so the layer does not "
            f"reach the loss. Transform a layer the loss depends on: "
            f"{', '.join(self.net.names)}")
    return self.net[name].name

  def _check_var_list(self, var_list):
    graph = self.loss.graph
    if var_list is None:
      return _graph_util.trainable_variables(graph)
    var_list = list(var_list)
    for v in var_list:
      if not isinstance(v, tf.Variable):
        raise _errors.GraphGradError(
            f"`var_list` must hold tf.Variable objects; got "
            f"{type(v).__name__} {v!r}. Pass e.g. "
            f"tf.compat.v1.trainable_variables('l1_dense').")
      if v.graph is not graph:
        raise _errors.GraphGradError(
            f"`var_list` holds {v.name} from another tf.Graph than the loss. "
            f"Build variables and loss in one graph.")
    if not var_list:
      raise _errors.GraphGradError(
          "`var_list` is empty. Pass None to train every trainable variable, "
          "or list the variables to train.")
    return var_list

  def _context(self, layer, role, **kw) -> TransformContext:
    return TransformContext(
        layer=layer, role=role,
        global_step=tf.compat.v1.train.get_global_step(self.loss.graph),
        state=self._state, **kw)

  def __repr__(self):
    return (f"GradientPlan(loss={self.loss.name}, upstream={sorted(self._upstream)}, "
            f"gradients={sorted(self._gradients)}, edges={sorted(self._edges)}, "
            f"backward={sorted(self._backward)}, "
            f"conflicts={sorted(self._conflicts)})")


def _differentiable(t) -> bool:
  return (t.dtype.is_floating or t.dtype.is_complex) and not _graph_util.is_handle(t)
