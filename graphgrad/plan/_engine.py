"""Segmented backpropagation: one call of the plan's VJP per segment.

The engine cuts the forward op graph where a rewritten gradient enters or
leaves a layer (``_cuts``): at the outputs and inputs of every layer with an
upstream rewrite, a backward replacement or a task combination, and at the
boundary tensors into every layer with an edge rewrite. Each cut group's
segment starts from its cuts with their complete gradient as ``grad_ys`` and
stops at the next cuts below, adding to their accumulators (``_backprop``);
groups run in topological order, so each accumulator is complete when read.
A linear rewrite ``c * g`` commutes with the backward map, so a *span* of
such layers takes one call, a fused VJP whose hooks (``_backprop.Hook``)
weight what each layer hands below and read each later layer's outputs,
where it takes core's step (``FusedSite``). With no cut at all the
executor makes the single call ``Optimizer.minimize`` makes.
"""

import collections
import contextlib
import functools
from typing import AbstractSet, Callable, Dict, List, Optional, Set, Tuple

import tensorflow as tf

from graphgrad import _compat
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.core._gradients import aggregate, is_one, is_zero
from graphgrad.core._layer_step import (
  BackwardPass,
  FusedSite,
  sends_nothing,
  split_vjp,
)
from graphgrad.core._rules import EdgeRule, LayerRule, Mode, PlanRules
from graphgrad.core._task_combination import call_deltas
from graphgrad.plan._backprop import (
  Backprop,
  GraphVJP,
  Hook,
  can_bound,
  hooks_available,
)
from graphgrad.plan._cuts import CutPlan, Group, GroupKind, Key, ancestors
from graphgrad.plan._op_override import Substitutions
from graphgrad.plan._replacement_graph import GraphBackward

__all__ = ["Segments", "Spans"]

Reader = Tuple[tf.Operation, int]


class _SegmentSite:
  """One cut layer in the engine (``core._layer_step.Site``): one segment
  call per VJP."""

  def __init__(self, segments: "Segments", bp: Backprop, rule: LayerRule,
               ys, targets, own, other, stops):
    self.segments, self.bp, self.rule = segments, bp, rule
    self.outputs, self.inputs = ys, targets
    self.own, self.other, self.stops = own, other, stops

  @property
  def net(self) -> LayerGraph:
    return self.segments.net

  @property
  def layer(self):
    return self.segments.net[self.rule.layer]

  def vjp(self, grads, inputs: bool, own: bool, other: bool):
    return split_vjp(
        lambda xs, names: self.bp.call(self.outputs, grads, xs, names,
                                       stops=self.stops),
        self.inputs, self.own, self.other, inputs, own, other)

  def task_deltas(self, grads):
    return self.segments.deltas[self.rule.layer]

  def methods(self):
    return GraphBackward(self.segments.net, self.rule.layer,
                         self.segments.step.resources, self.segments.vjp,
                         self.outputs)

  def recording(self):
    return contextlib.nullcontext()

  paused = recording


class Segments:
  """Plans and builds the segmented backward pass of one gradient plan.

  Args:
    net: the analysed layer graph.
    variables: the variables to differentiate.
    rules: the plan, compiled: each layer's mode and factor, the edges, the
      layers whose outputs a replacement reads.
    step: the backward pass (``core._layer_step``) that acts at each cut
      layer and edge, and records what it did.
    vjp: the plan's VJP (``_backprop.GraphVJP``), which every segment
      calls.
    overrides: the plan's overridden ops: their functions replace the
      registered ones in every segment call (``_backprop.hooked``). Glue with an
      op whose function is not known to be linear is never covered by a
      layer above (a layer holding one is never ``LINEAR``: compiled so).
    spans: whether spans of linear layers may share one call; ``False``
      when the VJP differentiates copies of the forward ops
      (``plan.recompute``), which a span's per-op factors cannot reach.
  """

  def __init__(self, net: LayerGraph, variables, rules: PlanRules,
               step: BackwardPass, vjp: GraphVJP, overrides: Substitutions,
               spans: bool = True):
    self.net = net
    self.rules = rules
    self.step = step
    # Task layer -> the task deltas at its outputs, made as build starts.
    self.deltas: Dict[str, List] = {}
    self.vjp = vjp
    self.variables = {v.op.name: v for v in variables}
    edge_uppers = {n for n, r in rules.layers.items() if r.edge_upper}
    cut_layers = {n for n, r in rules.layers.items() if r.cut}
    special = {n for n, r in rules.layers.items() if r.special}
    # A layer whose only rewrite is linear also backpropagates the glue
    # that feeds it alone: one segment per layer, not one more per glue op.
    factors = {n: r.factor for n, r in rules.layers.items()
               if r.mode is Mode.LINEAR and r.factor is not None}
    with_glue = [n for n in factors if n not in special]
    nonlinear = {n for n in overrides.fns
                 if n in net.op_graph and n not in overrides.linear}
    self.cuts = CutPlan(net, self.variables, cut_layers, edge_uppers,
                        with_glue, uncovered=nonlinear)
    # Each segment call walks only the ops behind its ys (_backprop.behind).
    self._bound = can_bound(
        d["op"] for _, d in net.op_graph.nodes(data=True))
    self._spans = Spans(self.cuts, factors, special,
                        enabled=spans and hooks_available(),
                        overridden=set(overrides.fns))

  def build(self, seed: tf.Tensor,
            reduce: Optional[Callable] = None) -> Dict[str, List]:
    """Builds the backward pass; returns variable name -> contributions.

    Args:
      seed: the gradient of the loss.
      reduce: optional ``(variables, grads) -> grads``, applied to the
        parameter gradients each segment call produces, before they join
        the variables' contributions.
    """
    bp = Backprop(self.vjp, self.variables, self._bound, reduce)
    bp.acc[self.net.loss.name].append(seed)
    run = {GroupKind.LAYER: self._run_layer, GroupKind.EDGE: self._run_edge,
           GroupKind.OP: self._run_op}
    order = self.cuts.schedule()
    self.deltas = self._task_deltas(order)
    spans = self._spans.find(order)
    covered = {g.key for span in spans.values() for g in span[1:]}
    for group in order:
      if group.key in spans:
        self._run_span(spans[group.key], bp)
      elif group.key not in covered:
        run[group.key.kind](group, bp)
    bp.fill_zeros(lambda ts: ancestors(self.net, ts))
    return bp.var_grads

  def _task_deltas(self, order: List[Group]) -> Dict[str, List]:
    """Task layer -> per output, ``combine(g_i) - sum_i g_i`` at the
    outputs its cut group starts from (``core._task_combination``)."""
    out = {}
    for group in order:
      name = group.key.name
      task = (self.rules.rule(name).tasks
              if group.key.kind is GroupKind.LAYER else None)
      if task is not None:
        state_of = functools.partial(self.step.resources.get_or_create, name,
                                     "combine_tasks/state")
        out[name], = call_deltas(self.vjp, self.net.loss, name,
                                 task.losses or (), [group.sources],
                                 task.method, state_of)
    return out

  # -- spans of linear layers (see Spans) ------------------------------------

  def _run_span(self, span: List[Group], bp: Backprop) -> None:
    """One call from the first group's sources to the last one's targets,
    a fused VJP of the span's layers: each takes core's step with a
    ``FusedSite``, the first one making the call."""
    head, last = span[0], span[-1]
    seen: Dict[str, object] = {}
    variables = list(dict.fromkeys(n for x in span for n in x.variables))

    def call(g: List) -> None:
      hooks = self._spans.hooks(span, self.step.weigh, seen.setdefault)
      res = bp.call(head.sources, g, last.targets, variables,
                    stops=last.targets, hooks=hooks)
      bp.deposit(last.targets, variables, res)

    g = bp.total(head.sources)
    if head.key.kind is GroupKind.LAYER:
      self.step.layer_backward(self.rules.rule(head.key.name),
                               FusedSite(head.sources, call), g)
    else:  # the loss, or glue above the first layer
      call(g)
    for group in span[1:]:
      self.step.layer_backward(self.rules.rule(group.key.name),
                               FusedSite(group.sources),
                               [seen.get(t.name) for t in group.sources])

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
               or not rule.edge_upper
               else self._not_zeroed(group.targets, name, bp))
    site = _SegmentSite(self, bp, rule, ys, targets, own, other,
                        group.targets)
    result = self.step.layer_backward(rule, site, bp.total(ys))
    bp.deposit([], own + other, result.own + result.other)
    if result.inputs is None:
      bp.drop(targets, other)
    else:
      bp.deposit(targets, [], result.inputs, store=store)

  def _not_zeroed(self, targets, upper: str, bp: Backprop) -> List[tf.Tensor]:
    """``targets`` but those whose edge into ``upper`` is ``zero()``."""
    live = []
    for t in targets:
      if sends_nothing(self._edge_rule(t, upper)):
        bp.drop([t])
      else:
        live.append(t)
    return live

  def _edge_rule(self, t: tf.Tensor, upper: str) -> Optional[EdgeRule]:
    lower = self.net.layer_of(t.op)
    return None if lower is None else self.rules.edges.get((lower, upper))

  def _run_edge(self, group: Group, bp: Backprop) -> None:
    """Hands an upper layer's edge gradient to each lower layer, rewritten."""
    name, store = group.key.name, bp.edge_grads[group.key.name]
    for t in group.direct:
      bp.add(t, self.step.edge_backward(
          self._edge_rule(t, name), t,
          aggregate(store.get(t.name, ()), like=t)))
    live = self._not_zeroed(group.targets, name, bp)
    glue = group.glue
    res = bp.call(glue, bp.total(glue, store), live, group.variables,
                  stops=group.targets)
    for t, r in zip(live, res):
      bp.add(t, self.step.edge_backward(self._edge_rule(t, name), t, r))
    bp.deposit([], group.variables, res[len(live):])


class Spans:
  """Finds the spans of a schedule and the hooks of each.

  A layer whose only declaration is a linear upstream rewrite, and whose
  outputs only the layer above it feeds, needs no cut: its outputs'
  gradient is complete as soon as that layer has been backpropagated. A
  *span* is a maximal run of such layers, from the top down, optionally led
  by the op group of the loss, which one segment call covers.

  Args:
    cuts: the plan's cuts and cut groups, on its layer graph and variables.
    factors: layer -> the factor of its linear upstream rewrite.
    special: layers with any other declaration (an edge into them, a
      backward replacement, a task combination, a cut a replacement reads):
      they never join a span.
    enabled: ``False`` finds no span (this TensorFlow has no hook point:
      ``_backprop.hooks_available``).
    overridden: names of the ops the plan overrides: their function, which
      the segment call substitutes for the registered one, is what a hook
      wraps.
  """

  def __init__(self, cuts: CutPlan, factors: Dict[str, float],
               special: Set[str], enabled: bool = True,
               overridden: AbstractSet[str] = frozenset()):
    self.enabled = enabled
    self.overridden = overridden
    self.cuts = cuts
    self.factors = factors
    self.special = special
    self._entries: Dict[Key, List[Reader]] = {}

  def find(self, order: List[Group]) -> Dict[Key, List[Group]]:
    """Spans of ``order`` (the schedule), keyed by their first group.

    A layer joins the span above it when the span's last group adds to it
    and nothing else does. Every layer of a span has a nonzero linear
    upstream rewrite, no other declaration, and no other layer's variables
    in its segment.
    """
    if not self.enabled:
      return {}
    by_key = {g.key: g for g in order}
    below_of = {g.key: set(self.cuts.downstream(g)) for g in order}
    feeders: Dict[Key, set] = collections.defaultdict(set)
    for key, below in below_of.items():
      for k in below:
        feeders[k].add(key)
    spans: Dict[Key, List[Group]] = {}
    taken: set = set()
    for g in order:
      if g.key in taken or not self._linkable(g, head=True):
        continue
      span = [g]
      while True:
        below = set(below_of[span[-1].key])
        nxt = by_key.get(below.pop()) if len(below) == 1 else None
        if (nxt is None or nxt.key in taken
            or feeders[nxt.key] != {span[-1].key}
            or not self._linkable(nxt)):
          break
        span.append(nxt)
      if len(span) > 1:
        spans[g.key] = span
        taken.update(x.key for x in span)
    return spans

  def hooks(self, span: List[Group], weigh: Callable,
            record: Callable[[str, object], object]
            ) -> Dict[tf.Operation, Hook]:
    """The hooks of one span's call.

    Args:
      span: the span's groups, first to last.
      weigh: ``(grad, factor) -> factor * grad``.
      record: called as ``record(tensor name, grad)`` with the gradient at
        each output of every group after the first.
    """
    hooks: Dict[tf.Operation, Hook] = collections.defaultdict(
        Hook)
    for group in span:
      factor = (self.factors.get(group.key.name)
                if group.key.kind is GroupKind.LAYER else None)
      if not is_one(factor):
        for op, j in self._entries_of(group):
          hooks[op].scale.append((j, lambda g, f=factor: weigh(g, f)))
    for group in span[1:]:
      for t in group.sources:
        hooks[t.op].read.append((t.value_index,
                                 lambda g, n=t.name: record(n, g)))
    return dict(hooks)

  def _linkable(self, group: Group, head: bool = False) -> bool:
    name = group.key.name
    if group.key.kind is GroupKind.OP:
      # The loss, or a glue op above the first layer: nothing to weight.
      return head
    factor = self.factors.get(name)
    if (group.key.kind is not GroupKind.LAYER or factor is None
        or is_zero(factor) or name in self.special):
      return False
    if any(self.cuts.net.layer_of_variable(self.cuts.variables[n]) != name
           for n in group.variables):
      return False
    # The hooked ops: those reading the tensors below, and the producers of
    # the outputs. Each needs a gradient function (registered, or the
    # plan's override), and none may sit in a tf.compat.v1 loop or cond (an
    # Enter, a Switch, an Exit), whose gradients TF builds in the loop's own
    # context.
    ops = [op for op, _ in self._entries_of(group)]
    ops += [t.op for t in group.sources]
    return all((op.name in self.overridden
                or _compat.registered_gradient(op) is not None)
               and _compat.control_flow_context(op) is None for op in ops)

  def _entries_of(self, group: Group) -> List[Reader]:
    """(op, input index) where the layer's segment reads a tensor below."""
    if group.key not in self._entries:
      known = self.cuts.net.op_graph
      out = []
      for t in group.targets:
        for op in t.consumers():
          if op.name in known and self.cuts.inside(op, group.key.name):
            out += [(op, j) for j, x in enumerate(op.inputs) if x is t]
      self._entries[group.key] = out
    return self._entries[group.key]
