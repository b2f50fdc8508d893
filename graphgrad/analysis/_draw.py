"""Pictures of a layer graph: Graphviz DOT text, PNG and SVG files.

:func:`to_dot` writes DOT text by hand, so it needs nothing installed.
:func:`draw` renders it with Graphviz (through ``pydot`` or ``graphviz``)
when the ``dot`` program is available, and otherwise lays the graph out with
networkx and draws it with matplotlib, so that a picture always comes out.

Layers are nodes labelled with their parameter counts; edges carry the
shapes of their boundary tensors; an extra ``loss`` node collects the layers
that reach the loss through glue only. :class:`Highlights` fill layers, thicken
edges and dash the edges below a rewritten upstream gradient (a plan's
``draw`` marks its transforms so).
"""

import dataclasses
import logging
import os
from typing import Dict, FrozenSet, Mapping, Optional, Sequence, Tuple

import networkx as nx

from graphgrad import _errors, _installed

log = logging.getLogger("graphgrad")

_LOSS = "loss"
_PLAIN, _HOT = "#dbe9f6", "#f6c28b"  # node fills: untouched, transformed
_EDGE_HOT = "#d9480f"
_FORMATS = ("png", "svg", "dot")


def _quote(text: str) -> str:
  return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace(
      "\n", "\\n") + '"'


@dataclasses.dataclass(frozen=True)
class Highlights:
  """What a picture of a layer graph marks.

  Attributes:
    layers: layer name -> extra label lines; those layers are filled.
    edges: ``(lower, upper)`` -> extra label; those edges are drawn thick.
    upstream: layers that send a rewritten gradient below them (an upstream
      or input transform); the edges into them are dashed.
  """
  layers: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
  edges: Mapping[Tuple[str, str], str] = dataclasses.field(
      default_factory=dict)
  upstream: FrozenSet[str] = frozenset()


def elements(net, highlights: Optional[Highlights] = None):
  """Nodes and edges of the picture, shared by the DOT and matplotlib paths.

  Returns:
    ``(nodes, edges)``: ``nodes`` maps a node id to ``(label, highlighted)``;
    ``edges`` maps ``(a, b)`` to ``(label, mark)`` with ``mark`` one of
    ``None``, ``"edge"`` (an edge transform) or ``"upstream"`` (the edge
    carries the rewritten upstream gradient of ``b``).
  """
  # Here, not at the top: the command line checks and writes pictures in a
  # process that never imports TensorFlow.
  from graphgrad.analysis import _graph_util  # pylint: disable=g-import-not-at-top
  marks = highlights or Highlights()
  layer_marks, edge_marks = marks.layers, marks.edges
  nodes = {}
  for layer in net.layers:
    lines = [layer.name, f"{layer.num_params:,} params"]
    if layer.call_sites > 1:
      lines.append(f"{layer.call_sites} calls")
    lines += list(layer_marks.get(layer.name, ()))
    nodes[layer.name] = ("\n".join(lines), layer.name in layer_marks)
  nodes[_LOSS] = (f"loss\n{net.loss.name}", False)
  upstream = marks.upstream
  edges = {}
  for lo, up, data in net.graph.edges(data=True):
    label = ", ".join(_graph_util.shape_text(t.shape) for t in data["tensors"])
    mark = None
    if (lo, up) in edge_marks:
      label += "\n" + edge_marks[(lo, up)]
      mark = "edge"
    elif up in upstream:
      mark = "upstream"
    edges[(lo, up)] = (label, mark)
  for name in net.names:
    if net.reaches_loss_directly(name):
      outs = [t for t in net[name].outputs]
      shapes = ", ".join(_graph_util.shape_text(t.shape) for t in outs)
      edges[(name, _LOSS)] = (shapes, None)
  return nodes, edges


def to_dot(net, highlights: Optional[Highlights] = None) -> str:
  """DOT text of ``net``'s layer graph; see :meth:`LayerGraph.to_dot`."""
  return _dot_text(*elements(net, highlights))


def _dot_text(nodes, edges) -> str:
  lines = ["digraph layers {", "  rankdir=BT;",
           '  node [shape=box, style="rounded,filled", fontname="Helvetica", '
           f'fillcolor="{_PLAIN}"];',
           '  edge [fontname="Helvetica", fontsize=10];']
  for node, (label, hot) in nodes.items():
    attrs = [f"label={_quote(label)}"]
    if node == _LOSS:
      attrs.append('shape=ellipse, fillcolor="#eeeeee"')
    elif hot:
      attrs.append(f'fillcolor="{_HOT}", penwidth=2')
    lines.append(f"  {_quote(node)} [{', '.join(attrs)}];")
  for (a, b), (label, mark) in edges.items():
    attrs = [f"label={_quote(label)}"]
    if mark == "edge":
      attrs.append(f'color="{_EDGE_HOT}", fontcolor="{_EDGE_HOT}", '
                   f'penwidth=2.5')
    elif mark == "upstream":
      attrs.append(f'color="{_EDGE_HOT}", style=dashed, penwidth=1.5')
    lines.append(f"  {_quote(a)} -> {_quote(b)} [{', '.join(attrs)}];")
  lines.append("}")
  return "\n".join(lines) + "\n"


def _format_of(path: str) -> str:
  ext = os.path.splitext(str(path))[1].lower().lstrip(".")
  if ext not in _FORMATS:
    raise _errors.GraphGradError(
        f"`path` must end in .png, .svg or .dot; got {str(path)!r}. Name the "
        f"file e.g. 'layers.png'.")
  return ext


def can_render() -> bool:
  """Whether a picture can be drawn here: Graphviz's ``dot`` program with
  ``pydot`` or ``graphviz``, or else matplotlib."""
  import shutil  # pylint: disable=g-import-not-at-top
  if _installed.has_module("matplotlib"):
    return True
  return shutil.which("dot") is not None and (
      _installed.has_module("pydot") or _installed.has_module("graphviz"))


def _graphviz_render(dot: str, path: str, fmt: str) -> bool:
  """Renders with the Graphviz ``dot`` program; False when unavailable."""
  try:
    import pydot  # pylint: disable=g-import-not-at-top
    graphs = pydot.graph_from_dot_data(dot)
    if not graphs:
      raise ValueError("pydot parsed no graph from the DOT text")
    graphs[0].write(path, format=fmt)
    return True
  except Exception as e:  # pylint: disable=broad-except
    # No pydot, or no `dot` executable on PATH.
    log.debug("pydot could not render %s: %s", path, e)
  try:
    import graphviz  # pylint: disable=g-import-not-at-top
    with open(path, "wb") as f:
      f.write(graphviz.Source(dot).pipe(format=fmt))
    return True
  except Exception as e:  # pylint: disable=broad-except
    log.debug("graphviz could not render %s: %s", path, e)
  return False


def _layout(nodes, edges) -> Dict[str, Tuple[float, float]]:
  """Layered layout: inputs at the bottom, the loss at the top."""
  g = nx.DiGraph()
  g.add_nodes_from(nodes)
  g.add_edges_from(edges)
  try:
    generations = list(nx.topological_generations(g))
  except nx.NetworkXUnfeasible:  # a cycle: fall back to one column
    generations = [[n] for n in g.nodes]
  pos = {}
  for level, gen in enumerate(generations):
    gen = sorted(gen)
    for i, n in enumerate(gen):
      pos[n] = (i - (len(gen) - 1) / 2.0, float(level))
  return pos


def _matplotlib_render(nodes, edges, path: str, fmt: str) -> None:
  # A bare Figure needs no pyplot and leaves the user's backend alone.
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  pos = _layout(nodes, edges)
  levels = max(y for _, y in pos.values()) + 1
  width = max(sum(1 for p in pos.values() if p[1] == y)
              for y in {p[1] for p in pos.values()})
  fig = Figure(figsize=(max(4.0, 3.2 * width), max(3.0, 1.9 * levels)))
  ax = fig.add_subplot(1, 1, 1)
  for (a, b), (label, mark) in edges.items():
    (xa, ya), (xb, yb) = pos[a], pos[b]
    color = _EDGE_HOT if mark else "#555555"
    ax.annotate("", xy=(xb, yb - 0.22), xytext=(xa, ya + 0.22),
                arrowprops=dict(arrowstyle="-|>", color=color,
                                lw=2.5 if mark == "edge" else 1.2,
                                ls="--" if mark == "upstream" else "-"))
    ax.text((xa + xb) / 2 + 0.05, (ya + yb) / 2, label, fontsize=8,
            color=color, ha="left", va="center")
  for n, (label, hot) in nodes.items():
    x, y = pos[n]
    face = "#eeeeee" if n == _LOSS else (_HOT if hot else _PLAIN)
    ax.text(x, y, label, ha="center", va="center", fontsize=9,
            bbox=dict(boxstyle="round,pad=0.4", fc=face,
                      ec="#333333", lw=2 if hot else 1))
  xs = [p[0] for p in pos.values()]
  ax.set_xlim(min(xs) - 1.0, max(xs) + 1.0)
  ax.set_ylim(-0.6, levels - 0.4)
  ax.axis("off")
  fig.tight_layout()
  fig.savefig(path, format=fmt, dpi=110)


def picture(net, highlights: Optional[Highlights] = None) -> Dict:
  """The picture of ``net`` as JSON data, to draw in another process.

  ``graphgrad inspect`` analyses an untrusted model in a confined process
  that may write no file; the command line's own process draws it with
  :func:`write_picture`.

  Returns:
    ``{"nodes": [[id, label, highlighted], ...], "edges": [[a, b, label,
    mark], ...]}``; see :func:`elements`.
  """
  nodes, edges = elements(net, highlights)
  return {"nodes": [[n, label, hot] for n, (label, hot) in nodes.items()],
          "edges": [[a, b, label, mark]
                    for (a, b), (label, mark) in edges.items()]}


def _from_picture(data) -> Tuple[Dict, Dict]:
  """``elements``' ``(nodes, edges)`` from :func:`picture`'s data, checked
  entry by entry."""
  def text(value):
    if not isinstance(value, str):
      raise _errors.GraphGradError(
          f"a layer-graph picture holds {type(value).__name__} where a "
          f"label belongs; it must come from picture()")
    return value
  try:
    nodes = {text(n): (text(label), bool(hot))
             for n, label, hot in data["nodes"]}
    edges = {(text(a), text(b)): (text(label),
                                  mark if mark in ("edge", "upstream")
                                  else None)
             for a, b, label, mark in data["edges"]}
  except (KeyError, TypeError, ValueError):
    raise _errors.GraphGradError(
        "a layer-graph picture must be the dict picture() returns") from None
  for a, b in edges:
    if a not in nodes or b not in nodes:
      raise _errors.GraphGradError(
          f"a layer-graph picture has an edge {a!r} -> {b!r} between nodes "
          f"it does not list")
  return nodes, edges


def draw(net, path, highlights: Optional[Highlights] = None,
         graphviz: bool = True) -> str:
  """Writes a picture of ``net``; see :meth:`LayerGraph.draw`."""
  return write_picture(picture(net, highlights), path, graphviz)


def write_picture(data: Mapping, path, graphviz: bool = True) -> str:
  """Writes :func:`picture`'s data to ``path`` (``.png``, ``.svg`` or
  ``.dot``): with Graphviz when it is installed, else with matplotlib.

  Returns:
    ``path``.

  Raises:
    GraphGradError: for another extension, data not made by
      :func:`picture`, or neither renderer.
  """
  fmt = _format_of(path)
  path = os.fspath(path)
  nodes, edges = _from_picture(data)
  dot = _dot_text(nodes, edges)
  if fmt == "dot":
    with open(path, "w", encoding="utf-8") as f:
      f.write(dot)
    return path
  if graphviz and _graphviz_render(dot, path, fmt):
    log.info("wrote %s with Graphviz", path)
    return path
  if not _installed.has_module("matplotlib"):
    tried = "Graphviz's `dot` program" if graphviz else "Graphviz (off)"
    raise _errors.GraphGradError(
        f"cannot write {path}: neither {tried} nor "
        f"matplotlib is available. Install one of them (pip install "
        f"'graphgrad[draw]' brings matplotlib), or write DOT text with "
        f"net.draw('graph.dot').")
  _matplotlib_render(nodes, edges, path, fmt)
  log.info("wrote %s with matplotlib (Graphviz's `dot` was not found)", path)
  return path
