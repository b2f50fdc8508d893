"""Where the backward pass is cut, and its cut groups in order.

A *cut group* is the cuts where one segment's ``tf.gradients`` call starts:

* :attr:`GroupKind.LAYER`: the outputs of one cut layer;
* :attr:`GroupKind.EDGE`: the inputs of a layer with an edge rewrite, from which
  each lower layer's edge gradient is handed on, rewritten;
* :attr:`GroupKind.OP`: the outputs of one cut op that belongs to no cut layer
  (the loss, a glue op at a boundary).

Each group's segment is the part of the forward op graph behind its sources
up to the next cuts: its *targets* (cut tensors where the walk stopped) and
the differentiated variables it reached.
"""

import collections
import dataclasses
import enum
import functools
import logging
from typing import (
  AbstractSet,
  Callable,
  Dict,
  Iterable,
  List,
  NamedTuple,
  Optional,
  Sequence,
  Set,
)

import networkx as nx
import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util, _layer_names
from graphgrad.analysis._graph_util import differentiable
from graphgrad.analysis._layer_graph import LayerGraph

log = logging.getLogger("graphgrad")


class GroupKind(enum.Enum):
  """The kinds of cut group."""
  LAYER = "layer"
  EDGE = "edge"
  OP = "op"


class Key(NamedTuple):
  """Names one cut group: its kind, and a layer or op name."""
  kind: GroupKind
  name: str

  def __str__(self) -> str:
    return f"{self.kind.value}:{self.name}"


@dataclasses.dataclass
class Group:
  """One cut group and its segment.

  Attributes:
    key: the group's kind and name.
    sources: the tensors the segment starts from (its ``ys``).
    targets: cut tensors below, where the segment stops.
    variables: names of the differentiated variables in the segment.
    direct: for a edge group, the upper layer's inputs that a lower layer
      produces itself.
    glue: for a edge group, the upper layer's inputs that glue produces.
  """
  key: Key
  sources: List[tf.Tensor]
  targets: List[tf.Tensor]
  variables: List[str]
  direct: List[tf.Tensor] = dataclasses.field(default_factory=list)
  glue: List[tf.Tensor] = dataclasses.field(default_factory=list)


class CutPlan:
  """The cut tensors of a plan, and the cut groups between them.

  Args:
    net: the analysed layer graph.
    variables: variable op name -> differentiated variable.
    cut_layers: the layers whose outputs and inputs are cut.
    edge_uppers: the upper layers of edge rewrites; every boundary tensor
      into them is cut too.
    with_glue: cut layers whose segment also covers the glue below them
      that feeds nothing else (a linear rewrite weights what the segment
      deposits, and glue is linear to backpropagate), so that the glue needs
      no segment of its own.
    uncovered: names of glue ops that no layer covers (overridden ops whose
      gradient function may not be linear).
  """

  def __init__(self, net: LayerGraph, variables: Dict[str, tf.Variable],
               cut_layers: Set[str], edge_uppers: Set[str],
               with_glue: Iterable[str] = (),
               uncovered: AbstractSet[str] = frozenset()):
    self.net = net
    self.uncovered = uncovered
    self.variables = variables
    self.cut_layers = cut_layers
    self.edge_uppers = edge_uppers
    self.with_glue = set(with_glue) & cut_layers
    self.glue_of: Dict[str, Set[str]] = {}
    self._dep = self._variable_dependent_ops()
    cut_tensors = self._cut_tensors()
    # Group cut tensors by the op that produces them: tf.gradients stops at
    # ops, so every differentiable output of a cut op is a cut.
    self.group_of: Dict[str, Key] = {}
    producers = {t.op.name: name for name, ts in self.outputs.items()
                 for t in ts}
    self.cut_ops: Set[str] = {t.op.name for t in cut_tensors}
    self.cut_ops.add(net.loss.op.name)
    for op_name in self.cut_ops:
      layer = producers.get(op_name)
      self.group_of[op_name] = (Key(GroupKind.LAYER, layer) if layer
                                else Key(GroupKind.OP, op_name))
    self._cut_where_segments_meet()

  def _cut_where_segments_meet(self) -> None:
    """Cuts the ops where the segments of two op groups would meet.

    Without a cut there, both segments backpropagate everything below such
    an op (on a residual net, the whole identity path below every cut):
    quadratic in depth. A cut makes it an op group of its own, whose one
    call runs once its gradient is complete. An op is cut where walks of
    two groups reach it through two consumers; one reached through a
    single consumer is behind the op that is.
    """
    g = self.net.op_graph
    while True:
      walks: Dict[str, Set[str]] = collections.defaultdict(set)
      via: Dict[str, Set[str]] = collections.defaultdict(set)
      for name, key in list(self.group_of.items()):
        if key.kind is GroupKind.OP and name in g:
          self.segment([g.nodes[name]["op"]], visit=functools.partial(
              _record, walks, via, name))
      meeting = [n for n, starts in walks.items()
                 if len(starts) > 1 and len(via[n]) > 1
                 and self._cuttable(g.nodes[n]["op"])]
      if not meeting:
        return
      for n in meeting:
        self.cut_ops.add(n)
        self.group_of[n] = Key(GroupKind.OP, n)

  def _cuttable(self, op: tf.Operation) -> bool:
    return (not _graph_util.in_control_flow(op)
            and all(differentiable(t) for t in op.outputs)
            and self.net.layer_of(op) not in self.cut_layers)

  def _variable_dependent_ops(self) -> Set[str]:
    """Forward ops downstream of a differentiated variable."""
    g = self.net.op_graph
    loops = collections.defaultdict(list)
    for src, dst in self.net.loop_edges:
      loops[src].append(dst)
    seen = {n for n in self.variables if n in g}
    stack = list(seen)
    while stack:
      cur = stack.pop()
      for nxt in list(g.successors(cur)) + loops.get(cur, []):
        if nxt not in seen:
          seen.add(nxt)
          stack.append(nxt)
    return seen

  def _relevant(self, t: tf.Tensor) -> bool:
    return differentiable(t) and t.op.name in self._dep

  def _cut_tensors(self) -> List[tf.Tensor]:
    net = self.net
    self.outputs: Dict[str, List[tf.Tensor]] = {}
    self.inputs: Dict[str, List[tf.Tensor]] = {}
    cut_tensors: List[tf.Tensor] = []
    for name in sorted(self.cut_layers):
      layer = net[name]
      self.outputs[name] = [t for t in layer.outputs if differentiable(t)]
      cut_tensors += self.outputs[name]
      if name not in self.with_glue:
        self.inputs[name] = [t for t in layer.inputs if self._relevant(t)]
        cut_tensors += self.inputs[name]
    for up in self.edge_uppers:
      for lo in net.graph.predecessors(up):
        cut_tensors += [t for t in net.graph.edges[lo, up]["tensors"]
                        if self._relevant(t)]
    fixed = {t.name for t in cut_tensors}
    for name in sorted(self.with_glue):
      self.glue_of[name] = self._glue_below(name, fixed)
      self.inputs[name] = self._inputs_with_glue(name)
      cut_tensors += self.inputs[name]
    for t in cut_tensors:
      if _graph_util.in_control_flow(t.op):
        raise _errors.UnsupportedGraphError(
            f"the boundary tensor {t.name} lies inside a tf.compat.v1 while "
            f"loop or cond, where its gradient cannot be rewritten as a "
            f"whole. Move the transform to a layer outside the loop, or "
            f"group the loop into one layer (gg.analyze(loss, depth=...) or "
            f"layers=...).")
    return cut_tensors

  def inside(self, op: tf.Operation, name: str) -> bool:
    """Whether ``op`` is in layer ``name``'s segment (or glue it covers)."""
    return (self.net.layer_of(op) == name
            or op.name in self.glue_of.get(name, ()))

  def _glue_below(self, name: str, fixed: Set[str]) -> Set[str]:
    """Glue ops below ``name`` whose consumers are the layer or such glue."""
    net, g = self.net, self.net.op_graph
    glue_of: Set[str] = set()
    stack = [t.op for t in net[name].inputs]
    while stack:
      p = stack.pop()
      if (p.name in glue_of or p.name not in self._dep
          or p.name in self.uncovered or net.layer_of(p) is not None
          or p.name == net.loss.op.name
          or _graph_util.in_control_flow(p)
          or any(t.name in fixed for t in p.outputs)
          # a TensorList's gradient is refused at the layer, as on the cut
          # path; nor is a loop's TensorList covered through its reader
          or not all(differentiable(t) for t in p.outputs)
          or any(t.dtype == tf.variant for t in p.inputs)
          # its inputs would become cut tensors inside a v1 loop
          or any(_graph_util.in_control_flow(t.op) for t in p.inputs)):
        continue
      if all(net.layer_of(g.nodes[c]["op"]) == name or c in glue_of
             for c in g.successors(p.name)):
        glue_of.add(p.name)
        stack += [t.op for t in p.inputs]
    return glue_of

  def _inputs_with_glue(self, name: str) -> List[tf.Tensor]:
    g = self.net.op_graph
    ops = [g.nodes[n]["op"] for n in sorted(self.glue_of[name])]
    entering: Dict[str, tf.Tensor] = {}
    for t in [t for op in ops for t in op.inputs] + list(self.net[name].inputs):
      if not self.inside(t.op, name) and self._relevant(t):
        entering[t.name] = t
    return list(entering.values())

  # -- segments --------------------------------------------------------------

  def segment(self, start_ops: Iterable[tf.Operation],
             inside: Optional[str] = None, glue_only: bool = False,
             visit: Optional[Callable] = None):
    """Walks back from ``start_ops`` to the next cuts.

    Returns (targets, variable names): cut tensors where the walk stopped and
    differentiated variables it reached. With ``inside``, the walk stays in
    that layer and stops at every tensor entering it. With ``glue_only``, the
    walk crosses glue ops, even cut ones, and stops at every layer's tensor.
    ``visit(consumer, producer)`` is called for each op the walk crosses
    into, once per consumer.
    """
    targets: Dict[str, tf.Tensor] = {}
    var_names: Dict[str, None] = {}
    stack = list({op.name: op for op in start_ops}.values())
    seen = {op.name for op in stack}
    while stack:
      consumer = stack.pop()
      for t in consumer.inputs:
        if _graph_util.is_handle(t):
          var = _graph_util.variable_of_handle(t)
          if var in self.variables:
            var_names[var] = None
          continue
        # Variant tensors (TensorLists of while_v2 loops) carry gradients
        # too; they are walked through, never cut.
        if t.op.name not in self._dep or not (differentiable(t)
                                               or t.dtype == tf.variant):
          continue
        if self._stops(t, inside, glue_only):
          targets[t.name] = t
          continue
        if visit is not None:
          visit(consumer, t.op)
        if t.op.name not in seen:
          seen.add(t.op.name)
          stack.append(t.op)
    return list(targets.values()), list(var_names)

  def _stops(self, t: tf.Tensor, inside: Optional[str],
             glue_only: bool) -> bool:
    """Whether a segment walk stops at ``t``; refuses a gradient past a cut."""
    net, p = self.net, t.op
    if inside is not None:
      if self.inside(p, inside):
        return False
      if not differentiable(t):
        raise _errors.UnsupportedGraphError(
            f"layer {inside!r} takes the {t.dtype.name} input {t.name}, "
            f"through which its gradient would leave it past the "
            f"transform. Group the op that produces {t.name} into the "
            f"layer, or transform another layer.")
      return True
    if glue_only and net.layer_of(p) is None:
      return False  # an edge gradient crosses glue, cut or not
    if not (glue_only or p.name in self.cut_ops
            or net.layer_of(p) in self.cut_layers):
      return False
    if not differentiable(t) or p.name not in self.cut_ops:
      # Only a non-float output of a rewritten layer gets here: the
      # gradient would enter the layer past its transform.
      raise _errors.UnsupportedGraphError(
          f"gradient flows into layer {net.layer_of(p)!r} through its "
          f"{t.dtype.name} output {t.name}, which a transform cannot "
          f"act on. Transform a layer whose outputs are all "
          f"floating-point tensors, or group the op that reads "
          f"{t.name} into the same layer.")
    return True

  # -- groups ----------------------------------------------------------------

  def layer_group(self, name: str) -> Group:
    sources = self.outputs[name]
    targets, var_names = self.segment([t.op for t in sources], inside=name)
    return Group(Key(GroupKind.LAYER, name), sources, targets, var_names)

  def edge_group(self, name: str) -> Group:
    direct: List[tf.Tensor] = []
    glue: List[tf.Tensor] = []
    for t in self.inputs[name]:
      (direct if self.net.layer_of(t.op) is not None else glue).append(t)
    # The edge gradient must reach the lower layers' boundary tensors whole,
    # so that the edge rewrite applies to it; stopping at a glue op that is
    # cut for another reason (a glue activation also read by another
    # rewritten layer) would hand it on unrewritten.
    targets, var_names = self.segment([t.op for t in glue], glue_only=True)
    return Group(Key(GroupKind.EDGE, name), self.inputs[name], targets,
                 var_names, direct=direct, glue=glue)

  def op_group(self, op_name: str) -> Group:
    op = self.net.op_graph.nodes[op_name]["op"]
    targets, var_names = self.segment([op])
    return Group(Key(GroupKind.OP, op_name),
                 [t for t in op.outputs if differentiable(t)], targets,
                 var_names)

  def downstream(self, group: Group) -> List[Key]:
    """The groups that ``group`` adds to."""
    if group.key.kind is GroupKind.LAYER and group.key.name in self.edge_uppers:
      return [Key(GroupKind.EDGE, group.key.name)]
    tensors = list(group.targets)
    if group.key.kind is GroupKind.EDGE:
      tensors += group.direct
    return [self.group_of[t.op.name] for t in tensors]

  def schedule(self) -> List[Group]:
    """Returns the cut groups in execution order, with their segments."""
    groups = [self.layer_group(n) for n in sorted(self.cut_layers)]
    groups += [self.edge_group(n) for n in sorted(self.edge_uppers)]
    groups += [self.op_group(op) for op, key in sorted(self.group_of.items())
               if key.kind is GroupKind.OP]
    by_key = {g.key: g for g in groups}
    dag = nx.DiGraph()
    dag.add_nodes_from(by_key)
    dag.add_edges_from((g.key, k) for g in groups for k in self.downstream(g))
    try:
      order = list(nx.topological_sort(dag))
    except nx.NetworkXUnfeasible:
      keys = [k for k, _ in nx.find_cycle(dag)]
      cycle = " -> ".join(map(str, keys))
      raise _errors.UnsupportedGraphError(
          f"the transformed layers feed back into themselves ({cycle}), so "
          f"no order exists in which each rewritten gradient is complete "
          f"before it is used. " + _layer_names.cycle_advice(self.net, keys)
      ) from None
    log.debug("backward pass: %d cut groups", len(order))
    return [by_key[k] for k in order]


def _record(walks: Dict[str, Set[str]], via: Dict[str, Set[str]],
            start: str, consumer: tf.Operation, producer: tf.Operation):
  """The walk from ``start`` reached ``producer`` through ``consumer``."""
  walks[producer.name].add(start)
  via[producer.name].add(consumer.name)


def ancestors(net: LayerGraph, tensors: Sequence[tf.Tensor]) -> Set[str]:
  """Names of the forward ops that ``tensors`` depend on, theirs included."""
  g = net.op_graph
  out: Set[str] = set()
  for t in tensors:
    if t.op.name in g and t.op.name not in out:
      out.add(t.op.name)
      out |= nx.ancestors(g, t.op.name)
  return out
