"""Whether a declaration on a layer can act: refused, warned about, or kept.

GradientPlan checks every declaration on a layer here before it records it,
so that every plan says the same thing about the same layer graph:

* a layer applied inside a v2 ``tf.cond`` or ``tf.while_loop`` together with
  another layer has its boundary inside the cond's or loop's ``FuncGraph``:
  the error names that op and what to declare instead;
* a declaration through which no gradient can reach anything below is
  reported once through the ``graphgrad`` logger (see
  :func:`check_declaration` for why it warns rather than raises), and so is
  ``transform_upstream`` on a layer with no layer below it;
* once built, variables the loss depends on that get no gradient (an op
  without one, ``tf.round``, lies between them and the loss) are reported
  once, with the op and the declaration that passes a gradient through it.
"""

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional

import networkx as nx
import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _control_flow, _graph_util, _no_gradient
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.core._inert import bottom_layer_advice
from graphgrad.core._logged_advice import log_without_gradient

log = logging.getLogger("graphgrad")

# The (method, layer) pairs already warned about, per layer graph: one
# warning per layer graph, however many plans declare on it.
_WARNED: "weakref.WeakKeyDictionary[LayerGraph, set]" = (
    weakref.WeakKeyDictionary())


def v2_frame(net, name: str) -> Optional[tf.Operation]:
  """The v2 cond or loop op that applies ``name`` with another layer."""
  known = net.op_graph
  consumers_of = lambda t: [c for c in t.consumers() if c.name in known]  # noqa: E731
  for op in net[name].ops:
    if _graph_util.is_variable_op(op):
      for t in op.outputs:
        found = _control_flow.frame_of_handle(t, consumers_of)
        if found is not None and net.layer_of(found) != name:
          return found
  return None


def _frame_layers(net, op: tf.Operation) -> List[str]:
  var_layer = {v.op.name: l.name for l in net.layers for v in l.variables}
  found = {_control_flow.read_layer(t, var_layer) for t in op.inputs}
  return sorted(l for l in found if l is not None)


# Ops whose outputs carry no gradient back to their inputs.
_NO_GRADIENT = frozenset({"StopGradient", "Shape", "ShapeN", "Size", "Rank",
                          "ZerosLike", "OnesLike", "PreventGradient"})


def _path_through(net, name: str) -> bool:
  """True when an output of the layer depends differentiably on an input."""
  layer = net[name]
  members = {op.name for op in layer.ops}
  produced = {t.op.name for t in layer.outputs}
  stack = [c for t in layer.inputs if _graph_util.differentiable(t)
           for c in net.op_graph.successors(t.op.name) if c in members]
  # tf.compat.v1 loops: NextIteration -> Merge, outside op_graph
  back: Dict[str, List[str]] = {}
  for a, b in net.loop_edges:
    back.setdefault(a, []).append(b)
  seen = set()
  while stack:
    op = stack.pop()
    if op in seen or net.op_graph.nodes[op]["op"].type in _NO_GRADIENT:
      continue
    seen.add(op)
    if op in produced:
      return True
    stack.extend(s for s in list(net.op_graph.successors(op)) + back.get(op, [])
                 if s in members)
  return False


def no_gradient_reason(net, method: str, name: str,
                       upper: Optional[str] = None) -> Optional[str]:
  """Why ``method`` on ``name`` can change nothing below it, or None.

  ``None`` for the bottom layer (it has inputs, but no layer feeds them):
  nothing lies below, and declaring there is legal. An edge's gradient
  reaches the lower layer's own variables whenever its boundary tensors
  depend on them.
  """
  if method == "transform_edge":
    ops = {t.op.name for t in net.boundary(name, upper)}
    behind = set().union(ops, *(nx.ancestors(net.op_graph, o) for o in ops))
    if any(_graph_util.is_variable_op(net.op_graph.nodes[o]["op"])
           for o in behind):
      return None
    return "its boundary tensors depend on no trainable variable"
  if method not in ("transform_upstream", "transform_inputs",
                    "replace_backward"):
    return None  # combine_tasks: the layer's own parameters see the result
  layer = net[name]
  below = any(p != name for p in net.graph.predecessors(name))
  if not layer.inputs:
    return ("it has no input: it holds only its variables' reads (its "
            "computation is glue), so no gradient passes through it")
  if method == "replace_backward":
    if below and not any(_graph_util.differentiable(t) for t in layer.inputs):
      return "it has no floating-point input to send a gradient to"
    return None
  if not below or _path_through(net, name):
    return None
  return ("none of its outputs depends differentiably on its inputs, so no "
          "gradient passes through it")


def check_declaration(net, method: str, name: str,
                      upper: Optional[str] = None,
                      then: Optional[Callable[[], Any]] = None) -> None:
  """Refuses or reports a declaration that cannot act below the layer.

  A layer applied inside a v2 cond or loop together with other layers has its
  boundary in the op's ``FuncGraph``, where no cut can be made; that raises
  ``UnsupportedGraphError`` naming the op.

  A declaration through which no gradient can reach any layer below (the
  layer has no path from its inputs to its outputs, or its computation is all
  glue) *warns once* through the ``graphgrad`` logger and is kept. It is not
  wrong: the plan's gradients are exactly the plain ones below the layer, and
  code that declares one transform on every layer (``for name in net.names``)
  must keep working; but it does nothing, and a silent no-op is what the
  warning rules out. The bottom layer, where nothing lies below, is quiet.
  A task combination is never a no-op (the layer's own parameters see the
  combined gradient), so only the cond and loop check applies to it.

  ``then`` is the plan's own check of the declaration, run after the cond
  and loop check and before the warning, so a refused declaration does not
  warn.

  Raises:
    UnsupportedGraphError: for a layer inside a v2 cond or loop.
  """
  frame = v2_frame(net, name)
  if frame is not None and method != "transform_gradients":
    kind = "tf.cond" if "If" in frame.type or "Case" in frame.type \
        else "tf.while_loop"
    others = [l for l in _frame_layers(net, frame) if l != name]
    raise _errors.UnsupportedGraphError(
        f"{method}: layer {name!r} is applied inside the {kind} op "
        f"{frame.name!r} ({frame.type})"
        + (f" together with {', '.join(map(repr, others))}" if others else "")
        + f", so its boundary lies in {frame.name!r}'s function body, where "
        f"the gradient cannot be cut. Declare it on a layer outside "
        f"{frame.name!r}, or make the whole {kind} one layer: "
        f"gg.analyze(loss, layers={{'{frame.name}': <the variables of "
        f"{', '.join(map(repr, [name] + others))}>}}).")
  if then is not None:
    then()
  reason = no_gradient_reason(net, method, name, upper)
  key = (method, name)
  warned = _WARNED.setdefault(net, set())
  if (method in ("transform_upstream", "transform_inputs") and reason is None
      and key not in warned and not nx.ancestors(net.graph, name)):
    warned.add(key)
    log.warning("%s", bottom_layer_advice(
        name, sorted(net.graph.successors(name)), method))
  if reason is not None and key not in warned:
    warned.add(key)
    log.warning("%s(%r) changes nothing below the layer: %s. Group the "
                "computation into the layer (gg.analyze(loss, layers=...) or "
                "depth=...), or declare it on a layer whose outputs depend "
                "on its inputs.", method, name, reason)


def warn_without_gradient(net: LayerGraph, grads_and_vars) -> bool:
  """Logs once when variables the loss depends on get no gradient.

  A ``tf.round`` (or ``Floor``, ``Ceil``, ``Sign``) between two layers has
  no gradient: ``tf.gradients`` gives the variables below it ``None``, and
  ``apply_gradients`` would skip them without a word. The warning names the
  layers, the ops and the declarations that pass a gradient through them.

  Returns:
    True when a warning was logged.
  """
  missing = [v for g, v in grads_and_vars
             if g is None and net.layer_of_variable(v) is not None]
  if not missing:
    return False
  layers = list(dict.fromkeys(str(net.layer_of_variable(v))
                              for v in missing))
  ops = _no_gradient.ops_with_zero_gradient(net.loss, missing)
  log_without_gradient(layers, net.loss.name,
                       [v.op.name for v in missing], ops)
  return True


def check_float_output(net: LayerGraph, name: str,
                       method: str = "transform_upstream") -> None:
  """Refuses ``method`` (``transform_upstream``, ``transform_inputs``) on a
  layer with no float output.

  Raises:
    GraphGradError: if no output of the layer is differentiable.
  """
  if not any(_graph_util.differentiable(t) for t in net[name].outputs):
    what = ("no upstream gradient to rewrite" if method == "transform_upstream"
            else "no gradient it sends to its inputs")
    raise _errors.GraphGradError(
        f"{method}: layer {name!r} has no floating-point output on the way "
        f"to the loss, so there is {what}. Use "
        f"transform_gradients({name!r}, fn) for its parameter gradients.")

