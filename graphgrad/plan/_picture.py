"""A plan's compiled rules as highlights of its layer-graph picture.

Transformed layers are filled and labelled with their transforms, transformed
edges are thick, and the edges below a layer whose upstream or input
transform rewrites what it sends there are dashed.
"""

from typing import Dict, List, Tuple

from graphgrad.analysis._draw import Highlights
from graphgrad.core._rules import PlanRules


def highlights(rules: PlanRules) -> Highlights:
  """The :class:`Highlights` of a plan's compiled ``rules``."""
  layers: Dict[str, List[str]] = {}
  upstream = rules.upstream
  for name, fn in upstream.items():
    layers.setdefault(name, []).append(f"upstream: {fn!r}")
  for name, fn in rules.inputs.items():
    layers.setdefault(name, []).append(f"inputs: {fn!r}")
  for name, fns in rules.own_parameters.items():
    layers.setdefault(name, []).append(
        "params: " + ", ".join(map(repr, fns)))
  edges: Dict[Tuple[str, str], str] = {
      key: repr(e.transform) for key, e in rules.edges.items()}
  return Highlights(layers=layers, edges=edges,
                    upstream=frozenset(upstream) | frozenset(rules.inputs))
