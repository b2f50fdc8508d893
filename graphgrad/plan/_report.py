"""The gradient-flow report of a ``tf.compat.v1`` graph, run in a Session.

:func:`gradient_report` runs the backward pass of an analysed loss in a
``Session`` and measures, for every layer in topological order, the figures
of ``core._report`` (with a :class:`~graphgrad.GradientPlan`, ``before`` and
``after`` it); the flags follow the layer graph's edges from each layer
to the output layers. A layer gets *no gradient* when, e.g., ``tf.round``
lies between it and the loss.
"""

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util
from graphgrad.analysis._control_flow import V2_OPS
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.core._report_figures import (
  GradientReport,
  check_counts,
  flag,
  layer_row,
)
from graphgrad.plan._backprop import GraphVJP
from graphgrad.plan._gradient_plan import GradientPlan

Feed = Union[None, Mapping, Sequence[Mapping], Callable[[int], Mapping]]
# Ops whose gradient (while_v2, cond_v2, a tf.function's) may add outputs
# to the forward op.
_FUNCTIONAL = V2_OPS | {"PartitionedCall", "StatefulPartitionedCall"}


def gradient_report(sess: tf.compat.v1.Session, net: LayerGraph,
                    feed: Feed = None, plan: Optional[GradientPlan] = None,
                    batches: int = 1, threshold: float = 2.0) -> GradientReport:
  """Measures each layer's gradients and flags vanishing or exploding ones.

  The figures and the flag rule are defined in the module docstring and on
  the concepts page of the documentation. The report adds gradient ops to
  the loss's ``tf.Graph`` (one plain ``tf.gradients`` call, and the plan's
  build when a plan is given) and runs them; it changes no variable.

  Args:
    sess: a ``tf.compat.v1.Session`` on the loss's graph, with the variables
      initialised or restored.
    net: the :class:`~graphgrad.LayerGraph` of the loss, from ``gg.analyze``.
    feed: the feed of each batch: ``None``, a feed dict (used for every
      batch), a sequence of ``batches`` feed dicts, or a callable mapping the
      batch index to a feed dict.
    plan: optional :class:`~graphgrad.GradientPlan` on the same loss; its
      figures are reported as ``after``. It is built if it is not yet.
    batches: number of batches; each figure is the mean over them.
    threshold: orders of magnitude beyond which a layer is flagged.

  Returns:
    A :class:`GradientReport`.

  Raises:
    GraphGradError: on a malformed argument, or when the gradient of a
      functional ``While``, ``If``, ``Case`` or function call changes its
      forward op after ``sess`` has run the graph (build one gradient
      before that), or when the loss calls an imported function holding a
      functional ``While``, ``If`` or ``Case`` (``tf.gradients`` can only
      differentiate it with ``SymbolicGradient``, which cannot take them).

  Example:
    >>> import tensorflow as tf, graphgrad as gg
    >>> with tf.Graph().as_default():
    ...   x = tf.constant([[1.0, 2.0]])
    ...   with tf.compat.v1.variable_scope("l1"):
    ...     h = x @ tf.compat.v1.get_variable("w", initializer=[[1.0], [1.0]])
    ...   with tf.compat.v1.variable_scope("l2"):
    ...     y = h * tf.compat.v1.get_variable("w", initializer=3.0)
    ...   net = gg.analyze(tf.reduce_sum(y))
    ...   with tf.compat.v1.Session() as sess:
    ...     sess.run(tf.compat.v1.global_variables_initializer())
    ...     report = gg.gradient_report(sess, net)
    >>> round(report["l1"]["grad_norm"]["before"], 3)   # ||3 * x||
    6.708
    >>> report["l2"]["upstream_norm"]["before"]
    1.0
  """
  _check_args(sess, net, plan, batches, threshold)
  feeds = _feeds(feed, batches)
  before = _output_counts(net.loss.graph)
  fetches = build(net, plan)
  try:
    return measure(sess, net, fetches, feeds, threshold, plan is not None)
  except tf.errors.InvalidArgumentError as e:
    grown = sorted(op.name for op, n in before.items()
                   if len(op.outputs) != n)
    if not grown:
      raise
    raise _errors.GraphGradError(
        f"gradient_report: differentiating the functional op "
        f"{grown[0]!r} added outputs to it after `sess` had run the graph, "
        f"so `sess` cannot run its gradient. Build the gradients once "
        f"before the first sess.run (tf.compat.v1.gradients(loss, "
        f"variables) is enough), or report on a fresh import of the model "
        f"(graphgrad grads MODEL).") from e


def _output_counts(graph: tf.Graph) -> Dict[tf.Operation, int]:
  """Output counts of the ops whose gradient may add outputs to them."""
  return {op: len(op.outputs) for op in graph.get_operations()
          if op.type in _FUNCTIONAL}


def build(net: LayerGraph, plan: Optional[GradientPlan] = None
          ) -> Dict[str, Any]:
  """The fetches of :func:`gradient_report`, built but not run.

  ``graphgrad grads`` checks the ops they run before :func:`measure` runs
  them, and builds them before its ``Session`` exists: the gradient of a
  functional ``While`` or ``If`` adds outputs to the forward op, which a
  ``Session`` that has already run the graph cannot take.
  """
  graph = net.loss.graph
  known = len(graph.get_operations())
  fetches = _fetches(net, plan)
  _check_symbolic(graph.get_operations()[known:])
  return fetches


def _check_symbolic(new_ops: Sequence[tf.Operation]) -> None:
  """Refuses a ``SymbolicGradient`` over functional control flow.

  An imported function call has no Python gradient, so ``tf.gradients``
  differentiates it with ``SymbolicGradient``, which gives zeros through a
  functional ``While`` inside it and fails at run time on an ``If``.
  """
  calls = [op for op in new_ops if op.type == "SymbolicGradient"]
  if not calls:
    return
  library = {f.signature.name: f for f in
             calls[0].graph.as_graph_def().library.function}
  for op in calls:
    found = _graph_util.called_node([op], V2_OPS.__contains__,
                                    library)
    if found is not None:
      name, node = found
      raise _errors.UnsupportedGraphError(
          f"gradient_report: the loss calls function "
          f"{op.get_attr('f').name!r} of an imported graph, which has "
          f"no Python gradient, so tf.gradients differentiates the call "
          f"with TensorFlow's SymbolicGradient; that cannot take the "
          f"{node.op} {node.name!r} in function {name!r} (it gives "
          f"zeros or fails). Save the model with the loop or cond "
          f"outside the tf.function (control flow v2 in the graph "
          f"itself), or report on the graph that defined the function.")


def measure(sess: tf.compat.v1.Session, net: LayerGraph,
            fetches: Dict[str, Any], feeds: Sequence[Optional[Mapping]],
            threshold: float = 2.0, has_plan: bool = False
            ) -> GradientReport:
  """Runs ``fetches`` (from :func:`build`) once per feed; the report."""
  runs = [sess.run(fetches, feed_dict=f) for f in feeds]
  layers = [layer_row(name, net[name].num_params, [r[name] for r in runs])
            for name in net.names]
  flag(layers, lambda name: set(net.graph.successors(name)), threshold)
  return GradientReport(net.loss.name, layers, len(feeds), threshold,
                        has_plan)


def _check_args(sess, net, plan, batches, threshold) -> None:
  if not isinstance(net, LayerGraph):
    raise _errors.GraphGradError(
        f"gradient_report: `net` must be a gg.LayerGraph from "
        f"gg.analyze(loss); got {type(net).__name__}.")
  if not isinstance(sess, tf.compat.v1.Session) or sess.graph is not (
      net.loss.graph):
    raise _errors.GraphGradError(
        f"gradient_report: `sess` must be a tf.compat.v1.Session on the "
        f"loss's tf.Graph, or a Keras model; got {type(sess).__name__}. "
        f"Pass tf.compat.v1.Session(graph=net.loss.graph).")
  if net.loss.graph.finalized:
    raise _errors.GraphGradError(
        "gradient_report: the loss's tf.Graph is finalized (a "
        "MonitoredTrainingSession finalizes it), so no gradient ops can be "
        "added. Build the report before the graph is finalized, or on a "
        "fresh import of the model (graphgrad grads MODEL).")
  if plan is not None and (not isinstance(plan, GradientPlan)
                           or plan.loss is not net.loss):
    raise _errors.GraphGradError(
        f"gradient_report: `plan` must be a gg.GradientPlan on the loss "
        f"{net.loss.name}; got {plan!r}. Pass gg.GradientPlan(net.loss, net) "
        f"with your declarations, or None.")
  check_counts(batches, threshold)


def _feeds(feed: Feed, batches: int) -> List[Optional[Mapping]]:
  if feed is None or isinstance(feed, Mapping):
    return [feed] * batches
  if callable(feed):
    return [feed(i) for i in range(batches)]
  if isinstance(feed, (list, tuple)):
    if len(feed) != batches or not all(isinstance(f, Mapping) for f in feed):
      raise _errors.GraphGradError(
          f"gradient_report: a sequence `feed` must hold `batches`="
          f"{batches} feed dicts; got {len(feed)} items. Pass batches="
          f"{len(feed)}, or one dict for every batch.")
    return list(feed)
  raise _errors.GraphGradError(
      f"gradient_report: `feed` must be None, a feed dict, a sequence of "
      f"feed dicts or a callable batch index -> feed dict; got "
      f"{type(feed).__name__}.")


def _float_outputs(layer) -> List[tf.Tensor]:
  return [t for t in layer.outputs
          if t.dtype.is_floating and t.dtype != tf.resource]


def _fetches(net: LayerGraph, plan: Optional[GradientPlan]) -> Dict[str, Any]:
  """Per layer: variables, plain gradients and, with a plan, its gradients."""
  layers = list(net.layers)
  outputs = [_float_outputs(l) for l in layers]
  variables = [v for l in layers for v in l.variables]
  flat_out = [t for ts in outputs for t in ts]
  after_var: Dict[str, Any] = {}
  after_up: Dict[str, Any] = {}
  if plan is not None:
    after_var = {v.op.name: g for g, v in plan.compute_gradients()}
    for ctx, _, after in plan.trace:
      if ctx.role == "upstream" and ctx.tensor is not None:
        after_up[ctx.tensor.name] = after
  with net.loss.graph.as_default(), tf.name_scope("gradient_report"):
    # The plain chain rule: a VJP with no override, ones at the loss.
    grads = GraphVJP().vjp([net.loss], variables + flat_out)
    none = tf.zeros([0], name="no_gradient")
  by_var = dict(zip([v.op.name for v in variables], grads[:len(variables)]))
  by_out = dict(zip([t.name for t in flat_out], grads[len(variables):]))
  out = {}
  for l, ts in zip(layers, outputs):
    entry = {
        "weights": list(l.variables),
        "grads": [_or(by_var[v.op.name], none) for v in l.variables],
        "upstream": [_or(by_out[t.name], none) for t in ts],
    }
    if plan is not None:
      entry["grads_after"] = [_or(after_var.get(v.op.name), none)
                              for v in l.variables]
      ups = [after_up.get(t.name) for t in ts]
      entry["upstream_after"] = ([_or(g, none) for g in ups]
                                 if any(g is not None for g in ups) else [])
    out[l.name] = entry
  return out


def _or(g, none):
  """``sess.run`` refuses ``None``; a zero-size constant stands for it."""
  return none if g is None else g


