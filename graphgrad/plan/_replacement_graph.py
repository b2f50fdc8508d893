"""The TF1 executor's side of a backward replacement's context.

Core's backward step (``core._layer_step``) runs a replacement
(``plan.replace_backward``) with the
:class:`~graphgrad.methods._replacement.BackwardContext` both plans share;
on a ``tf.Graph`` its executor is a :class:`GraphBackward`: its VJP is the
plan's (``_backprop.GraphVJP``), its variables are kept in the plan's
resources, and a dense layer is found in the op graph.
"""

from typing import Sequence

import tensorflow as tf

from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.methods._replacement import DenseMatMul, kernel_matmul
from graphgrad.plan._backprop import GraphVJP
from graphgrad.transforms._context import Resources

__all__ = ["GraphBackward"]


class GraphBackward:
  """The TF1 segment engine's side of a ``BackwardContext``.

  Its VJP is the plan's (with the plan's overrides and options, and
  recomputing under ``plan.recompute``); its variables are kept in the
  plan's resources; a dense layer is found in the op graph.
  """

  def __init__(self, net: LayerGraph, layer: str, resources: Resources,
               vjp: GraphVJP, outputs: Sequence):
    self.net, self.layer, self.resources = net, layer, resources
    self.vjp = vjp.vjp  # the one VJP signature: BackwardContext.vjp's
    self.outputs = tuple(outputs)

  def variable(self, key, init, trainable, name) -> tf.Variable:
    return self.resources.get_or_create(
        self.layer, key,
        lambda: tf.compat.v1.Variable(init(), trainable=trainable, name=name))

  def dense(self, who: str) -> DenseMatMul:
    mm, k = kernel_matmul(self.net, self.layer, who)
    return DenseMatMul(data=mm.inputs[1 - k], kernel=mm.inputs[k],
                       pre=mm.outputs[0], outputs=self.outputs,
                       kernel_index=k,
                       transpose_a=mm.get_attr("transpose_a"),
                       transpose_b=mm.get_attr("transpose_b"))
