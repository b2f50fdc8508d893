"""Spans: runs of linearly rewritten layers that one segment backpropagates.

A layer whose only declaration is a linear upstream rewrite, and whose
outputs only the layer above it feeds, needs no cut: its outputs' gradient
is complete as soon as that layer has been backpropagated. A *span* is a
maximal run of such layers, from the top down, optionally led by the op
group of the loss. The engine builds it with one ``tf.gradients`` call, a
fused VJP, in which :mod:`graphgrad.plan._hooks` weights, for each layer,
the gradient its ops hand to the tensors below it, and reads the gradient
at each later layer's outputs, where the layer takes core's step
(``core._layer_step.FusedSite``).
"""

import collections
from typing import AbstractSet, Callable, Dict, List, Set, Tuple

import tensorflow as tf

from graphgrad import _compat
from graphgrad.core._gradients import is_one, is_zero
from graphgrad.plan import _hooks
from graphgrad.plan._cuts import CutPlan, Group, GroupKind, Key

Reader = Tuple[tf.Operation, int]


class Spans:
  """Finds the spans of a schedule and the hooks of each.

  Args:
    cuts: the plan's cuts and cut groups, on its layer graph and variables.
    factors: layer -> the factor of its linear upstream rewrite.
    special: layers with any other declaration (an edge into them, a
      backward replacement, a task combination, a cut a replacement reads):
      they never join a span.
    enabled: ``False`` finds no span (this TensorFlow has no hook point;
      see ``_hooks``).
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
            ) -> Dict[tf.Operation, _hooks.Hook]:
    """The hooks of one span's call.

    Args:
      span: the span's groups, first to last.
      weigh: ``(grad, factor) -> factor * grad``.
      record: called as ``record(tensor name, grad)`` with the gradient at
        each output of every group after the first.
    """
    hooks: Dict[tf.Operation, _hooks.Hook] = collections.defaultdict(
        _hooks.Hook)
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
