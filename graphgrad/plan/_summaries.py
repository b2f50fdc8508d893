"""TensorBoard summaries of a built :class:`~graphgrad.GradientPlan`.

For each layer the global norm of its parameter gradients before and after
its own transforms; at every transformed boundary (a layer's upstream, or an
edge) the norm of the gradient before and after the transform. Everything is
grouped under one name scope, ``graphgrad/`` by default, so TensorBoard shows
it as one section.
"""

import collections
from typing import Dict, List, Sequence, Tuple

import tensorflow as tf

from graphgrad._types import Gradient, gradient_values
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.plan._executor import TraceRecord

tf1 = tf.compat.v1


def _norm(grads: List[Gradient], name: str) -> tf.Tensor:
  return tf.linalg.global_norm([gradient_values(g) for g in grads], name=name)


def _pair(tag: str, before: List[Gradient], after: List[Gradient],
          out: List[tf.Tensor]) -> None:
  """Adds ``tag/before`` and ``tag/after``; one norm op when they agree."""
  after_norm = _norm(after, "norm")
  same = len(before) == len(after) and all(
      b is a for b, a in zip(before, after))
  before_norm = after_norm if same else _norm(before, "norm_before")
  out.append(tf1.summary.scalar(f"{tag}/before", before_norm))
  out.append(tf1.summary.scalar(f"{tag}/after", after_norm))


def build(built: Sequence[Tuple[Gradient, tf.Variable]], net: LayerGraph,
          trace: Sequence[TraceRecord], graph: tf.Graph,
          histograms: bool = False, name: str = "graphgrad") -> tf.Tensor:
  """The summaries of a built plan; see :meth:`GradientPlan.summaries`.

  Args:
    built: the plan's ``(gradient, variable)`` pairs.
    net: the plan's layer graph.
    trace: the plan's ``(context, before, after)`` records.
    graph: the loss's tf.Graph.
    histograms: also add gradient histograms.
    name: the name scope.
  """
  params_before: Dict[str, Gradient] = {}
  upstream: Dict[str, Tuple[List[Gradient], List[Gradient]]] = (
      collections.defaultdict(lambda: ([], [])))
  edges: Dict[Tuple[str, str], Tuple[List[Gradient], List[Gradient]]] = (
      collections.defaultdict(lambda: ([], [])))
  for ctx, before, after in trace:
    if before is None or after is None:
      continue
    if ctx.role == "gradients":
      params_before[ctx.variable.op.name] = before
    elif ctx.role in ("upstream", "edge"):
      pair = upstream[ctx.layer] if ctx.role == "upstream" else edges[ctx.edge]
      pair[0].append(before)
      pair[1].append(after)

  by_layer = collections.defaultdict(list)
  for g, v in built:
    layer = net.layer_of_variable(v)
    if g is not None and layer is not None:
      by_layer[layer].append((g, v))

  out: List[tf.Tensor] = []
  with graph.as_default(), tf.name_scope(name.rstrip("/") + "/"):
    for layer in net.names:
      pairs = by_layer.get(layer)
      if not pairs:
        continue
      after = [g for g, _ in pairs]
      before = [params_before.get(v.op.name, g) for g, v in pairs]
      _pair(f"grad_norm/{layer}", before, after, out)
    for layer in net.names:
      if layer in upstream:
        _pair(f"upstream_norm/{layer}", *upstream[layer], out)
    for (lo, up), (before, after) in sorted(edges.items()):
      _pair(f"edge_norm/{lo}_to_{up}", before, after, out)
    if histograms:
      for g, v in built:
        if g is not None:
          out.append(tf1.summary.histogram(f"grad_hist/{v.op.name}",
                                           gradient_values(g)))
      for layer, (_, after) in upstream.items():
        for g in after:
          out.append(tf1.summary.histogram(f"upstream_hist/{layer}",
                                           gradient_values(g)))
    return tf1.summary.merge(out, name="summaries")
