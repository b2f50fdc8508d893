"""One backward step at a layer or an edge: the only code that acts there.

Both executors run a backward pass inside one :class:`BackwardPass` and hand
it each layer they stop at (:meth:`BackwardPass.layer_backward`, with the
layer's :class:`Site`: its outputs, inputs and VJP), each edge's gradient
(:meth:`BackwardPass.edge_backward`) and the parameter gradients
(:meth:`BackwardPass.transform_parameters`). The rule's ``Mode`` orders a
layer's steps: tasks rewrite ``g``; the own variables get a VJP of ``g``;
the upstream transform maps ``g`` to ``fn(g)``; the inputs get a VJP of
``fn(g)`` (or the replacement's or override's result), then the input
transform. Every transform is checked and traced under the pass's loss
scale. A ``LINEAR`` rule ``c * g`` takes one VJP weighted by ``c``, or a
fused VJP (:class:`FusedSite`: one call over several layers weighting
inside, the TF1 spans and a Keras layer on scaled inputs): every layer with
a rule takes the step.
"""

import contextlib
import dataclasses
import functools
from typing import (
  Any,
  Callable,
  ContextManager,
  Dict,
  Iterator,
  List,
  NamedTuple,
  Optional,
  Protocol,
  Sequence,
  Tuple,
)

import tensorflow as tf

from graphgrad._types import Gradient
from graphgrad.core._gradients import (
  completed_upstream,
  input_grads,
  is_zero,
  weigh,
)
from graphgrad.core._rules import EdgeRule, LayerRule, Mode, ParameterRule
from graphgrad.methods._replacement import BackwardContext, run_replacement
from graphgrad.transforms import _checks
from graphgrad.transforms._context import Resources, TransformContext
from graphgrad.transforms._group import GroupTransform
from graphgrad.transforms._transforms import Transform

__all__ = ["BackwardPass", "FusedSite", "LayerCall", "LayerGrads", "Site",
           "TraceRecord", "describe", "split_vjp"]


class Site(Protocol):
  """One layer in one backward pass, as its executor supplies it: its VJP
  and what a replacement or an override sees of it.

  Attributes:
    outputs: the output tensors whose gradients arrive, in order.
    inputs: the input tensors that get a gradient, in order.
    layer: the layer, as a replacement's ``context.layer`` sees it.
    net: the layers, as a replacement's ``context.net`` sees them.
  """

  @property
  def outputs(self) -> Sequence: ...

  @property
  def inputs(self) -> Sequence: ...

  @property
  def layer(self) -> Any: ...

  @property
  def net(self) -> Any: ...

  def vjp(self, grads: List, inputs: bool, own: bool,
          other: bool) -> Tuple[List, List, List]:
    """Backpropagates ``grads`` (one per output) through the layer.

    Returns gradients for the inputs, the layer's own variables and the
    other variables it reads, each list empty where not asked for.
    """

  def task_deltas(self, grads: List) -> List:
    """Per output, ``combine(g_1, ..., g_k) - sum_i g_i`` of the rule's
    task combination (``core._task_combination.output_deltas``)."""

  def methods(self) -> Any:
    """The executor's side of a replacement's ``BackwardContext``: its
    VJP, variable store and dense-layer view."""

  def recording(self) -> ContextManager:
    """The block a replacement runs in (a tape records its ops there)."""

  def paused(self) -> ContextManager:
    """The block the chain rule is built in for a replacement."""


class FusedSite:
  """A ``LINEAR`` layer whose VJP is part of one call that covers several
  layers (a *fused VJP*: the TF1 engine's span of ``scale(c)`` layers, a
  Keras layer run on inputs whose gradient is scaled).

  The enclosing call weights what the layer sends below by the rule's
  factor, and deposits what it gives, so :meth:`vjp` returns nothing; for
  the layer that leads the call, it makes the call (``run(grads)``). The
  layer still takes core's step (:meth:`BackwardPass.layer_backward`),
  which records the gradient at its outputs.

  Args:
    outputs: the layer's outputs whose gradients arrive.
    run: ``grads -> None``, the enclosing call, for the layer that leads
      it; ``None`` for the others.
  """
  inputs: Sequence = ()
  layer: Any = None
  net: Any = None

  def __init__(self, outputs: Sequence,
               run: Optional[Callable[[List], None]] = None):
    self.outputs, self._run = list(outputs), run

  def vjp(self, grads: List, inputs: bool, own: bool,
          other: bool) -> Tuple[List, List, List]:
    if self._run is not None:
      self._run(grads)
    return [], [], []

  def task_deltas(self, grads: List) -> List:
    raise TypeError("a fused layer combines no tasks (compiled so)")

  def methods(self) -> Any:
    raise TypeError("a fused layer has no replacement (compiled so)")

  def recording(self) -> ContextManager:
    return contextlib.nullcontext()

  paused = recording


class LayerCall(NamedTuple):
  """One layer call, as an override ``fn`` of a whole layer sees it.

  It has the ``name``, ``type``, ``inputs`` and ``outputs`` of a
  ``tf.Operation``, so that ``fn(call, *output_grads)`` is written like a
  registered gradient function (and ``straight_through`` serves both).

  Attributes:
    name: the layer's path in the model.
    type: the layer's class name.
    inputs: the call's floating-point input tensors.
    outputs: the call's floating-point output tensors that get a gradient.
    layer: the layer.
  """
  name: str
  type: str
  inputs: Tuple[Any, ...]
  outputs: Tuple[Any, ...]
  layer: Any


@dataclasses.dataclass
class LayerGrads:
  """What :meth:`BackwardPass.layer_backward` gives.

  Attributes:
    upstream: the complete gradient at the outputs, after the task
      combination: what a replacement below reads through ``upstream_of``.
    inputs: one gradient per input, or ``None`` where a zero factor sends
      nothing below.
    own: the gradients of the layer's own variables.
    other: the gradients of the other variables the layer reads (empty
      where ``inputs`` is ``None``).
  """
  upstream: List
  inputs: Optional[List]
  own: List
  other: List


def split_vjp(call: Callable[[List, List], Sequence], inputs: Sequence,
              own: Sequence, other: Sequence, want_inputs: bool,
              want_own: bool, want_other: bool) -> Tuple[List, List, List]:
  """A :meth:`Site.vjp` from one differentiating call of the executor.

  Args:
    call: ``(xs, variables) -> one gradient per entry of xs + variables``.
    inputs, own, other: the layer's inputs, own variables and the other
      variables it reads (in the executor's terms: tensors, variables or
      their names).
    want_inputs, want_own, want_other: which of the three to differentiate.

  Returns:
    The gradients for the inputs, own and other variables, each list empty
    where not asked for.
  """
  xs = list(inputs) if want_inputs else []
  vs = (list(own) if want_own else []) + (list(other) if want_other else [])
  res = call(xs, vs)
  n, m = len(xs), len(own) if want_own else 0
  return list(res[:n]), list(res[n:n + m]), list(res[n + m:])


def describe(t) -> str:
  """A tensor's name, or its shape where it has none (eager)."""
  return t.name if tf.is_symbolic_tensor(t) else f"an output of shape {t.shape}"


def sends_nothing(rule: Optional[EdgeRule]) -> bool:
  """True for an edge whose factor is 0: nothing reaches its lower layer,
  and the executor need not build what would."""
  return rule is not None and is_zero(rule.factor)


class TraceRecord:
  """One transform applied while a plan ran: context, before, after.

  It unpacks as ``(context, before, after)``. Where the executor weighted a
  linear rewrite by its factor instead of calling it, ``after`` is built on
  first read (summaries, a gradient report): a plan that never reads it
  builds no ops for it. ``scale`` is the loss scale ``before`` and
  ``after`` are multiplied by, or ``None``.
  """
  __slots__ = ("context", "before", "scale", "_after", "_later")

  def __init__(self, context: TransformContext, before: Gradient,
               after: Gradient = None,
               later: Optional[Callable[[], Gradient]] = None,
               scale: Any = None):
    self.context, self.before, self.scale = context, before, scale
    self._after, self._later = after, later

  @property
  def after(self) -> Gradient:
    """The transform's result."""
    if self._later is not None:
      self._after, self._later = self._later(), None
    return self._after

  def __iter__(self) -> Iterator[Any]:
    return iter((self.context, self.before, self.after))

  def __repr__(self) -> str:
    return (f"TraceRecord({self.context.role!r}, layer="
            f"{self.context.layer!r}, before={self.before!r})")


class BackwardPass:
  """One backward pass of a plan: its steps at layers and edges, and what
  they recorded.

  Args:
    global_step: the global step a transform's context carries.
    resources: the plan's store.
    scale: the loss scale ``S`` the gradients carry, or ``None``.
    plain: plain backpropagation (the task gradients of a ``KerasPlan``):
      nothing is recorded.
    labels: what a replacement's ``context.labels`` reads.
    later_scope: the block a trace entry's deferred ``after`` is built in.

  Attributes:
    trace: every transform applied, in order (``core._trace``).
    done: the complete gradient at each cut layer's outputs, filled from
      the loss down (what ``context.upstream_of`` reads).
    extra: the ``(gradient, variable)`` pairs replacements train.
  """

  def __init__(self, global_step, resources: Resources,
               scale: Any = None, plain: bool = False, labels: Any = None,
               later_scope: Callable[[], ContextManager] = (
                   contextlib.nullcontext)):
    self.global_step, self.resources = global_step, resources
    self.scale, self.plain, self.labels = scale, plain, labels
    self.later_scope = later_scope
    self.trace: List[TraceRecord] = []
    self.done: Dict[str, List] = {}
    self.extra: List[Tuple[Gradient, Any]] = []
    self._consts: Dict[Any, tf.Tensor] = {}

  # -- at a layer ------------------------------------------------------------

  def layer_backward(self, rule: LayerRule, site: Site,
                     grads: Sequence) -> LayerGrads:
    """Applies one layer's rule to the gradient at its outputs.

    Args:
      rule: the layer's compiled rule.
      site: the layer in this pass, as its executor supplies it.
      grads: the gradient at each output, summed over all consumers.

    Returns:
      The layer's :class:`LayerGrads`.
    """
    out = self._layer_backward(rule, site, grads)
    if rule.inputs is not None and out.inputs is not None:
      out.inputs = self._inputs(rule, site.inputs, out.inputs)
    return out

  def _layer_backward(self, rule: LayerRule, site: Site,
                      grads: Sequence) -> LayerGrads:
    # A fused VJP applies a LINEAR rule's factor and nothing else.
    assert not isinstance(site, FusedSite) or (
        rule.mode is Mode.LINEAR and not rule.special), rule
    g = list(grads)
    if rule.tasks is not None:
      g = [d if x is None else (x if d is None
                                else tf.convert_to_tensor(x) + d)
           for x, d in zip(g, site.task_deltas(g))]
    if not self.plain:
      self.done[rule.layer] = g
    mode = rule.mode
    if mode is Mode.PLAIN or mode is Mode.LINEAR:
      # One VJP of g: c * g's VJP is c times it, and the own variables see g.
      factor = rule.factor if mode is Mode.LINEAR else None
      if factor is not None:
        self.observe(rule, site.outputs, g)
        if is_zero(factor):
          return LayerGrads(g, None, site.vjp(g, False, True, False)[1], [])
      dx, own, other = site.vjp(g, True, True, True)
      if factor is not None and not isinstance(site, FusedSite):
        dx = [self.weigh(d, factor) for d in dx]
        other = [self.weigh(d, factor) for d in other]
      return LayerGrads(g, dx, own, other)
    own = site.vjp(g, False, True, False)[1]
    below = self._upstream(rule, site.outputs, g)
    if mode is Mode.TRANSFORMED:
      dx, _, other = site.vjp(below, True, False, True)
      return LayerGrads(g, dx, own, other)
    other = site.vjp(below, False, False, True)[2]
    if mode is Mode.OVERRIDDEN:
      call = LayerCall(rule.layer, type(site.layer).__name__,
                       tuple(site.inputs), tuple(site.outputs), site.layer)
      assert rule.override is not None  # compiled so for OVERRIDDEN
      dx = list(input_grads(call, rule.override, list(below)))
    else:
      dx = self._replace(rule, site, below)
    return LayerGrads(g, dx, own, other)

  def observe(self, rule: LayerRule, outputs: Sequence,
              grads: Sequence) -> None:
    """Records the gradient at a ``LINEAR`` layer's outputs, which is
    weighted by its factor rather than transformed: the trace's ``after``
    calls the transform when first read (summaries, a report)."""
    fn = rule.upstream
    if fn is None or self.plain:
      return
    for y, gy in zip(outputs, grads):
      ctx = self.context(rule.layer, "upstream", tensor=y)
      self._deferred(fn, gy, ctx, _upstream_where(rule, y))

  def _upstream(self, rule: LayerRule, outputs: Sequence, g: List) -> List:
    fn = rule.upstream
    if fn is None:
      return g
    return [self.apply(fn, gy, self.context(rule.layer, "upstream", tensor=y),
                       _upstream_where(rule, y))
            for y, gy in zip(outputs, g)]

  def _inputs(self, rule: LayerRule, inputs: Sequence, dx: List) -> List:
    """Each input's gradient rewritten by the rule's input transform,
    checked and traced; ``None`` stays ``None``."""
    fn = rule.inputs
    assert fn is not None  # called only for a rule with one
    return [None if d is None else self.apply(
        fn, d, self.context(rule.layer, "inputs", tensor=x),
        f"transform_inputs({rule.layer!r}) on {describe(x)}")
            for x, d in zip(inputs, dx)]

  def _replace(self, rule: LayerRule, site: Site, below: List) -> List:
    """The replacement's gradients for the inputs; its pairs go to
    :attr:`extra`. An exception it raises names the layer, and its result
    is checked (``methods._replacement.run_replacement``)."""
    def chain_rule():
      with site.paused():
        return site.vjp(below, True, False, False)[0]

    assert rule.replacement is not None  # compiled so for REPLACED
    with tf.name_scope(f"replace_backward_{rule.layer}".replace("/", "_")):
      ctx = BackwardContext(
          layer=site.layer, name=rule.layer, net=site.net,
          inputs=tuple(site.inputs), outputs=tuple(site.outputs),
          upstream=tuple(below),
          upstream_of=functools.partial(completed_upstream, self.done),
          chain_rule=chain_rule, resources=self.resources,
          executor=site.methods(), labels=self.labels)
      with site.recording():  # the replacement's ops, for context.vjp
        result = run_replacement(rule.replacement, ctx,
                                 f"replace_backward({rule.layer!r})")
    if not self.plain:
      self.extra += list(result.extra_grads_and_vars)
    return list(result.input_grads)

  # -- at an edge -----------------------------------------------------------

  def edge_backward(self, rule: Optional[EdgeRule], tensor,
                    grad: Gradient) -> Gradient:
    """The gradient an edge hands its lower layer at ``tensor``: ``grad``
    rewritten by the edge's transform (weighted by a linear one's factor),
    checked and traced; ``None`` where a zero factor sends nothing."""
    if rule is None or grad is None:
      return grad
    key = (rule.lower, rule.upper)
    ctx = self.context(rule.lower, "edge", tensor=tensor, edge=key)
    where = (f"transform_edge({rule.lower!r}, {rule.upper!r}) on "
             f"{describe(tensor)}")
    if rule.factor is None:
      return self.apply(rule.transform, grad, ctx, where)
    self._deferred(rule.transform, grad, ctx, where)
    return None if is_zero(rule.factor) else self.weigh(grad, rule.factor)

  # -- at a layer's variables ----------------------------------------------

  def transform_parameters(
      self, rules: Sequence[ParameterRule],
      pairs: Sequence[Tuple[Gradient, Any]],
      layer_of: Callable[[Any, Tuple[str, ...]], Optional[str]]
      ) -> List[Gradient]:
    """The gradients of ``pairs`` after the parameter transforms ``rules``.

    Args:
      rules: the plan's parameter rules, in the order they act.
      pairs: ``(gradient, variable)`` pairs; ``variable`` is ``None`` for a
        source that is no variable (a tensor given to ``tape.gradient``).
      layer_of: ``(variable, layers) -> name``: the layer among ``layers``
        that holds the variable (a Keras layer holds its nested layers'
        variables too), or ``None``.

    Returns:
      One gradient per pair.

    Raises:
      GraphGradError: naming the declaration, for an exception a transform
        raised; IncompatibleGradientError: for a result of another shape or
        dtype.
    """
    grads = [g for g, _ in pairs]
    for rule in rules:
      idx = [i for i, (_, v) in enumerate(pairs)
             if v is not None and layer_of(v, rule.layers) is not None]
      layers, fn = rule.layers, rule.transform
      named = layers[0] if len(layers) == 1 else list(layers)  # for messages
      if isinstance(fn, GroupTransform):
        new = _checks.checked_group(
            fn, [(grads[i], pairs[i][1]) for i in idx],
            self.context(", ".join(layers), "gradients"),
            f"transform_gradients({named!r}, {fn!r})", self.scale)
        for i, g in zip(idx, new):
          v = pairs[i][1]
          where = f"transform_gradients({named!r}, {fn!r}) on {v.name}"
          g = _checks.check_result(grads[i], g, where)
          if grads[i] is not None:
            self.record(self.context(layer_of(v, layers) or "", "gradients",
                                     variable=v), grads[i], g)
          grads[i] = g
        continue
      for i in idx:
        v = pairs[i][1]
        if grads[i] is not None:
          ctx = self.context(layer_of(v, layers) or "", "gradients",
                             variable=v)
          grads[i] = self.apply(fn, grads[i], ctx,
                                f"transform_gradients({named!r}) on {v.name}")
    return grads

  # -- transforms, the trace, weights ----------------------------------------

  def context(self, layer: Optional[str], role: str, **kw) -> TransformContext:
    """Where a transform is applied (``TransformContext``); an eager tensor,
    which has no name to derive seeds from, is left out."""
    t = kw.get("tensor")
    if t is not None and not tf.is_symbolic_tensor(t):
      kw["tensor"] = None
    return TransformContext(layer=layer, role=role,
                            global_step=self.global_step,
                            resources=self.resources, **kw)

  def apply(self, fn: Transform, grad: Gradient, ctx: TransformContext,
            where: str) -> Gradient:
    """``fn(grad)``, checked (``transforms._checks.checked``) and traced."""
    out = _checks.checked(fn, grad, ctx, where, self.scale)
    self.record(ctx, grad, out)
    return out

  def record(self, ctx: TransformContext, before: Gradient,
             after: Gradient = None,
             later: Optional[Callable[[], Gradient]] = None) -> None:
    """Adds a trace entry, with the loss scale the gradients carry."""
    if not self.plain:
      self.trace.append(TraceRecord(ctx, before, after, later=later,
                                    scale=self.scale))

  def _deferred(self, fn: Transform, grad: Gradient, ctx: TransformContext,
                where: str) -> None:
    def later():  # built when a summary or a report first reads it
      with self.later_scope():
        return _checks.checked(fn, grad, ctx, where, self.scale)
    self.record(ctx, grad, later=later)

  def weigh(self, grad: Gradient, factor: Optional[float]) -> Gradient:
    """``factor * grad``, sparse kept sparse; no op for a factor of 1."""
    return weigh(grad, factor, self._constant)

  def _constant(self, factor, dtype) -> tf.Tensor:
    # One constant per factor, dtype and graph, shared by every weighted
    # gradient of the pass.
    key = (factor, dtype, tf.compat.v1.get_default_graph())
    if key not in self._consts:
      self._consts[key] = tf.constant(factor, dtype)
    return self._consts[key]


def _upstream_where(rule: LayerRule, y) -> str:
  return f"transform_upstream({rule.layer!r}) on {describe(y)}"
