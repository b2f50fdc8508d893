"""Variables into layers: a ``layers=`` mapping, then scopes (or ``depth=``).

Variables with no scope of their own (top-level names: ``Variable``,
``Variable_1``, ``w1``) are grouped by the ops that use them instead
(:func:`group_by_ops`): a parametric op that reads them (``MatMul``,
``Conv2D``, an embedding ``Gather``, ``FusedBatchNorm``...) and the bias add
or scale that directly follows it and reads a variable of its own.
"""

import collections
from typing import Dict, List, Optional, Set, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util
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


# -- layers from the ops that use the variables ------------------------------

# Ops whose parameter inputs make a layer of the variables they read.
PARAMETRIC_TYPES = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "SparseMatMul",
    "Einsum", "Conv2D", "Conv3D", "DepthwiseConv2dNative",
    "Conv2DBackpropInput", "Conv3DBackpropInputV2", "Dilation2D",
    "Gather", "GatherV2", "ResourceGather", "SparseTensorDenseMatMul",
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
# The bias add or scale that directly follows a parametric op.
FOLLOW_TYPES = frozenset({"BiasAdd", "BiasAddV1", "Add", "AddV2", "Mul"})
# Ops between a variable and the op that uses it: reads and reshapes of the
# parameter itself (``tf.nn.conv1d`` expands its filter's dimensions).
_PASS_TYPES = frozenset({"Identity", "RefIdentity", "ReadVariableOp", "Cast",
                         "ExpandDims", "Reshape", "Transpose", "Squeeze"})


def has_own_scope(v: tf.Variable) -> bool:
  """False for a top-level variable: ``Variable_1``, ``get_variable("w1")``."""
  return "/" in v.op.name


def _variable_read(t: tf.Tensor, var_group: Dict[str, str]
                   ) -> Optional[Tuple[str, str, List[tf.Operation]]]:
  """``(group, variable, ops between)`` when ``t`` is a variable's value."""
  between: List[tf.Operation] = []
  op = t.op
  while op.name not in var_group:
    if op.type not in _PASS_TYPES or not op.inputs:
      return None
    between.append(op)
    op = op.inputs[0].op
  return var_group[op.name], op.name, between


class _Union:
  """Union-find over layer names; the first-added name of a set is its key."""

  def __init__(self):
    self.parent: Dict[str, str] = {}

  def find(self, a: str) -> str:
    self.parent.setdefault(a, a)
    while self.parent[a] != a:
      self.parent[a] = self.parent[self.parent[a]]
      a = self.parent[a]
    return a

  def union(self, a: str, b: str) -> None:
    ra, rb = self.find(a), self.find(b)
    if ra != rb:
      self.parent[rb] = ra


def group_by_ops(fwd_ops, groups, scopes, mapped, claimed, consumers):
  """Regroups the variables with no scope of their own by the ops using them.

  A parametric op (:data:`PARAMETRIC_TYPES`) that reads such variables,
  together with the bias add or scale (:data:`FOLLOW_TYPES`) that directly
  consumes its output and reads a variable that no parametric op reads, is
  one layer; variables read by one parametric op, or by the parametric ops
  of one shared layer, are one layer. Its ops are those ops and the reads
  between them and the variables. An automatic layer is named after its
  first parametric op in creation order (``MatMul``, ``MatMul_1``); a layer
  of the ``layers=`` mapping keeps its name and its variables. Variables no
  parametric op reads stay layers of their own.

  Args:
    fwd_ops: the forward ops.
    groups: layer name -> variables, from :func:`group_variables`.
    scopes: layer name -> name scopes, from :func:`group_variables`.
    mapped: the layer names the ``layers=`` mapping gave.
    claimed: returns op name -> layer, by scope and reads (``_assign_ops``);
      called only when some variable has no scope of its own.
    consumers: tensor name -> consuming forward ops.

  Returns:
    ``(groups, scopes, members)``: the regrouped mappings, and op name ->
    layer for the parametric and following ops.
  """
  eligible = {name for name, vs in groups.items()
              if vs and not any(has_own_scope(v) for v in vs)}
  if not eligible:
    return groups, scopes, {}
  var_group = {v.op.name: name for name in eligible for v in groups[name]}
  owners_by_scope = claimed()
  free = lambda op: owners_by_scope.get(op.name) in (None, *eligible)  # noqa: E731
  parametric = []
  weights: Set[str] = set()
  for op in sorted(fwd_ops, key=_graph_util.op_id):
    if op.type not in PARAMETRIC_TYPES or not free(op):
      continue
    reads = [r for r in (_variable_read(t, var_group) for t in op.inputs)
             if r is not None]
    if reads:
      parametric.append((op, reads))
      weights.update(v for _, v, _ in reads)
  union = _Union()
  ops_of: Dict[str, List[tf.Operation]] = collections.defaultdict(list)
  owners = []
  for op, reads in parametric:
    owner = _owner([g for g, _, _ in reads], mapped, union)
    owners.append((op, owner))
    ops_of[owner].append(op)
    ops_of[owner].extend(o for g, _, between in reads
                         if union.find(g) == union.find(owner)
                         for o in between)
    for follow, between, group in _follows(op, var_group, weights, consumers,
                                           free):
      if group in mapped and group != owner:
        break
      if group not in mapped and owner in mapped:
        break
      union.union(owner, group)
      ops_of[owner].append(follow)
      ops_of[owner].extend(between)
  return _regrouped(groups, scopes, mapped, union, ops_of, owners)


def _owner(read_groups, mapped, union) -> str:
  """The layer a parametric op joins: its mapped layer, else their union."""
  for g in read_groups:
    if g in mapped:
      return g
  for g in read_groups[1:]:
    union.union(read_groups[0], g)
  return read_groups[0]


def _follows(op, var_group, weights, consumers, free):
  """The chain of bias adds or scales that follows ``op``, with their reads."""
  out = op.outputs[0]
  found = []
  while True:
    nxt = None
    for c in consumers.get(out.name, ()):
      if c.type not in FOLLOW_TYPES or not free(c):
        continue
      others = [t for t in c.inputs if t.name != out.name]
      reads = [_variable_read(t, var_group) for t in others]
      if len(others) == 1 and reads[0] is not None \
          and reads[0][1] not in weights:
        nxt = (c, reads[0][2], reads[0][0])
        break
    if nxt is None:
      return found
    found.append(nxt)
    out = nxt[0].outputs[0]


def _regrouped(groups, scopes, mapped, union, ops_of, owners):
  """The groups with each union under one name, and op -> layer members."""
  first: Dict[str, tf.Operation] = {}
  for op, owner in owners:  # in creation order
    first.setdefault(union.find(owner), op)
  merged: Dict[str, List[str]] = collections.defaultdict(list)
  for name in groups:
    if name in union.parent:
      merged[union.find(name)].append(name)
  new_name: Dict[str, str] = {}
  taken = {n for n in groups if n not in union.parent} | set(mapped)
  for root in sorted(merged, key=lambda r: _graph_util.op_id(first[r])
                     if r in first else -1):
    if root in mapped or root not in first:
      new_name[root] = root
      taken.add(root)
      continue
    name = base = first[root].name
    k = 1
    while name in taken:
      name, k = f"{base}_layer{'' if k == 1 else k}", k + 1
    new_name[root] = name
    taken.add(name)
  out_groups: Dict[str, List[tf.Variable]] = {}
  out_scopes: Dict[str, set] = collections.defaultdict(set)
  for name, vs in groups.items():
    target = new_name[union.find(name)] if name in union.parent else name
    out_groups.setdefault(target, []).extend(vs)
    out_scopes[target].update(scopes.get(name, ()))
  members: Dict[str, str] = {}
  for owner, ops in ops_of.items():
    for op in ops:
      members.setdefault(op.name, new_name[union.find(owner)])
  return out_groups, out_scopes, members
