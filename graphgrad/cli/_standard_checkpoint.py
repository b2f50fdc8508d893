"""The standard checkpoint save and restore of a MetaGraph, by structure.

``graphgrad scan`` does not report the I/O ops of a checkpoint save or
restore whose every op and wire is one that TensorFlow's ``Saver`` or
``tf.saved_model.save`` writes (:func:`checkpoint_part` states the rule):
loading a model runs its restore, so an op added to it makes it
non-standard, and then every I/O op in it is reported. Also the small
readers of ``NodeDef`` inputs that the scan shares.
"""

from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple

_VARIABLE_TYPES = frozenset({"VarHandleOp", "VariableV2", "Variable"})
_FILENAME_TYPES = frozenset({"Placeholder", "PlaceholderWithDefault", "Const"})
# The op types of a standard checkpoint restore and save: those Saver and
# tf.saved_model.save write (TensorFlow 2.x's functional saver and v1's).
RESTORE_TYPES = frozenset({"Const", "Identity", "NoOp", "RestoreV2", "Assign",
                           "AssignVariableOp"})
SAVE_TYPES = frozenset({"Const", "Identity", "NoOp", "SaveV2",
                        "MergeV2Checkpoints", "ShardedFilename", "StringJoin",
                        "StaticRegexFullMatch", "Select", "Pack",
                        "ReadVariableOp", "DisableCopyOnRead"})


def node_name(text: str) -> str:
  """The node an input names: ``^a`` -> ``a``, ``a:1`` -> ``a``,
  ``a:output:0`` (in a function) -> ``a``."""
  return text.lstrip("^").split(":", 1)[0]


def data_inputs(node) -> List[str]:
  return [i for i in node.input if not i.startswith("^")]


def calls(node, library) -> List[Tuple[Optional[str], str]]:
  """The functions ``node`` calls: ``(attr, function)``, attr ``None`` for
  a call by op type."""
  from graphgrad.analysis._graph_util import function_names  # pylint: disable=g-import-not-at-top
  found: List[Tuple[Optional[str], str]] = (
      [(None, node.op)] if node.op in library else [])
  for key in sorted(node.attr):
    found += [(key, n) for n in function_names([node.attr[key]])]
  return found


class CheckpointPart(NamedTuple):
  """A MetaGraph's checkpoint restore or save, and whether it is standard.

  Attributes:
    which: ``"restore"`` or ``"save"``.
    root: the op ``saver_def`` names, ``""`` if none.
    function: the function it calls (TF2's ``__inference__traced_*``), or
      ``None``.
    standard: whether :func:`checkpoint_part`'s rule holds.
    reason: why not, ``""`` if it is.
    nodes: the graph's ops that belong to it (v1), for the findings to
      leave out when it is standard.
    reads: the checkpoint the restore reads.
  """
  which: str
  root: str
  function: Optional[str]
  standard: bool
  reason: str
  nodes: frozenset
  reads: str


class _Body(NamedTuple):
  """The ops of a save or restore (``inside``), and what they may read
  from outside: name -> ``"filename"``, ``"variable"`` or
  ``"constant"``."""
  inside: Dict[str, Any]
  outside: Dict[str, str]


def checkpoint_part(meta_graph, which: str, library,
                    saved_model: bool = True) -> CheckpointPart:
  """The checkpoint ``which`` (``"restore"`` or ``"save"``) that the
  MetaGraph's ``saver_def`` names, judged by structure, never by name.

  A restore or save is standard when everything it runs, from the op
  ``saver_def`` names through data inputs and control dependencies (and,
  in TF2, the function that op calls), is:

  - of the op types a standard one uses (:data:`RESTORE_TYPES`,
    :data:`SAVE_TYPES`), calls no function and names none in an attr;
  - wired as TensorFlow wires it: every input is one of its own ops, the
    filename placeholder (``saver_def.filename_tensor_name``, itself only
    placeholders and constants), a variable with no inputs, or a constant;
    a ``RestoreV2`` reads the filename itself with constant tensor names;
    a ``SaveV2``'s file name is the filename joined with constants without
    ``..``; ``MergeV2Checkpoints`` writes to the filename; an assign writes
    a variable.

  A TF2 call passes only the filename, variables and constants and waits
  for nothing.
  """
  saver = meta_graph.saver_def
  root = node_name(saver.restore_op_name if which == "restore"
               else saver.save_tensor_name)
  reads = ("variables/variables" if saved_model
           else "the checkpoint it is given")
  if not root:
    return CheckpointPart(which, "", None, False, "the model has none",
                          frozenset(), reads)
  nodes = {n.name: n for n in meta_graph.graph_def.node}
  allowed = RESTORE_TYPES if which == "restore" else SAVE_TYPES
  filename = node_name(saver.filename_tensor_name)
  function = None
  reason = _filename_chain(nodes, filename)
  body: Optional[_Body] = None
  if not reason:
    if nodes.get(root) is not None and nodes[root].op in (
        "StatefulPartitionedCall", "PartitionedCall"):
      function = nodes[root].attr["f"].func.name
      reason, body = _function_body(nodes, root, filename, library)
    else:
      reason, body = _graph_body(nodes, root, filename)
  if body is not None and not reason:
    reason = _not_standard(body, allowed, library, which)
  inside = frozenset(body.inside) if body and function is None else frozenset()
  return CheckpointPart(which, root, function, not reason, reason, inside,
                        reads)


def _filename_chain(nodes, filename: str) -> str:
  """Why the filename tensor is not a placeholder over constants, or
  ``""``."""
  seen: Set[str] = set()
  stack = [filename]
  while stack:
    name = stack.pop()
    if name in seen:
      continue
    seen.add(name)
    node = nodes.get(name)
    if node is None or node.op not in _FILENAME_TYPES:
      what = "is missing" if node is None else f"is a {node.op}"
      return (f"its filename {filename!r} is computed, not a placeholder: "
              f"{name!r} {what}")
    stack += [node_name(i) for i in node.input]
  return ""


def _graph_body(nodes, root: str, filename: str) -> Tuple[str, _Body]:
  """A v1 save or restore: the graph's ops ``root`` runs, stopping at the
  filename and at the variables."""
  outside = {filename: "filename"}
  inside: Dict[str, Any] = {}
  stack = [root]
  while stack:
    name = stack.pop()
    if name in inside or name in outside:
      continue
    node = nodes.get(name)
    if node is None:
      return f"it names an op the graph lacks ({name!r})", _Body({}, {})
    if node.op in _VARIABLE_TYPES and not node.input:
      outside[name] = "variable"
      continue
    inside[name] = node
    stack += [node_name(i) for i in node.input]
  return "", _Body(inside, outside)


def _function_body(nodes, root: str, filename: str, library
                   ) -> Tuple[str, Optional[_Body]]:
  """A TF2 save or restore: the body of the function the op ``root``
  calls, its arguments bound to what the call passes."""
  from graphgrad.analysis._graph_util import linked_functions  # pylint: disable=g-import-not-at-top
  call = nodes[root]
  name = call.attr["f"].func.name
  fdef = library.get(name)
  if fdef is None:
    return f"it calls {name!r}, which the library lacks", None
  if len(data_inputs(call)) != len(call.input):
    return f"its call {root!r} waits for other ops", None
  if linked_functions(name, library) or call.attr["f"].func.attr:
    return f"its function {name!r} links to other functions", None
  args = fdef.signature.input_arg
  if len(args) != len(call.input):
    return (f"its call {root!r} passes {len(call.input)} inputs to "
            f"{len(args)} arguments"), None
  outside: Dict[str, str] = {}
  for arg, text in zip(args, call.input):
    source = nodes.get(node_name(text))
    if node_name(text) == filename:
      outside[arg.name] = "filename"
    elif source is not None and not source.input and (
        source.op in _VARIABLE_TYPES or source.op == "Const"):
      outside[arg.name] = ("constant" if source.op == "Const"
                           else "variable")
    else:
      return (f"its call {root!r} passes {node_name(text)!r}, which is neither "
              f"the filename, a variable nor a constant"), None
  return "", _Body({n.name: n for n in fdef.node_def}, outside)


def _not_standard(body: _Body, allowed, library, which: str) -> str:
  """Why ``body`` is not a standard checkpoint ``which``, or ``""``."""
  for node in body.inside.values():
    if node.op not in allowed:
      return (f"op {node.name!r} ({node.op}) is not one a standard "
              f"checkpoint {which} uses")
    if calls(node, library):
      return f"op {node.name!r} calls a function"
    for text in node.input:
      source = node_name(text)
      if source not in body.inside and source not in body.outside:
        return (f"op {node.name!r} reads {source!r}, which is neither the "
                f"filename, a variable nor a constant")
  wiring = _Wiring(body)
  for node in body.inside.values():
    data = data_inputs(node)
    ok = True
    if node.op == "RestoreV2":
      ok = (len(data) == 3 and wiring.is_filename(data[0])
            and wiring.is_constant(data[1]) and wiring.is_constant(data[2]))
    elif node.op in ("Assign", "AssignVariableOp"):
      ok = bool(data) and body.outside.get(node_name(data[0])) == "variable"
    elif node.op == "SaveV2":
      ok = (len(data) >= 3 and wiring.file_name(data[0])
            and wiring.is_constant(data[1]) and wiring.is_constant(data[2]))
    elif node.op == "MergeV2Checkpoints":
      pack = body.inside.get(node_name(data[0])) if data else None
      ok = (len(data) == 2 and wiring.is_filename(data[1])
            and pack is not None and pack.op == "Pack"
            and all(wiring.file_name(t) for t in data_inputs(pack)))
    if not ok:
      return (f"op {node.name!r} ({node.op}) is not wired to the filename "
              f"and constants as a standard checkpoint {which} is")
  return ""


class _Wiring:
  """Where the inputs of a save's or restore's ops come from."""

  def __init__(self, body: _Body):
    self.body = body

  def _node(self, text: str):
    return self.body.inside.get(node_name(text))

  def is_filename(self, text: str) -> bool:
    """The filename itself, or an ``Identity`` of it."""
    for _ in range(len(self.body.inside) + 1):
      if self.body.outside.get(node_name(text)) == "filename":
        return True
      node = self._node(text)
      if node is None or node.op != "Identity" or not data_inputs(node):
        return False
      text = data_inputs(node)[0]
    return False

  def is_constant(self, text: str) -> bool:
    node = self._node(text)
    if node is None:
      return self.body.outside.get(node_name(text)) == "constant"
    return node.op == "Const"

  def _safe_constant(self, text: str) -> bool:
    """A constant string without ``..``, or a ``Select`` of two."""
    node = self._node(text)
    if node is not None and node.op == "Select":
      return all(self._safe_constant(t) for t in data_inputs(node)[1:])
    if node is None or node.op != "Const":
      return False
    return not any(b".." in s for s in node.attr["value"].tensor.string_val)

  def file_name(self, text: str, depth: int = 0) -> bool:
    """The filename, or the filename joined with safe constants
    (``StringJoin``, ``ShardedFilename``, ``Identity``)."""
    if self.is_filename(text):
      return True
    node = self._node(text)
    if depth > 8 or node is None or node.op not in (
        "StringJoin", "ShardedFilename", "Identity"):
      return False
    data = data_inputs(node)
    if any(b".." in node.attr[k].s for k in ("separator",)):
      return False
    return bool(data) and self.file_name(data[0], depth + 1) and all(
        self._safe_constant(t) for t in data[1:])
