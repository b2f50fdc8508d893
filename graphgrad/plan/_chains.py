"""Runs of linearly rewritten layers that one ``tf.gradients`` call covers.

With ``scale`` on every boundary of an MLP, every layer is cut, and each cut
used to cost a segment call of its own. A layer whose only declaration is a
linear upstream rewrite, and whose outputs only the layer above it feeds,
needs no cut: its outputs' gradient is complete as soon as that layer has
been backpropagated. A *chain* is a maximal run of such layers, from the top
down, optionally led by the op group of the loss. The engine builds it with
one call, in which :mod:`graphgrad.plan._hooks` weights, for each layer, the
gradient its ops hand to the tensors below it, and reads the gradient at each
later layer's outputs for the plan's trace.
"""

import collections
from typing import Callable, Dict, List, Set, Tuple

import tensorflow as tf

from graphgrad import _compat
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.plan import _hooks
from graphgrad.plan._backprop import is_one, is_zero
from graphgrad.plan._cuts import CutPlan, Group, Key, Kind

Entry = Tuple[tf.Operation, int]


class Chains:
  """Finds the chains of a schedule and the hooks of each.

  Args:
    net: the analysed layer graph.
    cuts: the plan's cuts and source groups.
    variables: variable op name -> differentiated variable.
    factors: layer -> the factor of its linear upstream rewrite.
    special: layers with any other declaration (an edge into them, a
      backward replacement, a task combination, a cut a replacement reads):
      they never join a chain.
    enabled: ``False`` finds no chain (the plan overrides gradients, or
      this TensorFlow has no hook point; see ``_hooks``).
  """

  def __init__(self, net: LayerGraph, cuts: CutPlan,
               variables: Dict[str, tf.Variable], factors: Dict[str, float],
               special: Set[str], enabled: bool = True):
    self.enabled = enabled
    self.net = net
    self.cuts = cuts
    self.variables = variables
    self.factors = factors
    self.special = special
    self._entries: Dict[Key, List[Entry]] = {}

  def find(self, order: List[Group]) -> Dict[Key, List[Group]]:
    """Chains of ``order`` (the schedule), keyed by their first group.

    A layer joins the chain above it when the chain's last group adds to it
    and nothing else does. Every layer of a chain has a nonzero linear
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
    chains: Dict[Key, List[Group]] = {}
    taken: set = set()
    for g in order:
      if g.key in taken or not self._linkable(g, head=True):
        continue
      chain = [g]
      while True:
        below = set(below_of[chain[-1].key])
        nxt = by_key.get(below.pop()) if len(below) == 1 else None
        if (nxt is None or nxt.key in taken
            or feeders[nxt.key] != {chain[-1].key}
            or not self._linkable(nxt)):
          break
        chain.append(nxt)
      if len(chain) > 1:
        chains[g.key] = chain
        taken.update(x.key for x in chain)
    return chains

  def hooks(self, chain: List[Group], weigh: Callable,
            record: Callable[[str, object], object]
            ) -> Dict[tf.Operation, _hooks.Hook]:
    """The hooks of one chain's call.

    Args:
      chain: the chain's groups, first to last.
      weigh: ``(grad, factor) -> factor * grad``.
      record: called as ``record(tensor name, grad)`` with the gradient at
        each output of every group after the first.
    """
    hooks: Dict[tf.Operation, _hooks.Hook] = collections.defaultdict(
        _hooks.Hook)
    for group in chain:
      factor = (self.factors.get(group.key.name)
                if group.key.kind is Kind.LAYER else None)
      if not is_one(factor):
        for op, j in self._entries_of(group):
          hooks[op].scale.append((j, lambda g, f=factor: weigh(g, f)))
    for group in chain[1:]:
      for t in group.sources:
        hooks[t.op].read.append((t.value_index,
                                 lambda g, n=t.name: record(n, g)))
    return dict(hooks)

  def _linkable(self, group: Group, head: bool = False) -> bool:
    name = group.key.name
    if group.key.kind is Kind.OP:
      # The loss, or a glue op above the first layer: nothing to weight.
      return head
    factor = self.factors.get(name)
    if (group.key.kind is not Kind.LAYER or factor is None
        or is_zero(factor) or name in self.special):
      return False
    if any(self.net.layer_of_variable(self.variables[n]) != name
           for n in group.variables):
      return False
    # The hooked ops: those reading the tensors below, and the producers of
    # the outputs. Each needs a registered gradient function, and none may
    # sit in a tf.compat.v1 loop or cond (an Enter, a Switch, an Exit),
    # whose gradients TF builds in the loop's own context.
    ops = [op for op, _ in self._entries_of(group)]
    ops += [t.op for t in group.sources]
    return all(_hooks.registered(op) is not None
               and _compat.control_flow_context(op) is None for op in ops)

  def _entries_of(self, group: Group) -> List[Entry]:
    """(op, input index) where the layer's segment reads a tensor below."""
    if group.key not in self._entries:
      known = self.net.op_graph
      out = []
      for t in group.targets:
        for op in t.consumers():
          if op.name in known and self.cuts.inside(op, group.key.name):
            out += [(op, j) for j, x in enumerate(op.inputs) if x is t]
      self._entries[group.key] = out
    return self._entries[group.key]
