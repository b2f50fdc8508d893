"""The TF1 executor: builds a plan's declarations on its ``tf.Graph``.

:func:`build` is the one entry point. With no declaration that rewrites the
backward pass it makes the single ``tf.gradients`` call that
``Optimizer.minimize`` makes; else it turns each declaration into a rule of
the segment engine (:class:`~graphgrad.plan._engine.Segments`). Every
backward call is one of the plan's VJP (:class:`~graphgrad.plan._backprop.
GraphVJP`), which substitutes the plan's overrides for the registered
gradient functions of their ops (``_op_override``, ``_backprop.hooked``)
and, under ``plan.recompute``, recomputes the forward ops it crosses. It
then applies the parameter-gradient transforms, appends the ``(gradient,
variable)`` pairs of backward replacements, and gates the result. Every
applied transform is recorded as a ``core._layer_step.TraceRecord``, which
``plan.summaries()`` reads.
"""

import contextlib
import dataclasses
from typing import (
  Any,
  Callable,
  Dict,
  List,
  Optional,
  Sequence,
  Set,
  Tuple,
)

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.analysis._no_gradient import ops_without_gradient
from graphgrad.core import _privacy
from graphgrad.core._gradients import aggregate
from graphgrad.core._layer_step import BackwardPass, TraceRecord
from graphgrad.core._rules import PlanRules, TaskRule
from graphgrad.core._task_combination import combined_parameters
from graphgrad.plan import (
  _loss_scale_optimizer,
  _op_override,
  _privatize_graph,
  _recompute,
)
from graphgrad.plan._backprop import GraphVJP
from graphgrad.plan._engine import Segments
from graphgrad.transforms import _checks
from graphgrad.transforms._context import Resources

GATE_NONE, GATE_OP, GATE_GRAPH = 0, 1, 2

GradsAndVars = List[Tuple[Gradient, tf.Variable]]


@dataclasses.dataclass(frozen=True)
class Options:
  """How a plan differentiates, as for ``Optimizer.compute_gradients``.

  Attributes:
    gate_gradients: ``GATE_NONE``, ``GATE_OP`` or ``GATE_GRAPH``.
    aggregation_method: passed to ``tf.gradients``.
    colocate_gradients_with_ops: passed to ``tf.gradients``.
    name: name scope of the ops the plan adds.
    reduce_fn: the cross-replica reduction, or ``None``.
    replicas: the number of replicas ``reduce_fn`` reduces over, or
      ``None``; read by ``privatize`` only.
    after: ops the backward pass waits for (batch-norm updates): the
      loss's gradient, its seed, is built after them, so no gradient is
      alive while they run (tf-slim's ``create_train_op`` barrier).
  """
  gate_gradients: int = GATE_OP
  aggregation_method: Any = None
  colocate_gradients_with_ops: bool = False
  name: str = "graphgrad"
  reduce_fn: Optional[Callable] = None
  replicas: Optional[int] = None
  after: Tuple[tf.Operation, ...] = ()

  @property
  def gradients_kwargs(self) -> dict:
    """Keyword arguments of every ``tf.gradients`` call."""
    return dict(gate_gradients=(self.gate_gradients == GATE_OP),
                aggregation_method=self.aggregation_method,
                colocate_gradients_with_ops=self.colocate_gradients_with_ops)


@dataclasses.dataclass(frozen=True)
class Built:
  """What building a plan gives.

  Attributes:
    grads_and_vars: the ``(gradient, variable)`` pairs.
    trace: every transform applied.
    kept: under ``plan.recompute``, the tensors the backward pass keeps,
      in forward order; else empty.
  """
  grads_and_vars: Tuple[Tuple[Gradient, tf.Variable], ...]
  trace: Tuple[TraceRecord, ...]
  kept: Tuple[tf.Tensor, ...] = ()


def build(loss: tf.Tensor, net: Callable[[], LayerGraph],
          var_list: Sequence[tf.Variable], rules: PlanRules,
          options: Options, resources: Resources) -> Built:
  """Builds the plan's compiled ``rules`` on ``loss``'s graph.

  Args:
    loss: the plan's loss.
    net: returns the plan's layer graph (analysed on first use: a plan that
      declares nothing never analyses).
    var_list: the variables to differentiate, in output order.
    rules: the plan, compiled (``graphgrad.core._rules``). A loss scale
      (calling its ``scale`` gives ``S``) backpropagates ``loss * S``; the
      transforms see gradients divided by ``S``, and the parameter
      gradients are divided by ``S`` (see ``_loss_scale_optimizer``).
      Under ``privacy`` the gradients come from ``_privatize_graph``,
      noised before the parameter transforms; with ``reduce_fn`` the
      clipped sums are reduced first and the noise drawn once after.
    options: how to differentiate.
    resources: the plan's store of what its transforms create.

  Returns:
    The ``(gradient, variable)`` pairs and the trace.

  Raises:
    GraphGradError: if the loss's backward path crosses ops with no
      registered gradient and no override: the message lists every one,
      with its layer, where ``tf.gradients`` stops at the first.
  """
  executor = _Executor(loss, net, var_list, rules, options, resources)
  try:
    return executor.run()
  except LookupError as e:  # a gradient tf.gradients could not find
    missing = ops_without_gradient(loss, list(var_list))
    if not missing:
      raise
    raise _op_override.no_gradient_error(loss, missing,
                                      executor.layer_of) from e


class _Executor:
  """One build of one plan."""

  def __init__(self, loss, net, var_list, rules: PlanRules, options,
               resources):
    self.loss, self._net = loss, net
    self.var_list = list(var_list)
    self.rules = rules
    self.options = options
    self.resources = resources
    self.global_step = tf.compat.v1.train.get_global_step(loss.graph)

  @property
  def net(self) -> LayerGraph:
    return self._net()

  def layer_of(self, op: tf.Operation) -> Optional[str]:
    """``op``'s layer, or ``None`` for glue or a graph that has no layers."""
    try:
      return self.net.layer_of(op)
    except _errors.GraphGradError:
      return None

  def run(self) -> Built:
    rules = self.rules
    self.scale = None
    if rules.loss_scale is not None:
      with self.loss.graph.as_default():
        self.scale = rules.loss_scale.scale()
    self.step = BackwardPass(self.global_step, self.resources,
                             scale=self.scale, later_scope=self._scope)
    self.overrides = _op_override.substitutions(
        self.loss, self.var_list, {(o.match, o.key): o.fn for o in rules.ops},
        self.layer_of)
    self.vjp = GraphVJP(
        self.options.gradients_kwargs, self.overrides.fns,
        recompute=(None if rules.recompute is None
                   else self._recompute(rules.recompute.keep,
                                        rules.recompute.tensors)),
        seed=lambda target: (self._scaled_seed() if target is self.loss
                             else None))
    # Under a loss scale every transform sees the unscaled gradient: the
    # backward pass (self.step) carries the scale, as in a KerasPlan's tape.
    with self.loss.graph.as_default(), tf.name_scope(self.options.name):
      params = rules.parameter_tasks
      # The variables a parameter-space combination takes.
      chosen = set() if params is None else {
          v.op.name for v in self.var_list if params.layers is None
          or self.net.layer_of_variable(v) in params.layers}
      plain = not rules.rewrites_backward
      if rules.privacy is not None:
        uses = _privatize_graph.GraphUses(self.loss, self.var_list, self.vjp)
        # Under a loss scale: S times DP-SGD's gradient, unscaled below.
        private = _privacy.private_gradients(
            self.vjp, self.loss, self.var_list, uses, rules.privacy.noise,
            _privacy.NoiseCounter(), self._reduction(),
            scale=self.scale, seed=self._scaled_seed())
        by_name = {v.op.name: g for v, g in zip(self.var_list, private)}
      elif plain:
        # The very call Optimizer.compute_gradients makes; unreached
        # variables get None from it. The parameter-space combination
        # rebuilds its variables' gradients from the tasks' and the rest.
        rest = [v for v in self.var_list if v.op.name not in chosen]
        by_name = self._whole(rest) if rest else {}
      else:
        known = self.net.op_graph
        by_name = self._segmented(
            [v for v in self.var_list if v.op.name in known])
      out = [(by_name.get(v.op.name), v) for v in self.var_list]
      if params is not None:
        self._combine_parameters(params, out, chosen, plain)
      new = self.step.transform_parameters(rules.parameters, out,
                                           self._layer_among)
      out = [(g, v) for g, (_, v) in zip(new, out)]
      out += self.step.extra
      if self.options.gate_gradients == GATE_GRAPH:
        present = [(i, g) for i, (g, _) in enumerate(out) if g is not None]
        gated = tf.tuple([g for _, g in present]) if present else []
        for (i, _), g in zip(present, gated):
          out[i] = (g, out[i][1])
      if self.scale is not None:
        # As the loss-scale optimizer's own compute_gradients unscales.
        out = _loss_scale_optimizer.unscale(self.scale, out)
    recompute = self.vjp.recompute
    kept = () if recompute is None else recompute.kept
    return Built(tuple(out), tuple(self.step.trace), kept)

  def _recompute(self, keep: Optional[Tuple[str, ...]],
                 tensors: Tuple[str, ...]) -> _recompute.Recompute:
    """The VJP's recompute option: keep the outputs of the layers in
    ``keep`` and the ``tensors``; never copy an overridden op
    (``plan.recompute``)."""
    names = {o.key for o in self.rules.ops if o.match == "name"}
    types = {o.key for o in self.rules.ops if o.match == "type"}
    return _recompute.Recompute(
        lambda: _recompute.kept_tensors(self.net, keep, tensors),
        lambda op: op.name in names or op.type in types)

  # -- the segmented backward pass ------------------------------------------

  def _segmented(self, reached) -> Dict[str, Gradient]:
    rules = self.rules
    segments = Segments(self.net, reached, rules, self.step, self.vjp,
                        self.overrides, spans=rules.recompute is None)
    reduce = None if self.options.reduce_fn is None else self._reduce
    contributions = segments.build(self._seed(), reduce=reduce)
    return {v.op.name: aggregate(contributions.get(v.op.name, ()), like=v)
            for v in reached}

  # -- parameter gradients ---------------------------------------------------

  def _combine_parameters(self, declared: TaskRule,
                          out: GradsAndVars, chosen: Set[str],
                          plain: bool) -> None:
    """The task combination in parameter space, on its entries of ``out``.

    Each task loss takes one call of the plan's VJP (as every segment
    does), to the combined variables only. With ``plain`` (nothing
    else rewrites the backward pass) their entries of ``out`` are empty and
    the rest of their gradient is one more call that crosses only the
    loss's unlisted terms.
    """
    idx = [i for i, (_, v) in enumerate(out) if v.op.name in chosen]
    if not idx:
      return
    reduce = None if self.options.reduce_fn is None else self._reduce
    variables = [out[i][1] for i in idx]
    losses = list(declared.losses or ())

    def rest():
      # The loss with the task losses held constant: its unlisted terms.
      seed = self._scaled_seed()
      return self.vjp.vjp(
          [self.loss], variables,
          [tf.ones_like(self.loss) if seed is None else seed], stop=losses)

    new = combined_parameters(
        self.vjp, self.loss, losses, variables,
        None if plain else [out[i][0] for i in idx], declared.method,
        lambda make: self.resources.get_or_create(
            None, "combine_tasks/parameters/state", make),
        reduce=reduce, rest=rest)
    for i, g in zip(idx, new):
      out[i] = (g, out[i][1])

  def _layer_among(self, v: tf.Variable, layers: Tuple[str, ...]
                   ) -> Optional[str]:
    """``v``'s layer if it is one of ``layers``."""
    layer = self.net.layer_of_variable(v)
    return layer if layer in layers else None

  # -- one call of the VJP, reduce_fn ----------------------------------------

  def _whole(self, variables) -> Dict[str, Gradient]:
    """One call of the VJP, the tf.gradients call Optimizer.minimize
    makes, then reduce_fn."""
    seeded = self.scale is not None or self.options.after
    grads = self.vjp.vjp([self.loss], variables,
                         [self._seed()] if seeded else None)
    found = [(v, g) for v, g in zip(variables, grads) if g is not None]
    if self.options.reduce_fn is not None and found:
      found = list(zip([v for v, _ in found],
                       self._reduce([v for v, _ in found],
                                    [g for _, g in found])))
    return {v.op.name: g for v, g in found}

  def _reduction(self) -> Optional[_privacy.Reduction]:
    """``reduce_fn`` for ``privatize``'s clipped sums, or ``None``."""
    if self.options.reduce_fn is None:
      return None
    assert self.options.replicas is not None  # GradientPlan refuses None
    return _privacy.Reduction(self._reduce, self.options.replicas)

  def _reduce(self, variables, grads) -> List[Gradient]:
    """Calls reduce_fn on one segment's parameter gradients and checks it."""
    with tf.name_scope("reduce"):
      out = self.options.reduce_fn(list(zip(grads, variables)))
    out = _checks.one_per_pair(out, len(grads), lambda got: (
        _errors.GraphGradError(
            f"`reduce_fn` must return one reduced gradient per (gradient, "
            f"variable) pair it receives, in order; it received "
            f"{len(grads)} pairs ({', '.join(v.op.name for v in variables)}) "
            f"and returned {got}.")))
    return [_checks.check_result(g, r, f"reduce_fn on {v.name}")
            for g, r, v in zip(grads, out, variables)]

  # -- helpers ---------------------------------------------------------------

  def _seed(self) -> tf.Tensor:
    """The loss's gradient, 1 or the loss scale, after ``options.after``."""
    with tf.control_dependencies(list(self.options.after)):
      if self.scale is None:
        return tf.ones_like(self.loss, name="seed")
      return _loss_scale_optimizer.seed(self.loss, self.scale)

  def _scaled_seed(self) -> Optional[tf.Tensor]:
    """The loss's gradient ``S`` under a loss scale, else ``None`` (1)."""
    if self.scale is None:
      return None
    return _loss_scale_optimizer.seed(self.loss, self.scale)

  def _scope(self):
    """Where ops built after the plan go: the loss's graph, the plan's
    name scope (a trace entry first read by summaries)."""
    stack = contextlib.ExitStack()
    stack.enter_context(self.loss.graph.as_default())
    stack.enter_context(tf.name_scope(self.options.name))
    return stack
