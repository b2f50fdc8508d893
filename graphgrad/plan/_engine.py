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

from graphgrad import _errors
from graphgrad.analysis import _graph_util
from graphgrad.analysis._layers import LayerGraph
from graphgrad.plan import _reach

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
    backward: layer name -> callable replacing the chain rule from the
      layer's outputs to its inputs. It is called with keywords ``layer``,
      ``outputs``, ``upstream`` (the gradients at ``outputs`` after the
      upstream transform), ``inputs``, ``chain_rule`` (a function building
      what the chain rule would give) and ``upstream_of`` (layer name -> the
      complete gradients at that cut layer's outputs), and returns one
      gradient per input.
    outputs_fn: layer name -> callable ``(grads, outputs) -> grads`` applied
      to the total gradient at the layer's outputs before anything else: the
      layer's own parameters and everything below see its result.
    cuts: more layers to cut, whose output gradients ``upstream_of`` reads.
    gradients_fn: what each segment calls instead of ``tf.gradients``, with
      the same arguments (the plan's gradient overrides, see ``_override``).
  """

  def __init__(self, net: LayerGraph, variables, upstream: Dict[str, Callable],
               edges: Dict[Tuple[str, str], Callable], options: dict,
               backward: Optional[Dict[str, Callable]] = None,
               outputs_fn: Optional[Dict[str, Callable]] = None,
               cuts: Sequence[str] = (),
               gradients_fn: Optional[Callable] = None):
    self.net = net
    self.gradients_fn = gradients_fn or tf.compat.v1.gradients
    self.variables = {v.op.name: v for v in variables}
    self.upstream = upstream
    self.edges = edges
    self.options = options
    self.backward = dict(backward or {})
    self.outputs_fn = dict(outputs_fn or {})
    self.cut_layers = (set(upstream) | {up for _, up in edges}
                       | set(self.backward) | set(self.outputs_fn) | set(cuts))
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
              inside: Optional[str] = None, glue_only: bool = False):
    """Walks back from ``start_ops`` to the next cuts.

    Returns (targets, variable names): cut tensors where the walk stopped and
    differentiated variables it reached. With ``inside``, the walk stays in
    that layer and stops at every tensor entering it. With ``glue_only``, the
    walk crosses glue ops, even cut ones, and stops at every layer's tensor.
    """
    net = self.net
    targets: Dict[str, tf.Tensor] = {}
    var_names: Dict[str, None] = {}
    seen = {op.name for op in start_ops}
    stack = list(start_ops)
    while stack:
      op = stack.pop()
      for t in op.inputs:
        p = t.op
        if _graph_util.is_handle(t):
          var = _graph_util.variable_of_handle(t)
          if var in self.variables:
            var_names[var] = None
          continue
        # Variant tensors (TensorLists of while_v2 loops) carry gradients
        # too; they are walked through, never cut.
        if p.name not in self._dep or not (differentiable(t)
                                           or t.dtype == tf.variant):
          continue
        if inside is not None:
          if net.layer_of(p) != inside:
            if not differentiable(t):
              raise _errors.UnsupportedGraphError(
                  f"layer {inside!r} takes the {t.dtype.name} input {t.name}, "
                  f"through which its gradient would leave it past the "
                  f"transform. Group the op that produces {t.name} into the "
                  f"layer, or transform another layer.")
            targets[t.name] = t
            continue
        elif glue_only and net.layer_of(p) is None:
          pass  # an edge's share crosses glue, cut or not
        elif (glue_only or p.name in self.cut_ops
              or net.layer_of(p) in self.cut_layers):
          if not differentiable(t) or p.name not in self.cut_ops:
            # Only a non-float output of a rewritten layer gets here: the
            # gradient would enter the layer past its transform.
            raise _errors.UnsupportedGraphError(
                f"gradient flows into layer {net.layer_of(p)!r} through its "
                f"{t.dtype.name} output {t.name}, which a transform cannot "
                f"act on. Transform a layer whose outputs are all "
                f"floating-point tensors, or group the op that reads "
                f"{t.name} into the same layer.")
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
      # The edge's share must reach the lower layers' boundary tensors
      # whole, so that the edge transform applies to it; stopping at a glue
      # op that is cut for another reason (a glue activation also read by
      # another transformed layer) would hand it on untransformed.
      targets, var_names = self._region(
          list({t.op.name: t.op for t in glue}.values()), glue_only=True)
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

  def build(self, seed: tf.Tensor,
            reduce: Optional[Callable] = None) -> Dict[str, List]:
    """Builds the backward pass; returns variable name -> contributions.

    Args:
      seed: the gradient of the loss.
      reduce: optional ``(var_names, grads) -> grads``, applied to the
        parameter gradients each ``tf.gradients`` call (segment) produces,
        before they join the variables' contributions.
    """
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
        return self.gradients_fn(ys, xs, grad_ys=[gy for _, gy in pairs],
                                 stop_gradients=stops, **self.options)

    def deposit(targets, var_names, results, store=acc):
      n = len(targets)
      for t, g in zip(targets, results[:n]):
        if g is not None:
          store[t.name].append(g)
      found = [(name, g) for name, g in zip(var_names, results[n:])
               if g is not None]
      if reduce is not None and found:
        found = list(zip([name for name, _ in found],
                         reduce([name for name, _ in found],
                                [g for _, g in found])))
      for name, g in found:
        var_grads[name].append(g)

    done: Dict[str, List] = {}

    def upstream_of(layer: str) -> List:
      if layer not in done:
        raise _errors.UnsupportedGraphError(
            f"the gradient at layer {layer!r}'s outputs is needed before it "
            f"is complete: {layer!r} is not a rewritten layer above the one "
            f"being processed. Read the gradient of a layer nearer the loss.")
      return done[layer]

    for key, info in self.schedule():
      kind, name = key
      if kind == "layer":
        ys = info["sources"]
        g = total(acc, ys)
        if name in self.outputs_fn:
          g = self.outputs_fn[name](g, ys)
        done[name] = g
        own = [n for n in info["vars"]
               if self.net.layer_of_variable(self.variables[n]) == name]
        other = [n for n in info["vars"] if n not in own]
        below = chan[name] if name in self.edge_uppers else acc
        fn = self.upstream.get(name)
        replace = self.backward.get(name)
        if fn is None and replace is None:
          res = call(ys, g, info["targets"], own + other)
          deposit(info["targets"], own + other, res, store=below)
          continue
        # The layer's own parameters see the plain upstream gradient; what
        # lies below sees the transformed one.
        res = call(ys, g, [], own, stops=info["targets"])
        deposit([], own, res)
        modified = [fn(gy, y) for y, gy in zip(ys, g)] if fn else g
        if replace is None:
          res = call(ys, modified, info["targets"], other)
          deposit(info["targets"], other, res, store=below)
          continue
        targets = info["targets"]
        res = replace(layer=name, outputs=ys, upstream=modified,
                      inputs=targets, upstream_of=upstream_of,
                      chain_rule=lambda ys=ys, gy=modified, ts=targets:
                      call(ys, gy, ts, []))
        deposit(targets, [], res, store=below)
        if other:
          deposit([], other, call(ys, modified, [], other, stops=targets))
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
