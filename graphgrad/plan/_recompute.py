"""Recomputation: an option of the plan's VJP that recomputes forward ops.

Under ``plan.recompute`` the plan's VJP (``_backprop.GraphVJP``) splits each
call ``(ys, xs)`` at the *kept* tensors (the outputs of the kept layers)
into pieces (:class:`Split`). From the top down it copies each piece's ops
and differentiates the copy, with the gradient summed at the piece's outputs
as ``grad_ys``, depositing what it gives into ``_backprop.Backprop``. A
copy's first ops wait for that gradient, so a piece is recomputed only when
the backward pass above it is done. This module never differentiates or sums.

Never copied: the parameter subgraph (variable reads) and random ops (their
forward values are reused: a dropout mask is the forward's). A piece with an
op that must not run twice (core's ``_recompute_policy.reruns``) or cannot
be copied (a loop, an overridden op) is backpropagated through its forward
ops. ``keep=None``'s choice is core's too; this module reads the op graph.
"""

import collections
import dataclasses
from typing import (
  Callable,
  Dict,
  Iterator,
  List,
  NoReturn,
  Optional,
  Sequence,
  Set,
  Tuple,
)

import networkx as nx
import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.core import _recompute_policy

# Ops that run a function or a loop: backpropagated whole, never copied.
_FUNCTIONAL = frozenset({
    "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "PartitionedCall", "StatefulPartitionedCall", "SymbolicGradient"})


def is_random(op: tf.Operation) -> bool:
  """True for a stateful random op (its value changes with each run)."""
  return op.type in _recompute_policy.RANDOM


def _activations(net: LayerGraph) -> Dict[str, int]:
  """Forward ops downstream of a parameter, less the parameter subgraph:
  op name -> position in a topological order."""
  g = net.op_graph
  ops = [g.nodes[n]["op"] for n in nx.topological_sort(g)]
  variables = {v.op.name for v in net.variables}
  param: Set[str] = set()
  act: Dict[str, int] = {}
  for op in ops:
    ins = list(op.inputs)
    if (op.type not in _recompute_policy.VARIABLE_GATHERS and all(
        t.op.name in variables or t.op.name in param
        or not _graph_util.differentiable(t) or _scalar(t) for t in ins)
        and any(t.op.name in variables or t.op.name in param for t in ins)):
      param.add(op.name)
    elif any(t.op.name in act or t.op.name in param or t.op.name in variables
             for t in ins):
      # downstream of a parameter: on a path along which gradients flow
      act[op.name] = len(act)
  return act


def _forward(net: LayerGraph) -> List[tf.Operation]:
  """The activations' ops (:func:`_activations`), in topological order."""
  act = _activations(net)
  return [net.op_graph.nodes[n]["op"] for n in sorted(act, key=act.__getitem__)]


def _op_bytes(op: tf.Operation) -> int:
  """The static bytes of ``op``'s differentiable outputs."""
  return sum(_recompute_policy.tensor_bytes(t) for t in op.outputs
             if _graph_util.differentiable(t))


def separators(net: LayerGraph, ops: Sequence[tf.Operation]
               ) -> Dict[int, tf.Tensor]:
  """Forward tensors that every path from the inputs to the loss crosses.

  Among ``ops``, the activations of ``net`` in topological order (the ops
  downstream of a parameter, less the parameter reads and what only they
  feed): the output of an op that no differentiable edge jumps over (core's
  ``articulations``), when it is the op's one such output, not the loss,
  and outside any loop. A skip connection's add (or the ReLU after it) is
  one; a tensor inside a residual block is not.

  Returns:
    Position in ``ops`` -> the tensor.
  """
  position = {op.name: i for i, op in enumerate(ops)}
  last = [max([position[c.name] for t in op.outputs
               if _graph_util.differentiable(t)
               for c in t.consumers() if c.name in position], default=i)
          for i, op in enumerate(ops)]
  found: Dict[int, tf.Tensor] = {}
  for i in _recompute_policy.articulations(last):
    op = ops[i]
    outs = [t for t in op.outputs if _graph_util.differentiable(t)
            and any(c.name in position for c in t.consumers())]
    if (len(outs) == 1 and op.name != net.loss.op.name
        and not _graph_util.in_control_flow(op)):
      found[i] = outs[0]
  return found


def kept_tensors(net: LayerGraph, keep: Optional[Sequence[str]],
                 tensors: Sequence[str] = ()) -> List[tf.Tensor]:
  """The tensors the backward pass keeps, in forward (topological) order:
  the outputs of the layers in ``keep`` and the tensors named ``tensors``,
  or with ``keep=None`` :func:`separators` that close about ``sqrt(n)``
  segments of equal activation bytes, for ``n`` layers (core's
  ``spread_kept``, as a KerasPlan chooses its calls)."""
  if keep is None:
    ops = _forward(net)
    candidates = separators(net, ops)
    kept = [candidates[i] for i in _recompute_policy.spread_kept(
        [_op_bytes(op) for op in ops], sorted(candidates), len(net.names))]
  else:
    kept = [t for n in keep for t in net[n].outputs
            if _graph_util.differentiable(t)]
  graph = net.loss.graph
  kept += [graph.get_tensor_by_name(n) for n in tensors]
  kept = list({t.name: t for t in kept}.values())
  # Indices follow the forward order: a kept tensor's segment is above
  # every kept tensor it depends on.
  return sorted(kept, key=lambda t: (net.topo_index(t.op), t.value_index))


def keep_reader(net: LayerGraph) -> Callable[[object], Optional[str]]:
  """Reads one item of ``recompute(keep=...)`` on ``net``'s tf.Graph.

  The function it returns gives the name of the tensor an item keeps (a
  ``tf.Tensor``, a tensor name ``"l1/Relu:0"``, or the name of an op with
  one output that is no layer's name), or ``None`` for a layer reference.

  Raises (from the function):
    LayerNotFoundError: for a name that is no layer, tensor nor op.
    NotConnectedError: for a tensor off the loss's forward path.
    UnsupportedGraphError: for a tensor inside a loop or a function body.
    GraphGradError: for an eager tensor, a tensor of another tf.Graph, or
      an op name with several outputs.
  """
  graph = net.loss.graph
  forward: List[Dict[str, int]] = []

  def read(item) -> Optional[str]:
    kind = _recompute_policy.keep_item_kind(item)
    if kind in ("name", "tensor name"):
      t = (_named_op(net, graph, item) if kind == "name"
           else _named_tensor(net, graph, item))
      if t is None:
        return None
    elif kind == "eager tensor":
      raise _errors.GraphGradError(
          f"recompute: `keep` got an eager tensor (shape {item.shape}), "
          f"which holds a value, not a place in the loss's tf.Graph. Pass "
          f"the tf.Tensor of the tf.Graph (built inside graph.as_default()) "
          f"or its name.")
    elif kind == "graph tensor":
      t = _graph_tensor(graph, item)
    else:
      return None  # a layer
    if _graph_util.in_control_flow(t.op):
      raise _errors.UnsupportedGraphError(
          f"recompute: `keep` got {t.name}, a tensor inside a loop or cond "
          f"of the tf.Graph; its value changes with each iteration, so it "
          f"cannot be kept once. Keep a tensor before or after the loop.")
    if not forward:
      forward.append(_activations(net))
    if not _graph_util.differentiable(t) or t.op.name not in forward[0]:
      raise _errors.NotConnectedError(
          f"recompute: `keep` got {t.name} ({t.dtype.name}), which is not "
          f"on the loss's forward path (a floating-point tensor computed "
          f"from the variables that the loss {net.loss.name} depends on); "
          f"keeping it saves nothing. Keep an activation between the "
          f"variables and the loss.")
    return t.name

  return read


def _named_op(net: LayerGraph, graph: tf.Graph, name: str
              ) -> Optional[tf.Tensor]:
  """The one output of the op ``name``, or ``None`` for a layer's name (a
  name is a layer's before an op's)."""
  if name in net.names:
    return None
  try:
    op = graph.get_operation_by_name(name)
  except KeyError:
    _unknown(net, name)
  if len(op.outputs) == 1:
    return op.outputs[0]
  raise _errors.GraphGradError(
      f"recompute: `keep` got the op name {name!r}, whose op "
      f"({op.type}) has {len(op.outputs)} outputs, so it names no one "
      f"tensor. Pass a tensor name instead: one of "
      f"{', '.join(t.name for t in op.outputs) or '(none)'}.")


def _named_tensor(net: LayerGraph, graph: tf.Graph, name: str) -> tf.Tensor:
  """The tensor ``name`` (``"l1/Relu:0"``)."""
  try:
    return graph.get_tensor_by_name(name)
  except (KeyError, ValueError):
    _unknown(net, name)


def _unknown(net: LayerGraph, name: str) -> NoReturn:
  """Raises: ``name`` is no layer, tensor nor op of the tf.Graph."""
  raise _errors.LayerNotFoundError(
      f"recompute: `keep` got {name!r}, which names no layer, tensor or op "
      f"of the tf.Graph; known layers: {', '.join(net.names)}. Pass a layer "
      f"name, a tensor name such as 'l1/Relu:0', or the tf.Tensor itself.")


def _graph_tensor(graph: tf.Graph, t: tf.Tensor) -> tf.Tensor:
  """``t``, a symbolic tensor, checked to be a tensor of ``graph``
  itself."""
  if t.graph is graph:
    return t
  outer = getattr(t.graph, "outer_graph", None)
  while outer is not None and outer is not graph:
    outer = getattr(outer, "outer_graph", None)
  if outer is graph:
    raise _errors.UnsupportedGraphError(
        f"recompute: `keep` got {t.name}, a tensor inside the body of a "
        f"loop or function ({t.graph.name}) of the loss's tf.Graph; it "
        f"takes a new value each run of the body, so it cannot be kept "
        f"once. Keep a tensor before or after the loop.")
  raise _errors.GraphGradError(
      f"recompute: `keep` got {t.name}, a tensor of another tf.Graph than "
      f"the loss's. Pass a tensor of the loss's tf.Graph: build the model "
      f"and the plan in one tf.Graph.")


class Recompute:
  """``plan.recompute``: an option of the plan's VJP (``_backprop``).

  Each backward call ``(ys, xs)`` of a recomputing VJP is split at the kept
  tensors (:class:`Split`); the VJP differentiates the pieces from the top
  down, each on a copy of its forward ops, and deposits what each gives
  into the backward pass's accumulators.

  Args:
    kept: returns the kept tensors (called once, on the first split).
    forward: whether an op must be backpropagated through itself, never
      copied (an overridden op).
  """

  def __init__(self, kept: Callable[[], Sequence[tf.Tensor]],
               forward: Callable[[tf.Operation], bool]):
    self._kept = kept
    self.forward = forward
    self._index: Optional[Dict[str, int]] = None
    self._tensors: Optional[Tuple[tf.Tensor, ...]] = None

  @property
  def kept(self) -> Tuple[tf.Tensor, ...]:
    """The kept tensors, in forward order (found on first read)."""
    if self._tensors is None:
      self._tensors = tuple(self._kept())
    return self._tensors

  @property
  def index(self) -> Dict[str, int]:
    """Kept tensor name -> its position in the forward order."""
    if self._index is None:
      self._index = {t.name: i for i, t in enumerate(self.kept)}
    return self._index


def _scalar(t: tf.Tensor) -> bool:
  return t.shape.is_fully_defined() and t.shape.num_elements() == 1


def _is_var(x) -> bool:
  return isinstance(x, tf.Variable)


@dataclasses.dataclass
class Piece:
  """The forward ops between two kept tensors that one call crosses.

  Attributes:
    index: its kept tensors' position (0: below the first kept tensor).
    ops: its forward ops, in topological order.
    outputs: its tensors whose gradient comes from above (``ys`` or read
      by a piece above): the ``grad_ys`` of its call.
    boundary: the tensors of the pieces below that it reads: its call
      stops there, and its gradients for them go to those pieces.
    external: positions in ``xs`` of the tensors it reads from outside
      the region.
    inner: positions in ``xs`` of the tensors it computes itself: its call
      gives their gradient.
    variables: positions in ``xs`` of the variables.
    copyable: whether its ops are copied (else backpropagated through the
      forward ops themselves, which keep their activations).
  """
  index: int
  ops: List[tf.Operation]
  outputs: List[tf.Tensor]
  boundary: List[tf.Tensor]
  external: List[int]
  inner: List[int]
  variables: List[int]
  copyable: bool


class Split:
  """One recomputing backward call from ``ys`` to ``xs``, none flowing back
  through ``stops``, split at the kept tensors of ``option``.

  :meth:`pieces` gives the pieces from the top down and :meth:`call` the
  ``(ys, xs, stops)`` of each piece's VJP, on a copy of its forward ops;
  the VJP adds their results up (``_backprop``). ``leftover`` holds the
  positions in ``ys`` of the tensors no piece computes (but the region
  holds: random ops'), backpropagated by one more call to every ``xs``.
  """

  def __init__(self, option: Recompute, ys, xs, stops):
    self.forward = option.forward
    self.kept_index = option.index
    self.ys, self.xs, self.stops = list(ys), list(xs), list(stops)
    self.stop_names = {s.name for s in self.stops}
    self.graph = self.ys[0].graph
    region, var_ops = self._region()
    order, seg, random = self._segments(region, var_ops)
    self._order, self._seg, self._random = order, seg, random
    self.leftover = [i for i, y in enumerate(self.ys)
                     if y.op not in seg and y.op in region
                     and y.op not in random]
    # Random ops' outputs are their forward values: never differentiated.
    self._held = [t for op in random for t in op.outputs]

  # -- the region between xs and ys ----------------------------------------

  def _region(self) -> Tuple[Set[tf.Operation], Set[tf.Operation]]:
    """(ops between xs and ys, the variable ops among xs)."""
    behind = _graph_util.ops_behind(
        [y.op for y in self.ys if y.name not in self.stop_names], -1,
        lambda t: t.name not in self.stop_names)
    var_ops = {x.op for x in self.xs if _is_var(x)}
    seeds = [c for x in self.xs
             for t in (x.op.outputs if _is_var(x) else [x])
             for c in t.consumers() if c in behind]
    region: Set[tf.Operation] = set()
    stack = list(seeds)
    while stack:
      op = stack.pop()
      if op in region:
        continue
      region.add(op)
      stack += [c for t in op.outputs if t.name not in self.stop_names
                for c in t.consumers() if c in behind]
    return region, var_ops

  def _segments(self, region, var_ops):
    """(the region in topological order, op -> piece, the random ops)."""
    dag = nx.DiGraph()
    dag.add_nodes_from(region)
    dag.add_edges_from((t.op, op) for op in region for t in op.inputs
                       if t.op in region)
    cond = nx.condensation(dag)
    order = [m for c in nx.topological_sort(cond)
             for m in sorted(cond.nodes[c]["members"], key=lambda o: o.name)]
    looped = {m for c in cond.nodes if len(cond.nodes[c]["members"]) > 1
              for m in cond.nodes[c]["members"]}
    x_names = {x.name for x in self.xs if not _is_var(x)}

    # The parameter subgraph: ops fed by variables and other such ops alone.
    param: Set[tf.Operation] = set()
    for op in order:
      # (an embedding lookup too: its ids are not differentiable)
      if all((t.op in var_ops) or (t.op in param)
             or (t.op not in region and t.name not in x_names
                 and (not _graph_util.differentiable(t) or _scalar(t)))
             for t in op.inputs) and op not in looped \
          and op.type not in _recompute_policy.VARIABLE_GATHERS:
        param.add(op)
    random: Set[tf.Operation] = set()
    seg: Dict[tf.Operation, int] = {}
    for op in order:
      if op in param:
        continue
      if is_random(op) and not _graph_util.in_control_flow(op):
        self._check_random(op, region, param)
        random.add(op)
        continue
      s = 0
      for t in op.inputs:
        if t.name in self.kept_index and t.op in region and t.op not in param:
          s = max(s, self.kept_index[t.name] + 1)
        elif t.op in seg:
          s = max(s, seg[t.op])
      if op in looped:
        # a loop's ops share one segment: the largest of its members'
        s = max([s] + [seg.get(m, 0) for m in looped if m in seg])
      seg[op] = s
    if looped:
      # Loops have no topological order inside: one segment for all of them.
      top = max((seg[m] for m in looped), default=0)
      for m in looped:
        seg[m] = top
    return order, seg, random

  def _check_random(self, op, region, param) -> None:
    for t in op.inputs:
      if (_graph_util.differentiable(t) and t.op in region
          and t.op not in param):
        raise _errors.UnsupportedGraphError(
            f"recompute: the random op {op.name} ({op.type}) takes the "
            f"differentiable input {t.name}, so its forward value cannot be "
            f"reused without cutting the gradient that flows through it, "
            f"and recomputing it would draw new values. Keep the layer that "
            f"holds it (plan.recompute(keep=[...]) with that layer), or "
            f"draw the random values from a tensor that does not depend on "
            f"the parameters.")

  # -- the pieces ------------------------------------------------------------

  def pieces(self) -> Iterator[Piece]:
    """The pieces, from the top down."""
    seg = self._seg
    by_seg: Dict[int, List[tf.Operation]] = collections.defaultdict(list)
    for op in self._order:
      if op in seg:
        by_seg[seg[op]].append(op)
    y_names = {y.name for y in self.ys}
    for j in sorted(by_seg, reverse=True):
      ops = by_seg[j]
      inside = set(ops)
      outputs = [t for op in ops for t in op.outputs
                 if _graph_util.differentiable(t) and (
                     t.name in y_names or any(
                         seg.get(c, -1) > j for c in t.consumers()))]
      boundary = {t.name: t for op in ops for t in op.inputs
                  if t.op in seg and t.op not in inside
                  and _graph_util.differentiable(t)}
      yield Piece(
          index=j, ops=ops, outputs=outputs, boundary=list(boundary.values()),
          external=[i for i, x in enumerate(self.xs) if not _is_var(x)
                    and x.op not in inside and x.name not in boundary
                    and any(c in inside for c in x.consumers())],
          inner=[i for i, x in enumerate(self.xs) if not _is_var(x)
                 and x.op in inside],
          variables=[i for i, x in enumerate(self.xs) if _is_var(x)],
          copyable=not any(self._forward_only(op) for op in ops))

  def call(self, piece: Piece, ys: Sequence[tf.Tensor], grads: Sequence
           ) -> Tuple[List, List, List]:
    """``(ys, xs, stops)`` of ``piece``'s VJP with ``grads`` at ``ys`` (of
    its ``outputs``): on a copy of its ops, made now, that waits for
    ``grads``. The results are for ``boundary``, ``external``, ``inner``
    and ``variables``, in that order."""
    mapping: Dict[str, tf.Tensor] = {}
    if piece.copyable:
      self._copy(piece.ops, mapping, grads, piece.index)
    xs = (piece.boundary + [self.xs[i] for i in piece.external]
          + [mapping.get(self.xs[i].name, self.xs[i]) for i in piece.inner]
          + [self.xs[i] for i in piece.variables])
    return ([mapping.get(t.name, t) for t in ys], xs,
            piece.boundary + self.stops + self._held)

  def _forward_only(self, op: tf.Operation) -> bool:
    """Whether ``op`` must be backpropagated through itself, not a copy."""
    return (_graph_util.in_control_flow(op) or op.type in _FUNCTIONAL
            or not _recompute_policy.reruns(op.type, op.op_def.is_stateful)
            or self.forward(op)
            or any(t.dtype == tf.variant for t in op.outputs)
            or any(t.dtype != t.dtype.base_dtype for t in op.inputs))

  def _copy(self, ops, mapping, grads, j) -> None:
    """Copies ``ops`` (in order); the first ones wait for ``grads``."""
    wait = [(g.values if isinstance(g, tf.IndexedSlices) else g).op
            for g in grads]
    inside = {op.name for op in ops}
    copies: Dict[str, tf.Operation] = {}
    with tf.name_scope(f"recompute_{j}"):
      for op in ops:
        fed = any(t.op.name in inside for t in op.inputs)
        deps = [copies.get(c.name, c) for c in op.control_inputs]
        if not fed:
          deps += wait
        inputs = [mapping.get(t.name, t) for t in op.inputs]
        attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
        with tf.control_dependencies(None), tf.control_dependencies(deps), \
            tf.device(op.device):
          new = self.graph.create_op(
              op.type, inputs, [t.dtype for t in op.outputs],
              name=op.name, attrs=attrs, op_def=op.op_def)
        copies[op.name] = new
        for t, n in zip(op.outputs, new.outputs):
          mapping[t.name] = n


# -- estimates -----------------------------------------------------------------


def memory_report(net: LayerGraph, keep: Optional[Sequence[str]] = None
                  ) -> str:
  """Each layer's activation bytes and the estimated peak of the backward
  pass's activations, without and with ``recompute(keep)``.

  The estimate counts the static sizes of the forward ops' floating-point
  outputs (an unknown dimension, such as the batch, counts as 1, so the
  figures are then per example). Without recompute every activation is
  kept; with it, the kept tensors plus the largest segment between two of
  them.
  """
  sizes = [(op, _op_bytes(op)) for op in _forward(net)]
  per_layer: Dict[str, int] = collections.Counter()
  for op, b in sizes:
    per_layer[net.layer_of(op) or "(glue)"] += b
  kept = kept_tensors(net, keep)
  kept_ops = {t.op.name for t in kept}
  total = sum(b for _, b in sizes)
  segments, current = [], 0
  for op, b in sizes:
    if op.name in kept_ops:
      segments.append(current)
      current = 0
    else:
      current += b
  segments.append(current)
  with_rc = (sum(_recompute_policy.tensor_bytes(t) for t in kept)
             + max(segments))
  unknown = any(d is None for op, _ in sizes for t in op.outputs
                if t.shape.rank is not None for d in t.shape)
  unit = " (per example: the batch dimension is unknown)" if unknown else ""
  width = max([len(n) for n in per_layer] + [5])
  lines = [f"activation bytes per layer{unit}", ""]
  lines += [f"  {name:<{width}}  {b:>14,}" for name, b in per_layer.items()]
  lines += ["", f"estimated peak of kept activations{unit}:",
            f"  without recompute: {total:,} bytes",
            f"  with recompute():  {with_rc:,} bytes ({len(kept)} kept "
            f"tensors: {', '.join(t.name for t in kept) or 'none'})"]
  return "\n".join(lines)
