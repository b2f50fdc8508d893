"""Variables into layers: a ``layers=`` mapping, then scopes (or ``depth=``)."""

import collections
from typing import Dict, List

import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis._layer_graph import scope_of


def group_variables(connected, trainable, layers, depth):
  """Maps layer name -> variables, and layer name -> set of name scopes.

  Args:
    connected: the trainable variables the loss depends on.
    trainable: every trainable variable of the graph, in creation order.
    layers: ``gg.analyze``'s ``layers=`` mapping, or None.
    depth: ``gg.analyze``'s ``depth=``, or None.

  Raises:
    GraphGradError: for a malformed mapping, or one that splits a scope.
  """
  groups: Dict[str, List[tf.Variable]] = {}
  scopes: Dict[str, set] = collections.defaultdict(set)
  owner: Dict[str, str] = {}
  if layers is not None:
    _check_mapping(layers)
    for lname, spec in layers.items():
      members = _mapped(lname, spec, connected, trainable, scopes)
      for v in members:
        if v.op.name in owner and owner[v.op.name] != lname:
          raise _errors.GraphGradError(
              f"`layers` puts {v.name} in both {owner[v.op.name]!r} and "
              f"{lname!r}; a variable belongs to one layer. Narrow one of the "
              f"prefixes or lists.")
        owner[v.op.name] = lname
      groups[lname] = members
  for v in connected:
    if v.op.name in owner:
      continue
    scope = scope_of(v.op.name)
    if depth is not None:
      scope = "/".join(scope.split("/")[:depth])
    if scope in groups and scope not in scopes.get(scope, ()) and layers:
      raise _errors.GraphGradError(
          f"variable {v.name} is not covered by `layers`, and its automatic "
          f"layer name {scope!r} is already a mapped layer. Add it to the "
          f"mapping explicitly.")
    groups.setdefault(scope, []).append(v)
    owner[v.op.name] = scope
    scopes[scope].add(scope)
  _check_scopes(scopes)
  # keep graph order of variables within each layer
  order = {v.op.name: i for i, v in enumerate(trainable)}
  groups = {k: sorted(vs, key=lambda v: order[v.op.name])
            for k, vs in groups.items()}
  return groups, scopes


def _check_mapping(layers) -> None:
  if not hasattr(layers, "items"):
    raise _errors.GraphGradError(
        f"`layers` must map layer names to a scope prefix or a list of "
        f"variables; got {type(layers).__name__}. Example: "
        f"layers={{'encoder': 'model/enc', 'head': [w, b]}}.")
  if not layers:
    raise _errors.GraphGradError(
        "`layers` is an empty mapping. Pass None to discover layers from "
        "variable scopes, or map at least one layer name to a scope prefix "
        "or a list of variables.")


def _mapped(lname, spec, connected, trainable, scopes) -> List[tf.Variable]:
  """The variables of one ``layers=`` entry; records its scopes."""
  if not isinstance(lname, str) or not lname:
    raise _errors.GraphGradError(
        f"`layers` keys must be non-empty layer names (str); got "
        f"{lname!r}.")
  if isinstance(spec, str):
    prefix = spec.rstrip("/")
    members = [v for v in connected
               if v.op.name == prefix or v.op.name.startswith(prefix + "/")]
    if not members:
      raise _errors.GraphGradError(
          f"`layers[{lname!r}]` is the scope prefix {spec!r}, but no "
          f"trainable variable that the loss depends on lies under it. "
          f"Variables the loss depends on: "
          f"{', '.join(v.name for v in connected)}")
    scopes[lname].add(prefix)
    return members
  try:
    members = list(spec)
  except TypeError:
    raise _errors.GraphGradError(
        f"`layers[{lname!r}]` must be a scope prefix (str) or a list of "
        f"variables; got {type(spec).__name__}.") from None
  if not members:
    raise _errors.GraphGradError(
        f"`layers[{lname!r}]` is an empty list of variables. Give it "
        f"at least one variable, or leave the layer out.")
  by_name = {v.op.name for v in trainable}
  connected_names = {v.op.name for v in connected}
  for v in members:
    if not isinstance(v, tf.Variable) or v.op.name not in by_name:
      raise _errors.GraphGradError(
          f"`layers[{lname!r}]` holds {v!r}, which is not a trainable "
          f"variable of the loss's graph. List tf.Variable objects from "
          f"tf.compat.v1.trainable_variables().")
    if v.op.name not in connected_names:
      raise _errors.NotConnectedError(
          f"`layers[{lname!r}]` holds {v.name}, which the loss does not "
          f"depend on, so the layer would not reach the loss. Leave it "
          f"out of the mapping.")
  scopes[lname].update(scope_of(v.op.name) for v in members)
  return members


def _check_scopes(scopes) -> None:
  seen: Dict[str, str] = {}
  for lname, ss in scopes.items():
    for s in ss:
      if s in seen and seen[s] != lname:
        raise _errors.GraphGradError(
            f"`layers` splits the name scope {s!r} between layers "
            f"{seen[s]!r} and {lname!r}, so its ops cannot be attributed to "
            f"one layer. Keep all variables of one scope in one layer.")
      seen[s] = lname
