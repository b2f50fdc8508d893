"""A plan's transforms as highlights of its layer-graph picture.

Transformed layers are filled and labelled with their transforms, transformed
edges are thick, and the edges below a rewritten upstream gradient are dashed.
"""

from typing import Dict, List, Tuple

from graphgrad.analysis._draw import Highlights


def _declared(declarations, kind: str) -> Dict:
  """``key -> [transform, ...]`` of the declarations of one kind."""
  found: Dict = {}
  for d in declarations:
    if d.kind.value == kind:
      key = (d.layer, d.upper) if kind == "edge" else d.layer
      found.setdefault(key, []).append(d.fn)
  return found


def highlights(declarations) -> Highlights:
  """The :class:`Highlights` of a plan's ``declarations``."""
  layers: Dict[str, List[str]] = {}
  upstream = _declared(declarations, "upstream")
  for name, fns in upstream.items():
    layers.setdefault(name, []).append(
        "upstream: " + ", ".join(map(repr, fns)))
  for name, fns in _declared(declarations, "gradients").items():
    layers.setdefault(name, []).append(
        "params: " + ", ".join(map(repr, fns)))
  edges: Dict[Tuple[str, str], str] = {
      key: ", ".join(map(repr, fns))
      for key, fns in _declared(declarations, "edge").items()}
  return Highlights(layers=layers, edges=edges, upstream=frozenset(upstream))
