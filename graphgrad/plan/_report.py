"""The gradient-flow report: where do a graph's gradients vanish or explode?

:func:`gradient_report` runs the backward pass of an analysed loss in a
``Session`` and measures, for every layer in topological order, ``grad_norm``
(the global norm of its parameter gradients), ``grad_to_weight`` (that norm
over its variables' norm), ``upstream_norm`` (the norm of the upstream
gradient at its outputs) and ``zero_upstream`` (the fraction of exact zeros
in it). With a :class:`~graphgrad.GradientPlan` each figure comes twice:
``before`` by the chain rule, ``after`` (where it exists) from the plan.

A layer is *vanishing* (*exploding*) when ``log10`` of its parameter-gradient
norm lies more than ``threshold`` (default 2) below (above) the median
``log10`` of its neighbours' non-zero norms, ``after`` norms with a plan
(never without neighbours); *no gradient* when none of its variables gets
one (``tf.round`` lies between it and the loss).
"""

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.plan._backprop import GraphVJP
from graphgrad.plan._gradient_plan import GradientPlan

Feed = Union[None, Mapping, Sequence[Mapping], Callable[[int], Mapping]]
# Ops whose gradient (while_v2, cond_v2, a tf.function's) may add outputs
# to the forward op.
_FUNCTIONAL = frozenset({"While", "StatelessWhile", "If", "StatelessIf",
                         "Case", "StatelessCase", "PartitionedCall",
                         "StatefulPartitionedCall"})
_CONTROL_FLOW = frozenset({"While", "StatelessWhile", "If", "StatelessIf",
                           "Case", "StatelessCase"})
_FIGURES = ("grad_norm", "grad_to_weight", "upstream_norm", "zero_upstream")


class GradientReport:
  """Per-layer gradient figures of one loss; made by :func:`gradient_report`.

  Attributes:
    loss: name of the loss tensor.
    batches: how many batches the figures are averaged over.
    threshold: the flag threshold, in orders of magnitude.
    has_plan: whether the figures have ``after`` values.
    layers: one dict per layer, in topological order, with keys ``name``,
      ``params``, ``flag`` (``"vanishing"``, ``"exploding"``,
      ``"no gradient"`` or ``None``)
      and, for each figure, ``{"before": x, "after": y}`` (``after`` is
      ``None`` without a plan or where the plan does not materialise it).
  """

  def __init__(self, loss: str, layers: List[Dict[str, Any]], batches: int,
               threshold: float, has_plan: bool):
    self.loss = loss
    self.layers = layers
    self.batches = batches
    self.threshold = threshold
    self.has_plan = has_plan

  def __getitem__(self, name: str) -> Dict[str, Any]:
    for row in self.layers:
      if row["name"] == name:
        return row
    raise _errors.layer_not_found(name, [r["name"] for r in self.layers])

  def flagged(self) -> Dict[str, str]:
    """Layer name -> ``"vanishing"``, ``"exploding"`` or ``"no gradient"``,
    for flagged layers."""
    return {r["name"]: r["flag"] for r in self.layers if r["flag"]}

  def to_dict(self) -> Dict[str, Any]:
    """A JSON-serialisable dict of everything in the report."""
    return {"loss": self.loss, "batches": self.batches,
            "threshold": self.threshold, "has_plan": self.has_plan,
            "layers": [dict(r) for r in self.layers]}

  def table(self) -> str:
    """A text table, one row per layer; ``before -> after`` with a plan."""
    head = ("layer", "params", "grad norm", "grad/weight", "upstream norm",
            "zero upstream", "flag")
    rows = [head]
    for r in self.layers:
      rows.append((r["name"], f"{r['params']:,}",
                   self._cell(r["grad_norm"]), self._cell(r["grad_to_weight"]),
                   self._cell(r["upstream_norm"]),
                   self._cell(r["zero_upstream"], percent=True),
                   r["flag"] or ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"loss {self.loss}; mean over {self.batches} batch(es); "
                 f"flagged when log10(grad norm) is more than "
                 f"{self.threshold:g} from the median log10 of its "
                 f"neighbours', 'no gradient' when none of its variables "
                 f"gets one")
    return "\n".join(lines)

  def _cell(self, pair: Dict[str, Optional[float]], percent=False) -> str:
    fmt = (lambda x: "-" if x is None else f"{100 * x:.1f}%") if percent else (
        lambda x: "-" if x is None else f"{x:.3g}")
    if not self.has_plan:
      return fmt(pair["before"])
    return f"{fmt(pair['before'])} -> {fmt(pair['after'])}"

  def plot(self, path: str, title: Optional[str] = None) -> str:
    """Draws the figures of every layer, in topological order, on a log scale.

    Args:
      path: the picture's file name (``.png``, ``.svg`` or ``.pdf``).
      title: the picture's title; defaults to the loss name.

    Returns:
      ``path``.

    Raises:
      GraphGradError: for another file extension, or without matplotlib.
    """
    from graphgrad.plan import _report_plot  # pylint: disable=g-import-not-at-top
    return _report_plot.plot(self, path, title)

  def __repr__(self) -> str:
    return (f"GradientReport(loss={self.loss}, layers={len(self.layers)}, "
            f"flagged={self.flagged()})")


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
  proto = calls[0].graph.as_graph_def().library
  library = {f.signature.name: f for f in proto.function}
  for op in calls:
    todo, seen = [op.get_attr("f").name], set()
    while todo:
      name = todo.pop()
      if name in seen or name not in library:
        continue
      seen.add(name)
      for node in library[name].node_def:
        if node.op in _CONTROL_FLOW:
          raise _errors.UnsupportedGraphError(
              f"gradient_report: the loss calls function "
              f"{op.get_attr('f').name!r} of an imported graph, which has "
              f"no Python gradient, so tf.gradients differentiates the call "
              f"with TensorFlow's SymbolicGradient; that cannot take the "
              f"{node.op} {node.name!r} in function {name!r} (it gives "
              f"zeros or fails). Save the model with the loop or cond "
              f"outside the tf.function (control flow v2 in the graph "
              f"itself), or report on the graph that defined the function.")
        todo.append(node.op)
        todo += [a.func.name for a in node.attr.values() if a.func.name]
        todo += [f.name for a in node.attr.values() for f in a.list.func]


def measure(sess: tf.compat.v1.Session, net: LayerGraph,
            fetches: Dict[str, Any], feeds: Sequence[Optional[Mapping]],
            threshold: float = 2.0, has_plan: bool = False
            ) -> GradientReport:
  """Runs ``fetches`` (from :func:`build`) once per feed; the report."""
  runs = [sess.run(fetches, feed_dict=f) for f in feeds]
  layers = [_layer_row(net, name, [r[name] for r in runs])
            for name in net.names]
  _flag(net, layers, threshold)
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
        f"loss's tf.Graph; got {type(sess).__name__}. Pass "
        f"tf.compat.v1.Session(graph=net.loss.graph).")
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
  if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
    raise _errors.GraphGradError(
        f"gradient_report: `batches` must be a positive int; got "
        f"{batches!r}.")
  if (not isinstance(threshold, (int, float)) or isinstance(threshold, bool)
      or not threshold > 0 or math.isinf(threshold)):
    raise _errors.GraphGradError(
        f"gradient_report: `threshold` must be a positive finite number of "
        f"orders of magnitude; got {threshold!r}. The default is 2.0.")


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
    grads = GraphVJP().vjp([net.loss], None, variables + flat_out)
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


def _dense_values(value) -> np.ndarray:
  """The entries of a fetched gradient, duplicates of sparse rows summed."""
  if hasattr(value, "indices") and hasattr(value, "values"):
    idx, inverse = np.unique(np.asarray(value.indices), return_inverse=True)
    vals = np.asarray(value.values)
    summed = np.zeros((len(idx),) + vals.shape[1:], vals.dtype)
    np.add.at(summed, inverse.reshape(-1), vals)
    return summed
  return np.asarray(value)


def _norm(values: Sequence) -> Optional[float]:
  arrays = [_dense_values(v) for v in values]
  arrays = [a for a in arrays if a.size]
  if not arrays:
    return None
  return float(math.sqrt(sum(float(np.sum(np.square(a.astype(np.float64))))
                             for a in arrays)))


def _zero_fraction(values: Sequence) -> Optional[float]:
  arrays = [np.asarray(v) for v in values]
  arrays = [a for a in arrays if a.size]
  if not arrays:
    return None
  total = sum(a.size for a in arrays)
  return float(sum(int(np.sum(a == 0)) for a in arrays) / total)


def _mean(xs: Sequence[Optional[float]]) -> Optional[float]:
  present = [x for x in xs if x is not None]
  return float(np.mean(present)) if present else None


def _figures(run: Dict[str, Any], suffix: str) -> Dict[str, Optional[float]]:
  grad = _norm(run["grads" + suffix])
  weight = _norm(run["weights"])
  ups = run["upstream" + suffix]
  return {
      "grad_norm": grad,
      "grad_to_weight": (grad / weight if grad is not None and weight
                         else None),
      "upstream_norm": _norm(ups),
      "zero_upstream": _zero_fraction(ups),
  }


def _layer_row(net: LayerGraph, name: str, runs: List[Dict[str, Any]]):
  before = [_figures(r, "") for r in runs]
  after = ([_figures(r, "_after") for r in runs] if "grads_after" in runs[0]
           else None)
  row: Dict[str, Any] = {"name": name, "params": net[name].num_params}
  for key in _FIGURES:
    row[key] = {"before": _mean([f[key] for f in before]),
                "after": _mean([f[key] for f in after]) if after else None}
  row["flag"] = None
  return row


def _flag(net: LayerGraph, rows: List[Dict[str, Any]], threshold) -> None:
  """Sets ``row["flag"]`` by the rule in the module docstring."""
  key = "after" if any(r["grad_norm"]["after"] is not None for r in rows) else (
      "before")
  norm = {r["name"]: r["grad_norm"][key] for r in rows}
  for r in rows:
    name = r["name"]
    neighbours = set(net.graph.predecessors(name)) | set(
        net.graph.successors(name))
    others = [norm[n] for n in neighbours if norm.get(n)]
    mine = norm[name]
    if mine is None:  # not one variable of the layer has a gradient
      r["flag"] = "no gradient"
      continue
    if not others:
      continue
    if mine == 0:
      r["flag"] = "vanishing"
      continue
    log_ratio = math.log10(mine) - float(np.median(np.log10(others)))
    if log_ratio < -threshold:
      r["flag"] = "vanishing"
    elif log_ratio > threshold:
      r["flag"] = "exploding"
