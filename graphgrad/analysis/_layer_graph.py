"""Layers and the layer graph: what gg.analyze returns.

A **layer** is a set of variables and the ops in their name scopes, with the
ops that read its variables wherever they sit, and the control flow whose
body reads only its variables (:mod:`graphgrad.analysis._control_flow`).
Variables with no scope of their own form layers from the ops that use them
(:func:`graphgrad.analysis._grouping.group_by_ops`). **Glue** is a forward op
that belongs to no layer. A layer's **inputs** are the tensors its ops consume
from outside it; its **outputs** are its tensors consumed outside it on the
way to the loss. The **boundary** ``(lower, upper)`` is the set of outputs of
``lower`` that reach an input of ``upper`` through glue only. The glossary of
the documentation's Concepts page gives each word exactly.
"""

import dataclasses
from typing import Dict, FrozenSet, Optional, Tuple

import networkx as nx
import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _draw, _graph_util, _layer_names


@dataclasses.dataclass(frozen=True, eq=False)
class Layer:
  """One layer of an analysed graph.

  Attributes:
    name: the layer's name, by default its variable scope (``"l1_dense"``).
    variables: the trainable variables the loss reaches, in graph order.
    ops: the layer's forward ops, in topological order.
    inputs: tensors that enter the layer from outside it.
    outputs: the layer's tensors consumed outside it on the way to the loss.
    scopes: the name scopes whose ops belong to the layer.
    call_sites: how many times the layer is applied to inputs (a variable
      scope reused for siamese towers has two). A regulariser that reads the
      variables only, or an activation in the scope that reads none (tf-slim's
      after a BatchNorm), is not a call site.
  """
  name: str
  variables: Tuple[tf.Variable, ...]
  ops: Tuple[tf.Operation, ...]
  inputs: Tuple[tf.Tensor, ...]
  outputs: Tuple[tf.Tensor, ...]
  scopes: Tuple[str, ...]
  call_sites: int = 1

  @property
  def num_params(self) -> int:
    """Number of scalar parameters (unknown dimensions count as 0)."""
    return sum(_num_elements(v.shape) for v in self.variables)

  def __repr__(self) -> str:
    return (f"Layer({self.name!r}, variables={len(self.variables)}, "
            f"inputs={len(self.inputs)}, outputs={len(self.outputs)})")


def _num_elements(shape) -> int:
  n = 1
  for d in tf.TensorShape(shape).as_list():
    n *= d or 0
  return n


def scope_of(name: str) -> str:
  """Scope of a variable or op name: ``'a/b/kernel:0'`` -> ``'a/b'``.

  A name with no scope is its own scope: ``'w:0'`` -> ``'w'``.
  """
  name = name.split(":")[0]
  return name.rsplit("/", 1)[0] if "/" in name else name


class LayerGraph:
  """The layers of a graph, how they connect, and the forward ops between.

  Build it with :func:`analyze`. ``net[name]`` returns a :class:`Layer`.

  Attributes:
    loss: the analysed loss tensor.
    layers: the layers, in topological order from the input side to the loss.
    graph: ``networkx.DiGraph`` on layer names; an edge ``a -> b`` when an
      output of ``a`` reaches ``b`` through glue ops only. Edge attribute
      ``tensors`` holds the boundary tensors.
    op_graph: ``networkx.DiGraph`` on op names of the forward graph, with node
      attribute ``op`` (the ``tf.Operation``) and ``layer`` (its layer name,
      or ``None`` for glue). It is a DAG: the back-edges of
      ``tf.compat.v1`` while loops are listed in ``loop_edges`` instead.
  """

  def __init__(self, loss, layers, graph, op_graph, op_layer, topo_index,
               loop_edges=(), lost_overrides=()):
    self.loss = loss
    self.layers: Tuple[Layer, ...] = tuple(layers)
    self.graph: nx.DiGraph = graph
    self.op_graph: nx.DiGraph = op_graph
    self._by_name = {l.name: l for l in self.layers}
    self._op_layer: Dict[str, Optional[str]] = op_layer
    self._topo_index: Dict[str, int] = topo_index
    # tf.compat.v1 while loops: NextIteration -> Merge edges, left out of
    # op_graph so that it stays a DAG.
    self.loop_edges: Tuple[Tuple[str, str], ...] = tuple(loop_edges)
    self._var_layer = {v.op.name: l.name for l in self.layers
                       for v in l.variables}
    self._lost_overrides = tuple(lost_overrides)

  # -- lookup --------------------------------------------------------------

  @property
  def names(self) -> Tuple[str, ...]:
    """Layer names in topological order."""
    return tuple(l.name for l in self.layers)

  def __getitem__(self, name: str) -> Layer:
    if not isinstance(name, str):
      raise _errors.GraphGradError(
          f"layer names are strings; got {type(name).__name__} {name!r}. "
          f"Known layers: {', '.join(self.names)}")
    try:
      return self._by_name[name]
    except KeyError:
      pass
    return self._by_name[self.lookup(name, "name")]

  def lookup(self, name, arg: str = "layer") -> str:
    """The name of the layer ``name``, or an error that says why there is none.

    Args:
      name: a layer name.
      arg: the argument that passed it, for the message (``"lower"``).

    Returns:
      ``name``.

    Raises:
      NotConnectedError: if ``name`` holds trainable variables the loss does
        not depend on.
      LayerNotFoundError: otherwise; the message says when ``name`` holds
        only non-trainable variables or is a sub-scope of a layer.
    """
    if isinstance(name, str) and name in self._by_name:
      return name
    raise _layer_names.not_a_layer(self, name, arg)

  def __contains__(self, name) -> bool:
    return name in self._by_name

  def __iter__(self):
    return iter(self.layers)

  def __len__(self) -> int:
    return len(self.layers)

  def layer_of(self, op: tf.Operation) -> Optional[str]:
    """Name of the layer an op belongs to, or ``None`` for glue."""
    return self._op_layer.get(op.name)

  def layers_of_ops(self, match: str, key: str) -> FrozenSet[str]:
    """The layers holding the ops of the op graph that ``(match, key)``
    names: ``"name"`` an op's name, ``"type"`` every op of a type (the
    compiled plan's topology, ``graphgrad.core._rules.Topology``)."""
    found = set()
    for _, d in self.op_graph.nodes(data=True):
      op = d["op"]
      if (op.name if match == "name" else op.type) == key:
        layer = self.layer_of(op)
        if layer is not None:
          found.add(layer)
    return frozenset(found)

  @property
  def replacement_view(self) -> "LayerGraph":
    """The layers as a backward replacement sees them: this layer graph."""
    return self

  def layer_of_variable(self, var: tf.Variable) -> Optional[str]:
    """Name of the layer that holds ``var``, or ``None``."""
    return self._var_layer.get(var.op.name)

  @property
  def lost_overrides(self) -> tuple:
    """The forward ops whose gradient override this process never registered.

    A graph built with ``gradient_override_map`` and imported into another
    process keeps each op's override name but not its function. Each item
    (``op``, ``override``, ``kind``, ``declaration``, ``hint``) names the op
    and the override, and gives the plan line that looks like it restores
    the behaviour: ``plan.straight_through(op).transform_edge(lower, upper,
    gg.transforms.reverse(l))`` for a gradient reversal,
    ``plan.straight_through(op)`` for a straight-through estimator, else
    ``plan.override_gradient(op, fn)``. ``gg.analyze`` logs them once.
    """
    return self._lost_overrides

  def topo_index(self, op: tf.Operation) -> int:
    """Position of a forward op in the topological order (inputs first)."""
    return self._topo_index[op.name]

  @property
  def variables(self) -> Tuple[tf.Variable, ...]:
    """All layers' variables, in layer order."""
    return tuple(v for l in self.layers for v in l.variables)

  # -- structure -----------------------------------------------------------

  def boundary(self, lower: str, upper: str) -> Tuple[tf.Tensor, ...]:
    """Tensors of ``lower`` through which ``upper`` sends gradients into it.

    Args:
      lower: name of the layer nearer the input.
      upper: name of the layer nearer the loss.

    Returns:
      The outputs of ``lower`` that reach an input of ``upper`` through glue
      ops only, in graph order.

    Raises:
      LayerNotFoundError: if either name is unknown.
      GraphGradError: if ``net.graph`` has no edge ``lower -> upper``; the
        message lists the real neighbours.
    """
    self[lower], self[upper]  # pylint: disable=pointless-statement
    if not self.graph.has_edge(lower, upper):
      succ = sorted(self.graph.successors(lower))
      pred = sorted(self.graph.predecessors(upper))
      raise _errors.GraphGradError(
          f"no edge {lower!r} -> {upper!r} in the layer graph: no output of "
          f"{lower!r} reaches {upper!r} through glue ops only. {lower!r} "
          f"feeds: {', '.join(succ) or '(nothing)'}; {upper!r} is fed by: "
          f"{', '.join(pred) or '(nothing)'}. Pick one of these edges.")
    return self.graph.edges[lower, upper]["tensors"]

  def reaches_loss_directly(self, name: str) -> bool:
    """True when an output of the layer reaches the loss through glue only."""
    return bool(self.graph.nodes[self[name].name].get("to_loss"))

  def summary(self) -> str:
    """A readable table of layers, variables, parameters and boundaries.

    Returns:
      A multi-line string.
    """
    rows = [("layer", "calls", "variables", "params", "inputs", "outputs")]
    for l in self.layers:
      rows.append((
          l.name, str(l.call_sites),
          ", ".join(f"{_short(v.name, l)} {_graph_util.shape_text(v.shape)}"
                    for v in l.variables) or "-",
          f"{l.num_params:,}",
          ", ".join(_graph_util.shape_text(t.shape) for t in l.inputs) or "-",
          ", ".join(_graph_util.shape_text(t.shape) for t in l.outputs) or "-",
      ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = sum(l.num_params for l in self.layers)
    lines.append(f"{len(self.layers)} layers, {total:,} trainable parameters "
                 f"reach the loss {self.loss.name}")
    lines.append("")
    lines.append("boundaries (lower -> upper: tensors)")
    for lo, up, data in self.graph.edges(data=True):
      ts = ", ".join(f"{t.name} {_graph_util.shape_text(t.shape)}"
                     for t in data["tensors"])
      lines.append(f"  {lo} -> {up}: {ts}")
    if not self.graph.number_of_edges():
      lines.append("  (none)")
    return "\n".join(lines)

  def to_dot(self) -> str:
    """Graphviz DOT text of the layer graph.

    Layers are nodes labelled with their parameter counts, edges are
    labelled with the shapes of their boundary tensors, and a ``loss`` node
    collects the layers that reach the loss through glue only.
    :meth:`GradientPlan.to_dot` also marks a plan's transforms.

    Returns:
      DOT text, for ``dot -Tpng`` or any Graphviz viewer.

    Example:
      >>> import tensorflow as tf, graphgrad as gg
      >>> with tf.Graph().as_default():
      ...   x = tf.compat.v1.placeholder(tf.float32, [None, 3])
      ...   with tf.compat.v1.variable_scope("l1"):
      ...     h = x @ tf.compat.v1.get_variable("w", [3, 4])
      ...   with tf.compat.v1.variable_scope("l2"):
      ...     y = h @ tf.compat.v1.get_variable("w", [4, 1])
      ...   print(gg.analyze(tf.reduce_sum(y)).to_dot().splitlines()[-3])
        "l1" -> "l2" [label="[?,4]"];
    """
    return _draw.to_dot(self)

  def draw(self, path, graphviz: bool = True) -> str:
    """Writes a picture of the layer graph to a PNG, SVG or DOT file.

    Uses Graphviz (through ``pydot`` or ``graphviz``) when its ``dot``
    program is installed; otherwise lays the graph out with networkx and
    draws it with matplotlib, so a picture always comes out.
    :meth:`GradientPlan.draw` also marks a plan's transforms.

    Args:
      path: file name ending in ``.png``, ``.svg`` or ``.dot``.
      graphviz: try Graphviz first; ``False`` always draws with matplotlib
        (the same picture on every machine).

    Returns:
      ``path``, as a string.

    Raises:
      GraphGradError: for another file extension, or when neither Graphviz
        nor matplotlib is available.
    """
    return _draw.draw(self, path, graphviz=graphviz)

  def __repr__(self) -> str:
    return (f"LayerGraph({len(self.layers)} layers: {', '.join(self.names)}; "
            f"{self.op_graph.number_of_nodes()} forward ops)")


def _short(var_name: str, layer: Layer) -> str:
  name = var_name.split(":")[0]
  for s in layer.scopes:
    if name.startswith(s + "/"):
      return name[len(s) + 1:]
  return name
