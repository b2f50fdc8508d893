"""TensorBoard summaries of a built :class:`~graphgrad.GradientPlan`.

The figures are ``core._trace.figures`` of the plan's trace, the same as a
``KerasPlan``'s: for each layer the global norm of its parameter gradients
before and after its own transforms; at every transformed boundary (a
layer's upstream, or an edge) the norm of the gradient before and after the
transform. They are written as ``tf.compat.v1.summary`` ops under one name
scope, ``graphgrad/`` by default, so TensorBoard shows them as one section.
"""

from typing import List, Sequence, Tuple

import tensorflow as tf

from graphgrad._types import Gradient
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.core import _trace

tf1 = tf.compat.v1


def build(built: Sequence[Tuple[Gradient, tf.Variable]], net: LayerGraph,
          trace: Sequence[_trace.TraceRecord], graph: tf.Graph,
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
  out: List[tf.Tensor] = []
  with graph.as_default(), tf.name_scope(name.rstrip("/") + "/"):
    for figure in _trace.figures(trace, built, net.layer_of_variable,
                                 net.names):
      before, after = figure.norms()
      out.append(tf1.summary.scalar(f"{figure.tag}/before", before))
      out.append(tf1.summary.scalar(f"{figure.tag}/after", after))
    if histograms:
      for tag, values in _trace.histograms(trace, built,
                                           lambda v: v.op.name):
        out.append(tf1.summary.histogram(tag, values))
    return tf1.summary.merge(out, name="summaries")
