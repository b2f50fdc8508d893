"""The TF1 executor of backward replacements (``plan.replace_backward``).

The segment engine calls :func:`replace_backward` at a replaced layer;
it makes the :class:`~graphgrad.methods._replacement.BackwardContext` both
plans share, whose executor is a :class:`GraphBackward`: its VJP is the
plan's (``_backprop.GraphVJP``), its variables are kept in the plan's
resources, and a dense layer is found in the op graph.
"""

from typing import Callable, List, Sequence, Tuple

import tensorflow as tf

from graphgrad._types import Gradient
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.methods._replacement import (
  BackwardContext,
  DenseMatMul,
  kernel_matmul,
  run_replacement,
)
from graphgrad.plan._backprop import GraphVJP
from graphgrad.transforms._context import Resources

__all__ = ["GraphBackward", "replace_backward"]


class GraphBackward:
  """The TF1 segment engine's side of a ``BackwardContext``.

  Its VJP is the plan's (with the plan's overrides and options, and
  recomputing under ``plan.recompute``); its variables are kept in the
  plan's resources; a dense layer is found in the op graph.
  """

  def __init__(self, net: LayerGraph, layer: str, resources: Resources,
               vjp: GraphVJP, outputs: Sequence):
    self.net, self.layer, self.resources = net, layer, resources
    self._vjp = vjp
    self.outputs = tuple(outputs)

  def vjp(self, ys, xs, grad_ys, stop) -> List[Gradient]:
    """``grad_ys=None``: ones at every ``ys`` entry."""
    return self._vjp.vjp(ys, grad_ys, xs, stop)

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


def replace_backward(net: LayerGraph, name: str, fn: Callable,
                     resources: Resources,
                     extra: List[Tuple[Gradient, tf.Variable]], vjp: GraphVJP,
                     *, outputs, upstream, inputs, upstream_of, chain_rule
                     ) -> Sequence[Gradient]:
  """Runs ``fn``, the replacement of layer ``name``, for the segment engine:
  its arguments in, checked gradients out; the result's extra ``(gradient,
  variable)`` pairs go to ``extra``. ``vjp`` is the plan's, the context's
  ``vjp``. An exception ``fn`` raises becomes a ``GraphGradError`` naming
  the layer."""
  layer = net[name]
  ctx = BackwardContext(
      layer=layer, name=layer.name, net=net, inputs=tuple(inputs),
      outputs=tuple(outputs), upstream=tuple(upstream),
      upstream_of=upstream_of, chain_rule=chain_rule, resources=resources,
      executor=GraphBackward(net, layer.name, resources, vjp, outputs))
  with tf.name_scope(f"replace_backward_{ctx.name}".replace("/", "_")):
    result = run_replacement(fn, ctx, f"replace_backward({name!r})")
  extra.extend(result.extra_grads_and_vars)
  return result.input_grads
