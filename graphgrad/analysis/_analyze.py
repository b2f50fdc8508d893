"""Layer analysis: from a loss tensor to a :class:`~graphgrad.LayerGraph`.

The vocabulary (forward graph, layer, glue, inputs, outputs, boundary) is
defined in :mod:`graphgrad.analysis._layer_graph`.
"""

import collections
import logging
import re
from typing import Dict, Iterable, List, Optional, Tuple

import networkx as nx
import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import LayerSpec
from graphgrad.analysis import (
  _control_flow,
  _graph_util,
  _grouping,
  _lost_overrides,
)
from graphgrad.analysis._graph_mode import check_graph_mode
from graphgrad.analysis._layer_graph import Layer, LayerGraph

log = logging.getLogger("graphgrad")

_UNIQUIFIED = re.compile(r"^(.*)_\d+$")


# --------------------------------------------------------------------------
# analyze
# --------------------------------------------------------------------------


def analyze(loss: tf.Tensor, layers: Optional[LayerSpec] = None,
            depth: Optional[int] = None) -> LayerGraph:
  """Finds the layers of ``loss``'s graph and the tensors between them.

  Args:
    loss: a floating-point tensor of a ``tf.Graph``. A non-scalar loss is
      summed, as ``tf.gradients`` does.
    layers: optional mapping from layer name to a scope prefix (``str``) or a
      list of variables. Trainable variables the mapping does not cover are
      grouped automatically. ``None`` finds one layer per variable scope that
      directly holds variables. Variables with no scope of their own
      (top-level names: ``Variable``, ``Variable_1``, ``w1``) are grouped by
      the ops that use them: a parametric op (``MatMul``, ``Conv2D`` and the
      other convolutions, an embedding ``Gather``, ``FusedBatchNorm``...)
      that reads them, with the bias add or scale (``BiasAdd``, ``Add``,
      ``AddV2``, ``Mul``) that directly follows it and reads a variable of
      its own, is one layer named after its first parametric op
      (``MatMul``, ``MatMul_1``); its ops are those ops and the reads between
      them and the variables. A mapped list of such variables takes the same
      ops. ``net.layer_of_variable(v)`` and ``net.layer_of(op)`` name the
      layer holding a variable or an op.
    depth: optional grouping depth for automatic discovery: with ``depth=2``
      the variables of ``resnet/block1/conv1`` and ``resnet/block1/bn1`` form
      one layer ``resnet/block1``.

  Returns:
    A :class:`LayerGraph`.

  An op whose ``gradient_override_map`` name has no registered gradient
  function in this process (a graph imported from another one) is logged
  once as a warning and listed in ``net.lost_overrides``, with the
  declaration that looks like it restores it.

  Raises:
    GraphGradError: if ``loss`` is not a floating-point graph tensor (an
      eager tensor, or one traced inside ``tf.function``: use
      ``gg.KerasPlan``), if ``layers`` or ``depth`` is malformed, or if the
      loss depends on no trainable variable.

  Example:
    >>> import tensorflow as tf, graphgrad as gg
    >>> with tf.Graph().as_default():
    ...   x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    ...   with tf.compat.v1.variable_scope("l1"):
    ...     h = x @ tf.compat.v1.get_variable("w", [3, 4])
    ...   with tf.compat.v1.variable_scope("l2"):
    ...     y = h @ tf.compat.v1.get_variable("w", [4, 1])
    ...   net = gg.analyze(tf.reduce_sum(y))
    >>> net.names
    ('l1', 'l2')
    >>> list(net.graph.edges)
    [('l1', 'l2')]

    The same network without scopes:

    >>> with tf.Graph().as_default():
    ...   x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    ...   w0 = tf.compat.v1.get_variable("w0", [3, 4])
    ...   b0 = tf.compat.v1.get_variable("b0", [4])
    ...   h = tf.nn.relu(tf.matmul(x, w0) + b0)
    ...   y = tf.matmul(h, tf.compat.v1.get_variable("w1", [4, 1]))
    ...   net = gg.analyze(tf.reduce_sum(y))
    >>> net.names, net.layer_of_variable(b0)
    (('MatMul', 'MatMul_1'), 'MatMul')
    >>> [t.name for t in net.boundary('MatMul', 'MatMul_1')]
    ['add:0']
  """
  check_graph_mode("gg.analyze", loss, adds_ops=False)
  check_loss(loss)
  _check_depth(depth)
  fwd_ops = _graph_util.forward_ops(loss)
  trainable = _graph_util.trainable_variables(loss.graph)
  connected = _connected(loss, fwd_ops, trainable)
  var_groups, scopes = _grouping.group_variables(connected, trainable, layers,
                                                 depth)
  op_graph, op_order, topo_index = _op_graph(fwd_ops)
  loop_edges = _loop_edges(fwd_ops)
  consumers = _graph_util.forward_consumers(fwd_ops)
  var_groups, scopes, members = _grouping.group_by_ops(
      fwd_ops, var_groups, scopes, set(layers or ()),
      lambda: _assign_ops(fwd_ops, var_groups, scopes), consumers)
  op_layer = _op_layers(fwd_ops, var_groups, scopes, op_graph, op_order,
                        consumers, loss, members)
  layer_objs = _layers(fwd_ops, var_groups, scopes, op_graph, op_layer,
                       topo_index, consumers, loss)
  lgraph = _layer_graph(layer_objs, op_layer, loss)
  order = _layer_order(lgraph, layer_objs, topo_index)
  lost = _lost_overrides.find(fwd_ops, op_layer, consumers)
  net = LayerGraph(loss, [layer_objs[n] for n in order], lgraph, op_graph,
                   op_layer, topo_index, loop_edges, lost_overrides=lost)
  if lost:
    log.warning(
        "gg.analyze: %d op(s) of %s carry a gradient override that is not "
        "registered in this process, so tf.gradients stops there with "
        "LookupError (net.lost_overrides lists them): %s", len(lost),
        loss.name, " ".join(f"{i + 1}. {l.describe()}."
                            for i, l in enumerate(lost)))
  log.debug("analyzed %s: %d layers, %d forward ops, %d layer edges",
            loss.name, len(order), len(fwd_ops), lgraph.number_of_edges())
  return net


def _loop_edges(fwd_ops) -> List[Tuple[str, str]]:
  """The (producer, consumer) op names of each while-loop back edge."""
  return [(t.op.name, op.name) for op in fwd_ops for t in op.inputs
          if _graph_util.is_back_edge(t, op)]


def _op_layers(fwd_ops, var_groups, scopes, op_graph, op_order, consumers,
               loss, members) -> Dict[str, Optional[str]]:
  """Op name -> layer: by scope and reads, by the ops using unscoped
  variables, then control flow, then glue."""
  op_layer = _assign_ops(fwd_ops, var_groups, scopes, members)
  var_layer = {v.op.name: l for l, vs in var_groups.items() for v in vs}
  _control_flow.join_control_flow(fwd_ops, op_layer, var_layer, consumers)
  _join_enclosed_glue(op_graph, op_order, op_layer, consumers, loss,
                        set(var_layer))
  nx.set_node_attributes(op_graph, {n: op_layer.get(n) for n in op_order},
                         "layer")
  return op_layer


def _check_depth(depth) -> None:
  if depth is not None and (not isinstance(depth, int)
                            or isinstance(depth, bool) or depth < 1):
    raise _errors.GraphGradError(
        f"`depth` must be a positive int (how many scope levels form a "
        f"layer name); got {depth!r}. Use depth=1 for top-level scopes, or "
        f"leave it None for one layer per variable scope.")


def _connected(loss, fwd_ops, trainable) -> List[tf.Variable]:
  """The trainable variables ``loss`` depends on; raises when there is none."""
  op_names = {op.name for op in fwd_ops}
  connected = [v for v in trainable if v.op.name in op_names]
  if not connected:
    raise _errors.NotConnectedError(
        f"`loss` {loss.name} depends on no trainable variable of its graph "
        f"({len(trainable)} trainable variables exist). Pass the loss tensor "
        f"that your model's parameters feed into.")
  return connected


def _op_graph(fwd_ops):
  """The forward op DAG, its topological order and each op's index in it."""
  op_graph = nx.DiGraph()
  op_graph.add_nodes_from((op.name, {"op": op}) for op in fwd_ops)
  op_graph.add_edges_from((t.op.name, op.name) for op in fwd_ops
                          for t in _graph_util.data_inputs(op))
  op_order = list(nx.topological_sort(op_graph))
  return op_graph, op_order, {name: i for i, name in enumerate(op_order)}


def _layers(fwd_ops, var_groups, scopes, op_graph, op_layer, topo_index,
            consumers, loss) -> Dict[str, Layer]:
  members: Dict[str, List[tf.Operation]] = collections.defaultdict(list)
  for op in fwd_ops:
    name = op_layer.get(op.name)
    if name is not None:
      members[name].append(op)
  layer_objs = {}
  for name, variables in var_groups.items():
    ops = sorted(members.get(name, ()), key=lambda o: topo_index[o.name])
    inputs, outputs = _layer_io(ops, name, op_layer, consumers, loss)
    layer_objs[name] = Layer(
        name=name, variables=tuple(variables), ops=tuple(ops),
        inputs=tuple(inputs), outputs=tuple(outputs),
        scopes=tuple(sorted(scopes[name])),
        call_sites=_count_call_sites(op_graph, ops, inputs))
  return layer_objs


def check_loss(loss) -> None:
  """Raises GraphGradError unless ``loss`` is a float tensor of a graph."""
  if isinstance(loss, tf.Variable):
    raise _errors.GraphGradError(
        f"`loss` must be a floating-point tensor of a tf.Graph; got the "
        f"variable {loss.name}. Pass the tensor computed from it, e.g. "
        f"tf.identity(var) or the loss built on it.")
  if not isinstance(loss, tf.Tensor):
    raise _errors.GraphGradError(
        f"`loss` must be a floating-point tensor of a tf.Graph; got "
        f"{type(loss).__name__}. Build the model and loss inside "
        f"`with tf.Graph().as_default():` and pass the loss tensor.")
  if not tf.is_symbolic_tensor(loss):
    raise _errors.GraphGradError(
        "`loss` is an eager tensor; graphgrad's GradientPlan works on "
        "tf.compat.v1 graphs. Build the model and loss inside "
        "`with tf.Graph().as_default():`, or use gg.KerasPlan for eager "
        "Keras models.")
  if not (loss.dtype.is_floating or loss.dtype.is_complex):
    raise _errors.GraphGradError(
        f"`loss` must be a floating-point tensor; got {loss.name} of dtype "
        f"{loss.dtype.name}. Cast it first: tf.cast(loss, tf.float32).")


def _assign_ops(fwd_ops, var_groups, scopes, members=None
                ) -> Dict[str, Optional[str]]:
  """Maps each forward op name to its layer name (glue ops are absent).

  ``members`` maps the ops that use variables with no scope of their own to
  their layer (``_grouping.group_by_ops``); a scope's claim comes first.
  """
  members = members or {}
  scope_layer = {s: l for l, ss in scopes.items() for s in ss}
  handle_layer = {v.op.name: l for l, vs in var_groups.items() for v in vs}
  cache: Dict[str, Optional[str]] = {}

  def by_scope(op_name: str) -> Optional[str]:
    scope = op_name.rsplit("/", 1)[0] if "/" in op_name else ""
    if scope in cache:
      return cache[scope]
    parts = scope.split("/") if scope else []
    found = None
    # Exact scope, longest first; then the same scope nested under an outer
    # one (a Keras layer called inside a model: "model/dense/MatMul"); then a
    # uniquified scope of a reused layer ("l1_dense_1/MatMul").
    for strip in (False, True):
      for start in range(len(parts)):
        for end in range(len(parts), start, -1):
          cand = parts[start:end]
          if strip:
            m = _UNIQUIFIED.match(cand[-1])
            if not m:
              continue
            cand = cand[:-1] + [m.group(1)]
          key = "/".join(cand)
          if key in scope_layer:
            found = scope_layer[key]
            break
        if found is not None:
          break
      if found is not None:
        break
    cache[scope] = found
    return found

  result: Dict[str, Optional[str]] = {}
  for op in fwd_ops:
    if op.name in handle_layer:
      result[op.name] = handle_layer[op.name]
      continue
    read = _graph_util.read_variable_source(op)
    if read is not None and read in handle_layer:
      result[op.name] = handle_layer[read]
      continue
    name = by_scope(op.name)
    if name is None and op.name in scope_layer:  # op named like the scope
      name = scope_layer[op.name]
    if name is None:
      name = members.get(op.name)
    if name is not None:
      result[op.name] = name
  return result


_MANY = object()  # more than one layer
_LOSS = object()  # the loss itself


def _merge(a, b):
  if a is None:
    return b
  if b is None or a is b or a == b:
    return a
  return _MANY


def _join_enclosed_glue(op_graph, order, op_layer, consumers, loss,
                          variables) -> None:
  """Moves glue that only leads from a layer back into it into that layer.

  A ``tf.nn.relu`` written between two sub-scopes that ``depth=`` groups into
  one layer, or between two call sites of a reused scope, is enclosed: every
  variable-dependent input comes (through glue) from layer ``L`` and every
  consumer leads (through glue) into ``L``. Left as glue, it would make ``L``
  feed its own input; inside ``L`` it is what it is, a part of the layer.
  """
  dep = set()
  for name in order:  # topological: inputs first
    op = op_graph.nodes[name]["op"]
    if name in variables or any(t.op.name in dep for t in op.inputs
                                if t.op.name in op_graph):
      dep.add(name)
  source: Dict[str, object] = {}
  for name in order:
    if name in op_layer or name not in dep:
      continue
    s = None
    for t in op_graph.nodes[name]["op"].inputs:
      p = t.op.name
      if p in dep and not _graph_util.is_handle(t):
        s = _merge(s, op_layer.get(p) or source.get(p))
    source[name] = s
  sink: Dict[str, object] = {}
  for name in reversed(order):
    if name in op_layer or name not in dep:
      continue
    op = op_graph.nodes[name]["op"]
    k = _LOSS if any(t.name == loss.name for t in op.outputs) else None
    for t in op.outputs:
      for c in consumers.get(t.name, ()):
        k = _merge(k, op_layer.get(c.name) or sink.get(c.name))
    sink[name] = k
  for name, s in source.items():
    if isinstance(s, str) and sink.get(name) == s:
      op_layer[name] = s


def _layer_io(ops, name, op_layer, consumers, loss):
  inputs, outputs = [], []
  seen_in, seen_out = set(), set()
  for op in ops:
    for t in op.inputs:
      if (op_layer.get(t.op.name) != name and t.name not in seen_in
          and not _graph_util.is_handle(t)):
        seen_in.add(t.name)
        inputs.append(t)
    for t in op.outputs:
      outside = t is loss or t.name == loss.name or any(
          op_layer.get(c.name) != name for c in consumers.get(t.name, ()))
      if (outside and t.name not in seen_out
          and not _graph_util.is_handle(t)):
        seen_out.add(t.name)
        outputs.append(t)
  return inputs, outputs


def _count_call_sites(op_graph, ops, inputs) -> int:
  """How many times the layer is applied to inputs.

  A call site is a connected piece of the layer's computation that both
  reads the layer's variables and consumes one of its inputs. Pieces that
  read variables only (a weight-decay regulariser) or consume inputs only
  (the activation tf-slim puts in a conv's scope after its BatchNorm) are
  not applications of the layer.
  """
  reads = {op.name for op in ops if _graph_util.read_variable_source(op)
           or _graph_util.is_variable_op(op)}
  body = {op.name for op in ops if op.name not in reads}
  fed = {c for t in inputs for c in op_graph.successors(t.op.name)}
  # The weakly connected pieces of the body, by union-find over its edges.
  parent = {n: n for n in body}

  def root(n):
    while parent[n] != n:
      parent[n] = parent[parent[n]]
      n = parent[n]
    return n

  uses_params = set()
  for n in body:
    for p in op_graph.predecessors(n):
      if p in body:
        parent[root(p)] = root(n)
      elif p in reads:
        uses_params.add(n)
  with_params = {root(n) for n in uses_params}
  return max(1, len({root(n) for n in fed & body} & with_params))


def _layer_graph(layers: Dict[str, Layer], op_layer, loss) -> nx.DiGraph:
  g = nx.DiGraph()
  for name, layer in layers.items():
    g.add_node(name, layer=layer, to_loss=False)
  for upper, layer in layers.items():
    # lower -> {tensor name: tensor}
    found: Dict[str, Dict[str, tf.Tensor]] = collections.defaultdict(dict)
    _glue_sources(layer.inputs, op_layer, found)
    for lower, ts in found.items():
      g.add_edge(lower, upper,
                 tensors=tuple(sorted(ts.values(), key=lambda t: t.name)))
  # which layers reach the loss through glue only
  to_loss: Dict[str, Dict[str, tf.Tensor]] = collections.defaultdict(dict)
  _glue_sources([loss], op_layer, to_loss, include_self=True)
  for lower in to_loss:
    g.nodes[lower]["to_loss"] = True
  return g


def _glue_sources(tensors: Iterable[tf.Tensor], op_layer, found,
                  include_self=False) -> None:
  """Walks back from ``tensors`` through glue ops to layer outputs."""
  stack = list(tensors)
  seen = set()
  while stack:
    t = stack.pop()
    if t.name in seen or _graph_util.is_handle(t):
      continue
    seen.add(t.name)
    owner = op_layer.get(t.op.name)
    if owner is not None:
      found[owner][t.name] = t
    else:
      stack.extend(t.op.inputs)


def _layer_order(lgraph, layers, topo_index) -> List[str]:
  def first(name):
    ops = layers[name].ops
    return min((topo_index[o.name] for o in ops), default=0)
  dag = nx.DiGraph(lgraph.edges)
  dag.add_nodes_from(lgraph.nodes)
  dag.remove_edges_from(list(nx.selfloop_edges(dag)))
  try:
    return list(nx.lexicographical_topological_sort(dag, key=first))
  except nx.NetworkXUnfeasible:
    return sorted(layers, key=first)
