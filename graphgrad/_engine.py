"""Segmented backpropagation: one ``tf.gradients`` call per segment.

The plan hands this module the analysed graph, the variables to
differentiate, and where gradients must be rewritten. It cuts the forward
graph at the tensors where a rewritten gradient enters or leaves:

* the outputs ``T`` and inputs ``I`` of every layer with an upstream
  transform or an incoming edge transform;
* the boundary tensors of every layer that feeds a layer with an edge
  transform (so that the edge's share can be told apart).

Each cut is a *source group*: the outputs of one cut layer, the direct share
of an edge's upper layer, or the tensors of one op. A group's call starts from
its tensors with the fully accumulated gradient as ``grad_ys`` and stops, with
``stop_gradients``, at the next cuts below it, where its results are added to
their accumulators. Groups run in topological order of a small DAG (a group
runs after every group that adds to it), so each accumulator is complete when
it is read. Every forward op is thus backpropagated by the one segment that
contains it; a transformed layer's own ops twice (once with the plain
gradient for its parameters, once with the transformed one for what lies
below).

With no cuts at all the caller uses a single ``tf.gradients`` call instead,
which is exactly what ``Optimizer.minimize`` builds.
"""

import collections
import logging
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import networkx as nx
import tensorflow as tf

from graphgrad import _errors, _graph_util, _reach
from graphgrad._analysis import LayerGraph

log = logging.getLogger("graphgrad")

Key = Tuple[str, str]  # ("layer", name) | ("chan", name) | ("op", op name)


def differentiable(t: tf.Tensor) -> bool:
  return (t.dtype.is_floating or t.dtype.is_complex) and not _graph_util.is_handle(t)


def aggregate(grads: Sequence, like: Optional[tf.Tensor] = None):
  """Sums gradient contributions, keeping them sparse when all are sparse."""
  grads = [g for g in grads if g is not None]
  if not grads:
    return None
  if len(grads) == 1:
    return grads[0]
  sparse = [g for g in grads if isinstance(g, tf.IndexedSlices)]
  if len(sparse) == len(grads):
    return tf.IndexedSlices(
        tf.concat([g.values for g in sparse], 0),
        tf.concat([g.indices for g in sparse], 0),
        sparse[0].dense_shape)
  dense = [g for g in grads if not isinstance(g, tf.IndexedSlices)]
  for g in sparse:
    rows = (g.dense_shape[0] if g.dense_shape is not None
            else tf.shape(like if like is not None else dense[0])[0])
    dense.append(tf.math.unsorted_segment_sum(g.values, g.indices, rows))
  return tf.add_n(dense)


class Segments:
  """Plans and builds the segmented backward pass of one gradient plan.

  Args:
    net: the analysed graph.
    variables: the variables to differentiate.
    upstream: layer name -> callable ``(grad, tensor) -> grad`` applied to the
      upstream gradient of each output tensor.
    edges: ``(lower, upper)`` -> callable ``(grad, tensor) -> grad`` applied
      to the gradient ``upper`` sends directly into ``lower``'s tensor.
    options: keyword arguments for ``tf.gradients``.
  """

  def __init__(self, net: LayerGraph, variables, upstream: Dict[str, Callable],
               edges: Dict[Tuple[str, str], Callable], options: dict):
    self.net = net
    self.variables = {v.op.name: v for v in variables}
    self.upstream = upstream
    self.edges = edges
    self.options = options
    self.cut_layers = set(upstream) | {up for _, up in edges}
    self.edge_uppers = {up for _, up in edges}
    self._dep = self._variable_dependent_ops()
    self._build_cuts()
    # Each segment call walks only the ops behind its ys (see _reach).
    self._bound = _reach.can_bound(
        d["op"] for _, d in net.op_graph.nodes(data=True))

  # -- planning ------------------------------------------------------------

  def _variable_dependent_ops(self) -> Set[str]:
    """Forward ops downstream of a differentiated variable."""
    g = self.net.op_graph
    seen = {n for n in self.variables if n in g}
    stack = list(seen)
    while stack:
      for nxt in g.successors(stack.pop()):
        if nxt not in seen:
          seen.add(nxt)
          stack.append(nxt)
    return seen

  def _relevant(self, t: tf.Tensor) -> bool:
    return differentiable(t) and t.op.name in self._dep

  def _build_cuts(self) -> None:
    net = self.net
    self.outputs: Dict[str, List[tf.Tensor]] = {}
    self.inputs: Dict[str, List[tf.Tensor]] = {}
    cut_tensors: List[tf.Tensor] = []
    for name in sorted(self.cut_layers):
      layer = net[name]
      self.outputs[name] = [t for t in layer.outputs if differentiable(t)]
      self.inputs[name] = [t for t in layer.inputs if self._relevant(t)]
      cut_tensors += self.outputs[name] + self.inputs[name]
    for up in self.edge_uppers:
      for lo in net.graph.predecessors(up):
        cut_tensors += [t for t in net.graph.edges[lo, up]["tensors"]
                        if self._relevant(t)]
    for t in cut_tensors:
      if _graph_util.in_control_flow(t.op):
        raise _errors.UnsupportedGraphError(
            f"the boundary tensor {t.name} lies inside a tf.compat.v1 while "
            f"loop or cond, where its gradient cannot be rewritten as a "
            f"whole. Move the transform to a layer outside the loop, or "
            f"group the loop into one layer (gg.analyze(loss, depth=...) or "
            f"layers=...).")
    # Group cut tensors by the op that produces them: tf.gradients stops at
    # ops, so every differentiable output of a cut op is a cut.
    self.group_of: Dict[str, Key] = {}
    self.layer_producers: Dict[str, str] = {}
    for name, ts in self.outputs.items():
      for t in ts:
        self.layer_producers[t.op.name] = name
    self.cut_ops: Set[str] = {t.op.name for t in cut_tensors}
    self.cut_ops.add(net.loss.op.name)
    for op_name in self.cut_ops:
      layer = self.layer_producers.get(op_name)
      self.group_of[op_name] = ("layer", layer) if layer else ("op", op_name)

  def _region(self, start_ops: Sequence[tf.Operation],
              inside: Optional[str] = None):
    """Walks back from ``start_ops`` to the next cuts.

    Returns (targets, variable names): cut tensors where the walk stopped and
    differentiated variables it reached. With ``inside``, the walk stays in
    that layer and stops at every tensor entering it.
    """
    net = self.net
    targets: Dict[str, tf.Tensor] = {}
    var_names: Dict[str, None] = {}
    seen = {op.name for op in start_ops}
    stack = list(start_ops)
    while stack:
      op = stack.pop()
      for t in _graph_util.data_inputs(op):
        p = t.op
        if _graph_util.is_handle(t):
          if p.name in self.variables:
            var_names[p.name] = None
          continue
        if p.name not in self._dep or not differentiable(t):
          continue
        if inside is not None:
          if net.layer_of(p) != inside:
            targets[t.name] = t
            continue
        elif p.name in self.cut_ops:
          targets[t.name] = t
          continue
        if p.name not in seen:
          seen.add(p.name)
          stack.append(p)
    return list(targets.values()), list(var_names)

  def schedule(self):
    """Returns the source groups in execution order, with their regions."""
    net = self.net
    groups: Dict[Key, dict] = {}
    for name in self.cut_layers:
      starts = {t.op.name: t.op for t in self.outputs[name]}
      targets, var_names = self._region(list(starts.values()), inside=name)
      groups[("layer", name)] = dict(sources=self.outputs[name],
                                     targets=targets, vars=var_names)
    for name in self.edge_uppers:
      direct, glue = [], []
      for t in self.inputs[name]:
        (direct if net.layer_of(t.op) is not None else glue).append(t)
      targets, var_names = self._region(
          list({t.op.name: t.op for t in glue}.values()))
      groups[("chan", name)] = dict(sources=self.inputs[name], direct=direct,
                                    glue=glue, targets=targets, vars=var_names)
    g = self.net.op_graph
    for op_name, key in self.group_of.items():
      if key[0] != "op":
        continue
      op = g.nodes[op_name]["op"]
      targets, var_names = self._region([op])
      groups[key] = dict(sources=[t for t in op.outputs if differentiable(t)],
                         targets=targets, vars=var_names)
    dag = nx.DiGraph()
    dag.add_nodes_from(groups)
    for key, info in groups.items():
      downstream = list(info["targets"])
      if key[0] == "layer" and key[1] in self.edge_uppers:
        dag.add_edge(key, ("chan", key[1]))
        downstream = []
      if key[0] == "chan":
        downstream += info["direct"]
      for t in downstream:
        dag.add_edge(key, self.group_of[t.op.name])
    try:
      order = list(nx.topological_sort(dag))
    except nx.NetworkXUnfeasible:
      cycle = nx.find_cycle(dag)
      names = " -> ".join(f"{k[0]}:{k[1]}" for k, _ in cycle)
      raise _errors.UnsupportedGraphError(
          f"the transformed layers feed back into themselves ({names}), so "
          f"no order exists in which each rewritten gradient is complete "
          f"before it is used. This happens when a transformed layer's output "
          f"reaches its own input (a layer reused in series). Transform a "
          f"layer that is applied once, or group the repeated layers into "
          f"one.") from None
    log.debug("segmented backward: %d source groups", len(order))
    return [(k, groups[k]) for k in order]

  # -- building ------------------------------------------------------------

  def build(self, seed: tf.Tensor) -> Dict[str, List]:
    """Builds the backward pass; returns variable name -> contributions."""
    acc: Dict[str, List] = collections.defaultdict(list)
    chan: Dict[str, Dict[str, List]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    var_grads: Dict[str, List] = collections.defaultdict(list)
    acc[self.net.loss.name].append(seed)

    def total(store, ts):
      return [aggregate(store.get(t.name, ()), like=t) for t in ts]

    def call(ys, grad_ys, targets, var_names, stops=None):
      pairs = [(y, gy) for y, gy in zip(ys, grad_ys) if gy is not None]
      xs = list(targets) + [self.variables[n] for n in var_names]
      if not pairs or not xs:
        return [None] * len(xs)
      stops = list(targets) if stops is None else list(stops)
      ys = [y for y, _ in pairs]
      allowed = _reach.behind(ys, xs) if self._bound else None
      with _reach.bounded(allowed):
        return tf.compat.v1.gradients(ys, xs,
                                      grad_ys=[gy for _, gy in pairs],
                                      stop_gradients=stops, **self.options)

    def deposit(targets, var_names, results, store=acc):
      n = len(targets)
      for t, g in zip(targets, results[:n]):
        if g is not None:
          store[t.name].append(g)
      for name, g in zip(var_names, results[n:]):
        if g is not None:
          var_grads[name].append(g)

    for key, info in self.schedule():
      kind, name = key
      if kind == "layer":
        ys = info["sources"]
        g = total(acc, ys)
        own = [n for n in info["vars"]
               if self.net.layer_of_variable(self.variables[n]) == name]
        other = [n for n in info["vars"] if n not in own]
        below = chan[name] if name in self.edge_uppers else acc
        fn = self.upstream.get(name)
        if fn is None:
          res = call(ys, g, info["targets"], own + other)
          deposit(info["targets"], own + other, res, store=below)
          continue
        # The layer's own parameters see the plain upstream gradient; what
        # lies below sees the transformed one.
        res = call(ys, g, [], own, stops=info["targets"])
        deposit([], own, res)
        modified = [fn(gy, y) for y, gy in zip(ys, g)]
        res = call(ys, modified, info["targets"], other)
        deposit(info["targets"], other, res, store=below)
      elif kind == "chan":
        store = chan[name]
        for t in info["direct"]:
          gy = aggregate(store.get(t.name, ()), like=t)
          acc[t.name].append(self._edge(t, name, gy))
        glue = info["glue"]
        res = call(glue, total(store, glue), info["targets"], info["vars"])
        n = len(info["targets"])
        for t, r in zip(info["targets"], res[:n]):
          if r is not None:
            acc[t.name].append(self._edge(t, name, r))
        deposit([], info["vars"], res[n:])
      else:
        ys = info["sources"]
        res = call(ys, total(acc, ys), info["targets"], info["vars"])
        deposit(info["targets"], info["vars"], res)
    return var_grads

  def _edge(self, t: tf.Tensor, upper: str, grad):
    lower = self.net.layer_of(t.op)
    fn = self.edges.get((lower, upper))
    if fn is None or grad is None:
      return grad
    return fn(grad, t)
