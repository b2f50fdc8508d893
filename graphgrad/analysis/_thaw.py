"""gg.thaw: make the weights of a frozen GraphDef trainable again.

A frozen inference graph (``convert_variables_to_constants``, a deployed
``.pb``) holds its weights as ``Const`` nodes. :func:`thaw` imports it with
``import_graph_def`` and, through ``input_map``, feeds every consumer of a
selected constant from a variable that starts with the constant's value and
takes its name, so the layers :func:`gg.analyze <graphgrad.analyze>` finds
are those of the model before it was frozen.

Batch-norm statistics (the ``mean`` and ``variance`` inputs of
``FusedBatchNorm*``, constants named ``moving_mean`` or ``moving_variance``)
become *non-trainable* variables: ``Saver`` saves them with the weights and
they can be re-estimated with ``assign``, but no optimizer touches them, and
with no ``UPDATE_OPS`` they keep their values through training.
"""

import logging
import os
import re
from typing import Callable, Dict, List, Sequence, Set, Union

import tensorflow as tf
from google.protobuf import message as pb_message

from graphgrad import _errors
from graphgrad.analysis import _graph_limits

log = logging.getLogger("graphgrad")

# Ops whose constant inputs are parameters: input index -> kind, or None for
# "any input is a parameter".
_WEIGHT_INPUTS: Dict[str, Union[None, Sequence[int]]] = {
    "MatMul": None, "BatchMatMul": None, "BatchMatMulV2": None,
    "BatchMatMulV3": None, "Einsum": None,
    "Conv2D": (1,), "Conv3D": (1,), "DepthwiseConv2dNative": (1,),
    "Conv2DBackpropInput": (1,), "Conv3DBackpropInputV2": (1,),
    "BiasAdd": (1,), "Add": None, "AddV2": None, "Sub": None, "Mul": None,
    "FusedBatchNorm": (1, 2, 3, 4), "FusedBatchNormV2": (1, 2, 3, 4),
    "FusedBatchNormV3": (1, 2, 3, 4), "GatherV2": (0,), "Gather": (0,),
    "ResourceGather": (0,), "Prelu": (1,),
}
_STATISTIC_INPUTS = {"FusedBatchNorm": (3, 4), "FusedBatchNormV2": (3, 4),
                     "FusedBatchNormV3": (3, 4)}
_STATISTIC_NAME = re.compile(r"(^|/)(moving_mean|moving_variance)$")
# Ops a frozen graph puts between a former variable and its consumers.
_PASS_THROUGH = frozenset({"Identity", "Enter", "Switch", "Merge"})

Select = Union[None, str, Sequence[str], Callable[[tf.compat.v1.NodeDef], bool]]


class ThawError(_errors.GraphGradError, ValueError):
  """A frozen graph or a ``select`` that :func:`thaw` cannot use."""


def load_graph_def(graph_def_or_path) -> tf.compat.v1.GraphDef:
  """A ``GraphDef`` from itself or from the path of a ``.pb`` (binary) or
  ``.pbtxt`` (text) file.

  Raises:
    ThawError: if the path is missing or the file is not a GraphDef.
  """
  if isinstance(graph_def_or_path, tf.compat.v1.GraphDef):
    return graph_def_or_path
  if not isinstance(graph_def_or_path, (str, os.PathLike)):
    raise ThawError(
        f"`graph_def_or_path` must be a tf.compat.v1.GraphDef or the path of "
        f"a binary .pb file; got {type(graph_def_or_path).__name__}. Pass "
        f"e.g. convert_variables_to_constants(...) or 'frozen.pb'.")
  path = os.fspath(graph_def_or_path)
  if os.path.isdir(path):
    raise ThawError(
        f"`graph_def_or_path` {path!r} is a directory; thaw reads a frozen "
        f"GraphDef (.pb) file. For a SavedModel directory, load it with "
        f"tf.compat.v1.saved_model.loader.load: its variables are trainable "
        f"already.")
  if not os.path.isfile(path):
    raise ThawError(f"`graph_def_or_path`: no such file: {path!r}. Pass the "
                    f"path of a frozen GraphDef (.pb) file.")
  with open(path, "rb") as f:
    data = f.read()
  graph_def = tf.compat.v1.GraphDef()
  try:
    graph_def.ParseFromString(data)
    ok = bool(graph_def.node) and all(n.name and n.op for n in graph_def.node)
  except (pb_message.DecodeError, RuntimeWarning, ValueError):
    ok = False
  if not ok:  # tf.io.write_graph(..., as_text=True) writes text
    graph_def, ok = _text_graph_def(data)
  if not ok:
    raise ThawError(
        f"`graph_def_or_path` {path!r} is not a GraphDef, binary or text. "
        f"Pass a frozen graph written by tf.io.write_graph(graph_def, dir, "
        f"name); a .meta file is a MetaGraph "
        f"(tf.compat.v1.train.import_meta_graph) and a saved_model.pb a "
        f"SavedModel (tf.compat.v1.saved_model.loader.load).")
  return graph_def


def _text_graph_def(data: bytes):
  """``(graph_def, ok)`` from the text format of a GraphDef."""
  from google.protobuf import text_format  # pylint: disable=g-import-not-at-top
  graph_def = tf.compat.v1.GraphDef()
  try:
    text_format.Merge(data.decode("utf-8"), graph_def)
  except (UnicodeDecodeError, text_format.ParseError):
    return graph_def, False
  return graph_def, bool(graph_def.node) and all(
      n.name and n.op for n in graph_def.node)


def _shape(node) -> List[int]:
  return [d.size for d in node.attr["value"].tensor.tensor_shape.dim]


def _dtype(node) -> tf.DType:
  return tf.dtypes.as_dtype(node.attr["dtype"].type)


def _uses(graph_def) -> Dict[str, List[tuple]]:
  """Const name -> ``(consumer op type, input index)`` past pass-throughs."""
  by_input: Dict[str, List[tuple]] = {}
  for node in graph_def.node:
    for i, inp in enumerate(node.input):
      if not inp.startswith("^"):
        by_input.setdefault(inp.split(":")[0], []).append((node, i))
  uses: Dict[str, List[tuple]] = {}
  for node in graph_def.node:
    if node.op != "Const":
      continue
    found, stack, seen = [], [node.name], {node.name}
    while stack:
      for consumer, i in by_input.get(stack.pop(), ()):
        if consumer.op in _PASS_THROUGH:
          if consumer.name not in seen:
            seen.add(consumer.name)
            stack.append(consumer.name)
        else:
          found.append((consumer.op, i))
    uses[node.name] = found
  return uses


def is_weight(node, uses: Sequence[tuple]) -> bool:
  """The default selection: a float Const of rank >= 1 feeding a weight op."""
  if node.op != "Const" or not _dtype(node).is_floating:
    return False
  shape = _shape(node)
  if not shape or 0 in shape:
    return False
  for op_type, i in uses:
    positions = _WEIGHT_INPUTS.get(op_type, ())
    if positions is None or i in positions:
      return True
  return False


def is_statistic(node, uses: Sequence[tuple]) -> bool:
  """True for a batch-norm mean or variance."""
  return bool(_STATISTIC_NAME.search(node.name)) or any(
      i in _STATISTIC_INPUTS.get(op_type, ()) for op_type, i in uses)


def select_constants(graph_def, select: Select) -> List[tf.compat.v1.NodeDef]:
  """The Const nodes ``select`` picks, in GraphDef order.

  Args:
    graph_def: the frozen ``tf.compat.v1.GraphDef``.
    select: ``None`` picks the weights: floating-point Consts of rank >= 1
      that feed, directly or through ``Identity``, a ``MatMul``,
      ``BatchMatMul``, ``Einsum``, a convolution's filter, ``BiasAdd``,
      ``Add``/``AddV2``/``Sub``/``Mul``, a ``FusedBatchNorm*`` scale, offset,
      mean or variance, or a ``Gather``'s table. Shape constants, axes and
      indices (integers) and scalars (epsilons, scales, clip bounds) stay
      constants. A ``str`` is a regex searched in each Const's name
      (``re.search``); a list holds Const names; a callable is called with
      each Const ``NodeDef`` and returns True for the ones to thaw.

  Raises:
    ThawError: if ``select`` is malformed, picks nothing, or picks a
      non-floating-point constant or a node that is not a Const.
  """
  uses = _uses(graph_def)
  consts = [n for n in graph_def.node if n.op == "Const"]
  if select is None:
    chosen = [n for n in consts if is_weight(n, uses[n.name])]
    what = ("the default selection (float Consts of rank >= 1 feeding "
            "MatMul, Conv, BiasAdd, Add, Mul, BatchNorm or Gather)")
  elif isinstance(select, str):
    try:
      pattern = re.compile(select)
    except re.error as e:
      raise ThawError(f"`select` {select!r} is not a valid regular "
                      f"expression ({e}). Pass a regex on node names, e.g. "
                      f"r'/(kernel|bias)$'.") from None
    chosen = [n for n in consts if pattern.search(n.name)]
    what = f"`select` regex {select!r}"
  elif callable(select):
    chosen = [n for n in consts if select(n)]
    what = f"`select` predicate {getattr(select, '__name__', select)!r}"
  else:
    chosen = _by_names(graph_def, select)
    what = "`select` names"
  if not chosen:
    hints = [n.name for n in consts if is_weight(n, uses[n.name])][:5]
    raise ThawError(
        f"{what} matched no Const node of the GraphDef, so nothing would "
        f"become trainable. Weight-like constants it holds: "
        f"{', '.join(hints) or '(none)'}. Pass select=None for the default, "
        f"or a regex, list or predicate that matches some of these.")
  ints = [f"{n.name} ({_dtype(n).name})" for n in chosen
          if not _dtype(n).is_floating]
  if ints:
    raise ThawError(
        f"{what} matched constants that are not floating-point: "
        f"{', '.join(ints[:8])}{' ...' if len(ints) > 8 else ''}. Only float "
        f"constants can become trainable variables; shapes, axes and indices "
        f"must stay constants. Narrow `select`, e.g. r'/(kernel|bias)$'.")
  return chosen


def _by_names(graph_def, names) -> List[tf.compat.v1.NodeDef]:
  try:
    wanted = [str(n).split(":")[0] for n in names]
  except TypeError:
    raise ThawError(
        f"`select` must be None, a regex (str), a list of node names or a "
        f"predicate on NodeDef; got {type(names).__name__}.") from None
  nodes = {n.name: n for n in graph_def.node}
  bad = [n for n in wanted if n not in nodes or nodes[n].op != "Const"]
  if bad:
    raise ThawError(
        f"`select` names {', '.join(map(repr, bad))}, which "
        f"{'is' if len(bad) == 1 else 'are'} not a Const node of the "
        f"GraphDef. List the names of Const nodes, e.g. 'dense/kernel'.")
  keep: Set[str] = set(wanted)
  return [n for n in graph_def.node if n.name in keep]


def thaw(graph_def_or_path, select: Select = None, name: str = "",
         memory_bytes: int = _graph_limits.DEFAULT_MEMORY_BYTES
         ) -> List[tf.Variable]:
  """Imports a frozen graph and turns its weights back into variables.

  Each selected floating-point ``Const`` becomes a resource variable whose
  initial value is the constant's value and whose name is the constant's
  name (``InceptionV3/Conv2d_1a_3x3/weights`` stays
  ``InceptionV3/Conv2d_1a_3x3/weights``), so :func:`gg.analyze
  <graphgrad.analyze>` finds the layers the original variables formed.
  ``import_graph_def``'s ``input_map`` feeds every consumer of the constant
  from the variable; the constants themselves are not imported, so the
  weights are held once, in the variables' initial values. Before any
  training, every output equals the frozen graph's bit for bit.

  Batch-norm statistics (``FusedBatchNorm*`` mean and variance inputs, and
  constants named ``moving_mean``/``moving_variance``) become non-trainable
  variables: ``Saver`` keeps them with the model's state, no optimizer
  updates them, and nothing else does (a frozen graph has no update ops).

  Args:
    graph_def_or_path: a ``tf.compat.v1.GraphDef`` or the path of a binary
      ``.pb`` file.
    select: which constants to thaw: ``None`` (default) for the weights, a
      regex ``str``, a list of Const names or a predicate on ``NodeDef``; see
      :func:`select_constants` for what each picks.
    name: the import prefix, as in ``import_graph_def`` (``""`` imports the
      names unchanged; ``"net"`` gives ``net/dense/kernel``).
    memory_bytes: the most one tensor of the graph may take, in bytes. The
      graph is checked before anything of it is read or imported
      (:func:`graphgrad.analysis._graph_limits.check`).

  Returns:
    The created variables, in the GraphDef's node order.

  Raises:
    ThawError (a GraphGradError): if the path is not a GraphDef, ``select``
      matches nothing or matches non-floating-point constants, or a
      variable name is already taken in the default graph.
    GraphLimitError (a GraphGradError): if the graph asks for more than
      graphgrad imports: recursive or deeply nested functions, a tensor
      larger than ``memory_bytes``, a broken gradient override.

  Example:
    >>> import tensorflow as tf, graphgrad as gg
    >>> with tf.Graph().as_default() as frozen:
    ...   x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
    ...   w = tf.constant([[1.0], [2.0]], name="dense/kernel")
    ...   y = tf.reshape(x @ w, [-1], name="y")
    >>> with tf.Graph().as_default() as g:
    ...   variables = gg.thaw(frozen.as_graph_def())
    ...   y = g.get_tensor_by_name("y:0")
    ...   with tf.compat.v1.Session() as s:
    ...     s.run(tf.compat.v1.global_variables_initializer())
    ...     print([v.op.name for v in variables],
    ...           s.run(y, {"x:0": [[1.0, 1.0]]}))
    ['dense/kernel'] [3.]
  """
  graph_def = load_graph_def(graph_def_or_path)
  _graph_limits.check(
      graph_def, memory_bytes, source=(
          "" if isinstance(graph_def_or_path, tf.compat.v1.GraphDef)
          else repr(os.fspath(graph_def_or_path))))
  chosen = select_constants(graph_def, select)
  variables = _import_as_variables(graph_def, chosen, name)
  trainable = sum(1 for v in variables if v.trainable)
  log.info("thawed %d constants into variables (%d trainable, %d batch-norm "
           "statistics)", len(variables), trainable, len(variables) - trainable)
  return variables


def _import_as_variables(graph_def, chosen, name: str) -> List[tf.Variable]:
  """Creates a variable per chosen Const and imports the rest of the graph.

  ``input_map`` feeds every consumer of a chosen constant (and every control
  dependency on it) from its variable's read.

  Raises:
    ThawError: if a variable's name is already taken in the default graph.
  """
  uses = _uses(graph_def)
  controlled = {i[1:] for n in graph_def.node for i in n.input
                if i.startswith("^")}
  graph = tf.compat.v1.get_default_graph()
  with tf.compat.v1.name_scope(name, "import") as scope:
    scope = scope or ""
    taken = [scope + n.name for n in chosen
             if graph.unique_name(n.name, mark_as_used=False)
             != scope + n.name]
    if taken:
      raise ThawError(
          f"the default tf.Graph already has ops named "
          f"{', '.join(taken[:5])}, so the thawed variables cannot take the "
          f"constants' names. Thaw into a fresh tf.Graph, or pass another "
          f"import prefix with name=...")
    variables, input_map = [], {}
    for node in chosen:
      var = _variable(node, scope, not is_statistic(node, uses[node.name]))
      with tf.name_scope(var.op.name + "/thaw/"):
        read = var.value()
      variables.append(var)
      input_map[node.name + ":0"] = read
      if node.name in controlled:
        input_map["^" + node.name] = read
    tf.compat.v1.import_graph_def(_without(graph_def, chosen),
                                  input_map=input_map, name=scope or "")
  return variables


def _without(graph_def, chosen) -> tf.compat.v1.GraphDef:
  """A copy of ``graph_def`` without the chosen Consts.

  ``input_map`` replaces every use of them. Colocation constraints on them
  (a reference variable's ``read`` op carries ``loc:@kernel``) are dropped:
  they name nodes that are not imported.
  """
  gone = {n.name for n in chosen}
  gone_loc = {b"loc:@" + n.encode() for n in gone}
  out = tf.compat.v1.GraphDef()
  out.versions.CopyFrom(graph_def.versions)
  out.library.CopyFrom(graph_def.library)
  for node in graph_def.node:
    if node.name in gone:
      continue
    locs = node.attr["_class"].list.s if "_class" in node.attr else ()
    if any(s in gone_loc for s in locs):
      copy = out.node.add()
      copy.CopyFrom(node)
      kept = [s for s in locs if s not in gone_loc]
      del copy.attr["_class"]
      if kept:
        copy.attr["_class"].list.s.extend(kept)
    else:
      out.node.add().CopyFrom(node)
  return out


def _variable(node, scope: str, trainable: bool) -> tf.Variable:
  del scope  # the caller's name scope is the import prefix
  value = tf.make_ndarray(node.attr["value"].tensor)
  return tf.compat.v1.Variable(value, name=node.name, trainable=trainable,
                               dtype=_dtype(node), use_resource=True)
