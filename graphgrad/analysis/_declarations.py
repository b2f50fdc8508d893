"""What a plan may declare on a layer: name lookup and no-op declarations.

Plans (``GradientPlan``, and ``KerasPlan`` where it applies) call these
through :class:`~graphgrad.LayerGraph`'s ``lookup`` and
``check_declaration``, so that every plan says the same thing about the same
graph:

* a name that is not a layer is explained: its variables are all
  non-trainable, or the loss does not depend on them, or it is a sub-scope of
  a layer grouped by ``depth=``;
* a layer applied inside a v2 ``tf.cond`` or ``tf.while_loop`` together with
  another layer has its boundary inside the cond's or loop's ``FuncGraph``:
  the error names that op and what to declare instead;
* a declaration through which no gradient can reach anything below is
  reported once through the ``graphgrad`` logger (see
  :func:`check_declaration` for why it warns rather than raises).
"""

import logging
from typing import Any, Callable, Dict, List, Optional

import networkx as nx
import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _control_flow, _graph_util

log = logging.getLogger("graphgrad")


def _scoped(variables, name: str) -> List[tf.Variable]:
  return [v for v in variables
          if v.op.name == name or v.op.name.startswith(name + "/")]


def lookup(net, name, arg: str) -> str:
  """The layer called ``name``, or an error that says why there is none.

  Raises:
    GraphGradError: if ``name`` is not a string.
    NotConnectedError: if ``name`` holds trainable variables that the loss
      does not depend on.
    LayerNotFoundError: otherwise, saying when the scope holds only
      non-trainable variables or lies inside a layer.
  """
  if not isinstance(name, str):
    raise _errors.GraphGradError(
        f"`{arg}` must be a layer name (str); got {type(name).__name__} "
        f"{name!r}. Known layers: {', '.join(net.names)}")
  if name in net:
    return name
  graph = net.loss.graph
  trainable = [v for v in _scoped(_graph_util.trainable_variables(graph), name)
               if net.layer_of_variable(v) is None]
  if trainable:
    raise _errors.NotConnectedError(
        f"`{arg}` {name!r} names variables "
        f"({', '.join(v.name for v in trainable)}) that the loss "
        f"{net.loss.name} does not depend on, so the layer does not reach the "
        f"loss and has no gradient to transform. Transform a layer the loss "
        f"depends on: {', '.join(net.names)}")
  trainable_names = {v.op.name for v in _graph_util.trainable_variables(graph)}
  frozen = [v for v in _scoped(graph.get_collection(
      tf.compat.v1.GraphKeys.GLOBAL_VARIABLES), name)
            if v.op.name not in trainable_names]
  if frozen and not _scoped(net.variables, name):
    raise _errors.LayerNotFoundError(
        f"`{arg}` {name!r} holds only non-trainable variables "
        f"({', '.join(v.name for v in frozen[:6])}), which get no gradient, "
        f"so it is not a layer of the plan. Make them trainable "
        f"(trainable=True) to transform them, or transform one of the layers "
        f"with trainable variables: {', '.join(net.names)}")
  holder = [net.layer_of_variable(v) for v in net.variables
            if v.op.name == name.split(":")[0]]
  if holder:
    raise _errors.LayerNotFoundError(
        f"`{arg}` {name!r} is a variable of the layer {holder[0]!r}, not a "
        f"layer: a variable with no scope of its own belongs to the layer of "
        f"the op that uses it, named after that op. Declare on "
        f"{holder[0]!r}, or name the layer yourself with "
        f"gg.analyze(loss, layers={{'name': [variables]}}).")
  inside = [l.name for l in net.layers if name.startswith(l.name + "/")]
  if inside:
    raise _errors.LayerNotFoundError(
        f"`{arg}` {name!r} lies inside the layer {inside[-1]!r} (its "
        f"variables were grouped, e.g. by depth=). Transform {inside[-1]!r}, "
        f"or analyse with a larger depth= or layers= to make {name!r} a "
        f"layer of its own.")
  raise _errors.layer_not_found(name, net.names)


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
  stack = [c for t in layer.inputs if _graph_util.is_float(t)
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
  if method not in ("transform_upstream", "replace_backward"):
    return None  # combine_tasks: the layer's own parameters see the result
  layer = net[name]
  below = any(p != name for p in net.graph.predecessors(name))
  if not layer.inputs:
    return ("it has no input: it holds only its variables' reads (its "
            "computation is glue), so no gradient passes through it")
  if method == "replace_backward":
    if below and not any(_graph_util.is_float(t) for t in layer.inputs):
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
  if reason is not None and key not in net.warned:
    net.warned.add(key)
    log.warning("%s(%r) changes nothing below the layer: %s. Group the "
                "computation into the layer (gg.analyze(loss, layers=...) or "
                "depth=...), or declare it on a layer whose outputs depend "
                "on its inputs.", method, name, reason)


def layers_of(net, keys) -> List[str]:
  """Layer names of ``(kind, name)`` keys; an ``"op"`` key by its op's layer."""
  found = []
  for kind, name in keys:
    kind = getattr(kind, "value", kind)  # the engine's Kind enum, or a str
    if kind == "op" and name in net.op_graph:
      name = net.op_graph.nodes[name]["layer"]
    if isinstance(name, str) and name in net:
      found.append(name)
  return found


def cycle_advice(net, keys) -> str:
  """What to do about transformed layers that feed back into themselves.

  Two layers in one scope that feed each other (tf-slim's conv and the
  BatchNorm in its sub-scope, under the default grouping) are resolved by
  ``depth=``; otherwise the cause is a layer reused in series.
  """
  hint = depth_hint(layers_of(net, keys))
  if hint:
    return ("The layers feed each other: one layer's scope holds ops on both "
            "sides of the other, as a conv and the BatchNorm in its sub-scope "
            "do under the default grouping." + hint)
  return ("This happens when a transformed layer's output reaches its own "
          "input (a layer reused in series). Transform a layer that is "
          "applied once, or group the repeated layers into one.")


def depth_hint(names) -> str:
  """A sentence suggesting ``depth=`` when it would make ``names`` one layer.

  Example:
    >>> depth_hint(["net/block1/conv1", "net/block1/conv1/BatchNorm"])
    " Analysing with gg.analyze(loss, depth=3) makes 'net/block1/conv1' one
    layer of 'net/block1/conv1', 'net/block1/conv1/BatchNorm'."
    >>> depth_hint(["a", "b"])
    ''
  """
  names = sorted(set(names))
  if len(names) < 2:
    return ""
  parts = [n.split("/") for n in names]
  common = 0
  while all(len(p) > common for p in parts) and len(
      {p[common] for p in parts}) == 1:
    common += 1
  if not common:
    return ""
  group = "/".join(parts[0][:common])
  return (f" Analysing with gg.analyze(loss, depth={common}) makes {group!r} "
          f"one layer of {', '.join(map(repr, names))}.")
