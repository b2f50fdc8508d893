"""Layer names: what a name that is not a layer is, and which scope joins.

:meth:`~graphgrad.LayerGraph.lookup` explains a name that is not a layer: its
variables are all non-trainable, or the loss does not depend on them, or it
is a sub-scope of a layer grouped by ``depth=``. :func:`cycle_advice` and
:func:`scope_hint` say which ``layers=`` scope prefix makes several layers
one, leaving every other layer as it is (a ``depth=`` would regroup all).
"""

from typing import List

import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util


def _scoped(variables, name: str) -> List[tf.Variable]:
  return [v for v in variables
          if v.op.name == name or v.op.name.startswith(name + "/")]


def not_a_layer(net, name, arg: str) -> _errors.GraphGradError:
  """The error that says why ``name`` (passed as ``arg``) names no layer.

  Returns:
    A ``GraphGradError`` if ``name`` is not a string; a
    ``NotConnectedError`` if it holds trainable variables that the loss
    does not depend on; else a ``LayerNotFoundError``, saying when the
    scope holds only non-trainable variables or lies inside a layer.
  """
  if not isinstance(name, str):
    return _errors.GraphGradError(
        f"`{arg}` must be a layer name (str); got {type(name).__name__} "
        f"{name!r}. Known layers: {', '.join(net.names)}")
  graph = net.loss.graph
  trainable = [v for v in _scoped(_graph_util.trainable_variables(graph), name)
               if net.layer_of_variable(v) is None]
  if trainable:
    return _errors.NotConnectedError(
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
    return _errors.LayerNotFoundError(
        f"`{arg}` {name!r} holds only non-trainable variables "
        f"({', '.join(v.name for v in frozen[:6])}), which get no gradient, "
        f"so it is not a layer of the plan. Make them trainable "
        f"(trainable=True) to transform them, or transform one of the layers "
        f"with trainable variables: {', '.join(net.names)}")
  holder = [net.layer_of_variable(v) for v in net.variables
            if v.op.name == name.split(":")[0]]
  if holder:
    return _errors.LayerNotFoundError(
        f"`{arg}` {name!r} is a variable of the layer {holder[0]!r}, not a "
        f"layer: a variable with no scope of its own belongs to the layer of "
        f"the op that uses it, named after that op. Declare on "
        f"{holder[0]!r}, or name the layer yourself with "
        f"gg.analyze(loss, layers={{'name': [variables]}}).")
  inside = [l.name for l in net.layers if name.startswith(l.name + "/")]
  if inside:
    return _errors.LayerNotFoundError(
        f"`{arg}` {name!r} lies inside the layer {inside[-1]!r} (its "
        f"variables were grouped, e.g. by depth=). Transform {inside[-1]!r}, "
        f"or analyse with a larger depth= or layers= to make {name!r} a "
        f"layer of its own.")
  return _errors.layer_not_found(name, net.names)


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
  one ``layers=`` entry for their common scope; otherwise the cause is a
  layer reused in series.
  """
  hint = scope_hint(layers_of(net, keys))
  if hint:
    return ("The layers feed each other: one layer's scope holds ops on both "
            "sides of the other, as a conv and the BatchNorm in its sub-scope "
            "do under the default grouping." + hint)
  return ("This happens when a transformed layer's output reaches its own "
          "input (a layer reused in series). Transform a layer that is "
          "applied once, or group the repeated layers into one.")


def scope_hint(names) -> str:
  """A sentence suggesting the ``layers=`` entry that makes ``names`` one
  layer: their common scope prefix, every other layer left as it is.

  Example:
    >>> scope_hint(["bert/embeddings", "bert/embeddings/LayerNorm"])
    " Analyse with net = gg.analyze(loss, layers={'bert/embeddings':
    'bert/embeddings'}) and pass it, gg.GradientPlan(loss, net): that makes
    'bert/embeddings', 'bert/embeddings/LayerNorm' one layer
    'bert/embeddings' and leaves every other layer as it is."
    >>> scope_hint(["a", "b"])
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
  return (f" Analyse with net = gg.analyze(loss, layers={{{group!r}: "
          f"{group!r}}}) and pass it, gg.GradientPlan(loss, net): that makes "
          f"{', '.join(map(repr, names))} one layer {group!r} and leaves "
          f"every other layer as it is.")
