"""Segmented backpropagation: one call of the plan's VJP per segment.

The engine cuts the forward op graph where a rewritten gradient enters or
leaves a layer (``_cuts``): at the outputs and inputs of every layer with an
upstream rewrite, a backward replacement or a task combination, and at the
boundary tensors into every layer with an edge rewrite. Each cut group's
segment starts from its cuts with their complete gradient as ``grad_ys`` and
stops at the next cuts below, adding to their accumulators (``_backprop``);
groups run in topological order, so each accumulator is complete when read.

A linear rewrite ``c * g`` commutes with the backward map: the layer's
segment runs once and what it deposits below is weighted by ``c``; a span of
such layers takes one call (``_spans``). With no cut at all the executor
makes the single call ``Optimizer.minimize`` makes.
"""

import dataclasses
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Set

import tensorflow as tf

from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.core._gradients import aggregate, completed_upstream, is_zero
from graphgrad.core._layer_policy import layer_backward
from graphgrad.core._rules import EdgeRule, LayerRule, Mode, PlanRules
from graphgrad.plan import _hooks, _reach
from graphgrad.plan._backprop import Backprop, GraphVJP
from graphgrad.plan._cuts import CutPlan, Group, GroupKind, ancestors
from graphgrad.plan._op_override import Substitutions
from graphgrad.plan._spans import Spans

__all__ = ["Hooks", "Rewrite", "Segments"]


@dataclasses.dataclass(frozen=True)
class Rewrite:
  """An upstream or edge transform as the engine calls it.

  Attributes:
    fn: ``(grad, tensor) -> grad``, the transform with the plan's checks.
    observe: called as ``observe(grad, tensor)`` with each gradient that
      a ``LINEAR`` rule weights instead of calling ``fn`` on (summaries).
  """
  fn: Callable
  observe: Optional[Callable] = None


class Hooks(Protocol):
  """What the engine calls of the TF1 executor, per compiled rule."""

  def upstream(self, rule: LayerRule) -> Rewrite:
    """The layer's upstream transform."""

  def edge(self, rule: EdgeRule) -> Rewrite:
    """The edge's transform."""

  def replacement(self, rule: LayerRule) -> Callable:
    """The layer's backward replacement, called with keywords ``layer``,
    ``outputs``, ``upstream`` (the gradients at ``outputs`` after the
    upstream transform), ``inputs``, ``chain_rule`` (a function building
    what the chain rule would give) and ``upstream_of`` (layer name -> the
    complete gradients at that cut layer's outputs); it returns one
    gradient per input."""

  def tasks(self, rule: LayerRule) -> Callable:
    """``(grads, outputs) -> grads``: the layer's task combination."""


class _LayerSteps:
  """The steps of one cut layer (``core._layer_policy.LayerSteps``): one
  segment call per VJP."""

  def __init__(self, segments: "Segments", bp: Backprop, rule: LayerRule,
               ys, targets, own, other, stops):
    self.segments, self.bp, self.rule = segments, bp, rule
    self.ys, self.targets = ys, targets
    self.own, self.other, self.stops = own, other, stops

  def vjp(self, grads, inputs: bool, own: bool, other: bool):
    xs = self.targets if inputs else []
    names = (self.own if own else []) + (self.other if other else [])
    res = self.bp.call(self.ys, grads, xs, names, stops=self.stops)
    n, m = len(xs), len(self.own) if own else 0
    return list(res[:n]), list(res[n:n + m]), list(res[n + m:])

  def weigh(self, grad, factor):
    return self.bp.weigh(grad, factor)

  def arrived(self, grads):
    name, s = self.rule.layer, self.segments
    tasks = s.outputs_fn.get(name)
    s._done[name] = tasks(grads, self.ys) if tasks is not None else grads
    return s._done[name]

  def transform(self, grads):
    rw = self.segments.upstream[self.rule.layer]
    return [rw.fn(gy, y) for y, gy in zip(self.ys, grads)]

  def observe(self, grads):
    self.segments._observe(self.rule.layer, self.ys, grads)

  def replace(self, grads, chain_rule):
    name = self.rule.layer
    return self.segments.backward[name](
        layer=name, outputs=self.ys, upstream=grads, inputs=self.targets,
        upstream_of=self.segments._upstream_of, chain_rule=chain_rule)

  def override(self, grads):
    raise AssertionError("a tf.Graph plan overrides ops, not layers")


class Segments:
  """Plans and builds the segmented backward pass of one gradient plan.

  Args:
    net: the analysed layer graph.
    variables: the variables to differentiate.
    rules: the plan, compiled: each layer's mode and factor, the edges, the
      layers whose outputs a replacement reads.
    hooks: the executor's transforms, replacements and task combinations,
      asked once per rule that has one.
    options: keyword arguments for ``tf.gradients``, of the VJP made
      when ``vjp`` is not given.
    vjp: the plan's VJP (``_backprop.GraphVJP``), which every segment
      calls; by default one with ``options`` and ``overrides``.
    overrides: the plan's overridden ops: their functions replace the
      registered ones in every segment call (see ``_hooks``). Glue with an
      op whose function is not known to be linear is never covered by a
      layer above (a layer holding one is never ``LINEAR``: compiled so).
    spans: whether spans of linear layers may share one call; ``False``
      when the VJP differentiates copies of the forward ops
      (``plan.recompute``), which a span's per-op factors cannot reach.
  """

  def __init__(self, net: LayerGraph, variables, rules: PlanRules,
               hooks: Hooks, options: dict,
               vjp: Optional[GraphVJP] = None,
               overrides: Optional[Substitutions] = None,
               spans: bool = True):
    self.net = net
    self.rules = rules
    self.overrides = overrides or Substitutions()
    self.vjp = vjp or GraphVJP(options, self.overrides.fns)
    self.variables = {v.op.name: v for v in variables}
    self.upstream = {n: hooks.upstream(r) for n, r in rules.layers.items()
                     if r.upstream is not None}
    self.edges = {k: hooks.edge(e) for k, e in rules.edges.items()}
    self.options = options
    self.backward = {n: hooks.replacement(r) for n, r in rules.layers.items()
                     if r.mode is Mode.REPLACED}
    self.outputs_fn = {n: hooks.tasks(r) for n, r in rules.layers.items()
                       if r.tasks is not None}
    self.edge_uppers = {n for n, r in rules.layers.items() if r.edge_upper}
    cut_layers = {n for n, r in rules.layers.items() if r.cut}
    self._special = {n for n, r in rules.layers.items() if r.special}
    # A layer whose only rewrite is linear also backpropagates the glue
    # that feeds it alone: one segment per layer, not one more per glue op.
    factors = {n: r.factor for n, r in rules.layers.items()
               if r.mode is Mode.LINEAR and r.factor is not None}
    with_glue = [n for n in factors if n not in self._special]
    self.cuts = CutPlan(net, self.variables, cut_layers, self.edge_uppers,
                        with_glue, uncovered=self._nonlinear_overrides())
    # Each segment call walks only the ops behind its ys (see _reach).
    self._bound = _reach.can_bound(
        d["op"] for _, d in net.op_graph.nodes(data=True))
    self._done: Dict[str, List] = {}
    self._spans = Spans(
        net, self.cuts, self.variables, factors, self._special,
        enabled=spans and _hooks.available(),
        overridden=set(self.overrides.fns))

  def _nonlinear_overrides(self) -> Set[str]:
    """The overridden ops of the op graph whose function may not be linear."""
    known = self.net.op_graph
    return {n for n in self.overrides.fns
            if n in known and n not in self.overrides.linear}

  def schedule(self) -> List[Group]:
    """Returns the cut groups in execution order, with their segments."""
    return self.cuts.schedule()

  def build(self, seed: tf.Tensor,
            reduce: Optional[Callable] = None) -> Dict[str, List]:
    """Builds the backward pass; returns variable name -> contributions.

    Args:
      seed: the gradient of the loss.
      reduce: optional ``(var_names, grads) -> grads``, applied to the
        parameter gradients each segment call produces, before they join
        the variables' contributions.
    """
    bp = Backprop(self.vjp, self.variables, self._bound, reduce)
    bp.acc[self.net.loss.name].append(seed)
    self._done = {}
    run = {GroupKind.LAYER: self._run_layer, GroupKind.EDGE: self._run_edge,
           GroupKind.OP: self._run_op}
    order = self.schedule()
    spans = self._spans.find(order)
    covered = {g.key for span in spans.values() for g in span[1:]}
    for group in order:
      if group.key in spans:
        self._run_span(spans[group.key], bp)
      elif group.key not in covered:
        run[group.key.kind](group, bp)
    bp.fill_zeros(lambda ts: ancestors(self.net, ts))
    return bp.var_grads

  # -- spans of linear layers (see _spans) -----------------------------------

  def _run_span(self, span: List[Group], bp: Backprop) -> None:
    """One call from the first group's sources to the last one's targets."""
    head, last = span[0], span[-1]
    g = bp.total(head.sources)
    if head.key.kind is GroupKind.LAYER:
      self._observe(head.key.name, head.sources, g)
    seen: Dict[str, object] = {}
    hooks = self._spans.hooks(span, bp.weigh, seen.setdefault)
    variables = list(dict.fromkeys(n for x in span for n in x.variables))
    res = bp.call(head.sources, g, last.targets, variables,
                  stops=last.targets, hooks=hooks)
    bp.deposit(last.targets, variables, res)
    for group in span[1:]:
      self._observe(group.key.name, group.sources,
                    [seen.get(t.name) for t in group.sources])

  def _observe(self, name: str, ys: Sequence[tf.Tensor], g: List) -> None:
    self._done[name] = g
    rw = self.upstream.get(name)
    if rw is not None and rw.observe is not None:
      for y, gy in zip(ys, g):
        rw.observe(gy, y)

  # -- one method per kind of cut group --------------------------------------

  def _run_op(self, group: Group, bp: Backprop) -> None:
    ys = group.sources
    res = bp.call(ys, bp.total(ys), group.targets, group.variables)
    bp.deposit(group.targets, group.variables, res)

  def _run_layer(self, group: Group, bp: Backprop) -> None:
    """A cut layer: the per-layer policy, with one segment call per VJP."""
    name, ys = group.key.name, group.sources
    rule = self.rules.rule(name)
    own = [n for n in group.variables
           if self.net.layer_of_variable(self.variables[n]) == name]
    other = [n for n in group.variables if n not in own]
    store = bp.edge_grads[name] if rule.edge_upper else None
    # A replacement answers for every input; a zero edge removes the rest.
    targets = (group.targets if rule.mode is Mode.REPLACED
               else self._live_inputs(group, bp))
    steps = _LayerSteps(self, bp, rule, ys, targets, own, other,
                        group.targets)
    result = layer_backward(rule, bp.total(ys), steps)
    bp.deposit([], own + other, result.own + result.other)
    if result.inputs is None:
      bp.drop(targets, other)
    else:
      bp.deposit(targets, [], result.inputs, store=store)

  def _live_inputs(self, group: Group, bp: Backprop) -> List[tf.Tensor]:
    """The layer's targets, less those whose edge is ``zero()``."""
    name = group.key.name
    if name not in self.edge_uppers:
      return group.targets
    return self._not_zeroed(group.targets, name, bp)

  def _not_zeroed(self, targets, upper: str, bp: Backprop) -> List[tf.Tensor]:
    """``targets`` but those whose edge into ``upper`` is ``zero()``."""
    live = []
    for t in targets:
      edge = self._edge_rule(t, upper)
      if edge is not None and is_zero(edge.factor):
        bp.drop([t])
      else:
        live.append(t)
    return live

  def _edge_rule(self, t: tf.Tensor, upper: str) -> Optional[EdgeRule]:
    lower = self.net.layer_of(t.op)
    return None if lower is None else self.rules.edges.get((lower, upper))

  def _upstream_of(self, layer: str) -> List:
    return completed_upstream(self._done, layer)

  def _run_edge(self, group: Group, bp: Backprop) -> None:
    """Hands an upper layer's edge gradient to each lower layer, rewritten."""
    name, store = group.key.name, bp.edge_grads[group.key.name]
    for t in group.direct:
      bp.add(t, self._edge(t, name, aggregate(store.get(t.name, ()), like=t),
                           bp))
    live = self._not_zeroed(group.targets, name, bp)
    glue = group.glue
    res = bp.call(glue, bp.total(glue, store), live, group.variables,
                  stops=group.targets)
    for t, r in zip(live, res):
      bp.add(t, self._edge(t, name, r, bp))
    bp.deposit([], group.variables, res[len(live):])

  def _edge(self, t: tf.Tensor, upper: str, grad, bp: Backprop):
    edge = self._edge_rule(t, upper)
    if edge is None or grad is None:
      return grad
    rw = self.edges[edge.lower, edge.upper]
    if edge.factor is None:
      return rw.fn(grad, t)
    if rw.observe is not None:
      rw.observe(grad, t)
    return bp.weigh(grad, edge.factor)
