"""What a saved graph may ask for before it is imported.

A saved graph is a program, and some break the process that imports them
before a single op runs: TensorFlow's import recurses through a function
that calls itself until the stack overflows, a ``TensorArrayV3`` of
``2**31 - 1`` slots aborts, a ``Const`` whose proto claims ``1e10`` floats
(and stores none: TensorFlow fills the shape with its last value) takes
37 GiB. :func:`check` reads the ``GraphDef``, its nodes and its function
library, without importing it, and refuses such a graph with a
:class:`GraphLimitError` of one line that names the node or function, what
it asks for, the limit and the fix. Each node, attr and call is read once,
so the cost is linear in the size of the ``GraphDef``. The limits give
earlier, clearer messages; what a graph can touch is bounded by the process
that imports it.
"""

from typing import Dict, Iterable, List, Mapping, Optional

import tensorflow as tf
from tensorflow.core.framework import function_pb2

from graphgrad import _compat, _errors
from graphgrad.analysis import _graph_util

# A GiB, as the messages print sizes.
_GIB = 2 ** 30
DEFAULT_MEMORY_BYTES = 8 * _GIB
MAX_CALL_DEPTH = 100
# The least TensorFlow keeps per string element (a tstring) or per slot of
# a TensorArray or TensorList (a Tensor is larger), however small its dtype.
OBJECT_BYTES = 24
# Signature input names that size what the op allocates: an output's shape,
# or a container's number of slots (size, num_elements).
SIZE_ARGS = frozenset({"shape", "dims", "size", "element_shape",
                       "num_elements", "output_shape", "multiples"})
_SLOT_ARGS = frozenset({"size", "num_elements"})
# TensorFlow's tensors have at most 254 dimensions: a Const with more
# elements than this is no shape, and its values are not read.
_MAX_SHAPE_VALUES = 256
# Products are capped here, so that a crafted shape of many huge dimensions
# costs one multiplication each, not big-number arithmetic.
_CAP = 2 ** 80
_HANDLES = frozenset({tf.resource.as_datatype_enum,
                      tf.variant.as_datatype_enum})
_FIX_SIZE = ("Pass a larger --memory if the model really needs that much; "
             "otherwise the file is corrupt or crafted.")
_FIX_OVERRIDE = ("Remove the attr, or set it to the name of a gradient "
                 "registered with tf.RegisterGradient.")


class GraphLimitError(_errors.GraphGradError, ValueError):
  """A saved graph that asks for more than graphgrad imports."""


def check(graph_def: tf.compat.v1.GraphDef,
          memory_bytes: int = DEFAULT_MEMORY_BYTES, batch: int = 1,
          source: str = "") -> None:
  """Refuses ``graph_def`` if importing it could crash or exhaust the process.

  What it refuses:

  - **Recursion** in the function library: a cycle in the call graph, where
    a function calls another by op type, through a function attr at any
    depth (a ``NameAttrList``'s own attrs included), a function list, or a
    default of its signature's attrs. TensorFlow never saves one.
  - **Call depth** over :data:`MAX_CALL_DEPTH` functions in one chain
    (``f0`` calls ``f1``, which calls ``f2``, ...). Real models nest a few
    levels (a ``tf.function``, a ``while`` body, a ``cond`` branch); 100
    leaves ample room and keeps TensorFlow's recursive import far from the
    end of its stack.
  - **Tensors larger than** ``memory_bytes``: a tensor-valued attr (a
    ``Const``'s ``value``), by the shape its proto claims times its dtype's
    size, whatever the proto stores; a shape attr of the op's signature
    (``Placeholder``, ``PlaceholderWithDefault``, ``VarHandleOp``,
    ``VariableV2``, ...), unknown dimensions counted as ``batch``, which
    ``graphgrad grads`` gives random inputs; and an input whose signature
    name says it sizes what the op allocates (:data:`SIZE_ARGS`: ``Fill``'s
    ``dims``, ``Empty``'s ``shape``, ``TensorArrayV3``'s ``size``, ...),
    fed by a ``Const`` directly or through ``Identity`` ops, times the
    dtype of the op's output. The signatures come from TensorFlow's op
    registry, never from a list of op types. An op that outputs a resource
    or variant handle (a ``TensorArray``, a ``TensorList``) keeps an object
    per slot, so each slot of its ``size`` or ``num_elements`` counts at
    least :data:`OBJECT_BYTES`, as does each element of a string tensor.
    Sparse shapes (``dense_shape``, ``a_shape``) and bounds
    (``max_num_elements``) allocate nothing, and are not read.
  - **A gradient override that cannot be right**: a ``_gradient_op_type``
    attr (what ``gradient_override_map`` records) that is not a string or
    not UTF-8, and one that names the gradient TensorFlow registered for
    another op type whose signature the node does not share (its attrs, or
    its number of inputs or outputs). Such a gradient is registered, so it
    is no lost override (:mod:`graphgrad.analysis._lost_overrides`, whose
    function stayed in the process that built the graph): ``tf.gradients``
    would call it, and it would read attrs the node lacks, or inputs by
    position that mean something else, and fail or compute a wrong
    gradient. A borrowed gradient whose signature fits passes
    (``gradient_override_map({"Sign": "Identity"})``, the straight-through
    estimator), and so does a name registered with ``tf.RegisterGradient``
    that is no op type.

  Args:
    graph_def: the ``tf.compat.v1.GraphDef`` about to be imported (a
      MetaGraph's ``graph_def``, a SavedModel MetaGraph's, a frozen graph).
    memory_bytes: the most one tensor may take, in bytes.
    batch: what an unknown dimension of a shape attr counts as: the batch
      size of the random inputs ``graphgrad grads`` makes.
    source: where the graph comes from (``"'model.meta'"``), to start the
      messages with.

  Raises:
    GraphLimitError: on a recursive or too deeply nested function library,
      a tensor, shape or allocation larger than ``memory_bytes``, an
      ill-typed gradient override or one borrowed from an op it does not
      fit, or a ``memory_bytes`` or ``batch`` that is not a positive int.

  Example:
    >>> with tf.Graph().as_default() as g:
    ...   _ = tf.zeros([1000, 1000], name="zeros")
    >>> check(g.as_graph_def())
    >>> try:
    ...   check(g.as_graph_def(), memory_bytes=10**6)
    ... except GraphLimitError as e:
    ...   print(e)
    node 'zeros' (Fill) takes its `dims` input from Const
    'zeros/shape_as_tensor' = [1000, 1000]: 1,000,000 elements of float32:
    3.8 MiB, more than the 1,000,000 bytes memory limit (memory_bytes), so
    graphgrad does not import the graph. Pass a larger --memory if the model
    really needs that much; otherwise the file is corrupt or crafted.
  """
  for name, value in (("memory_bytes", memory_bytes), ("batch", batch)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise GraphLimitError(
          f"`{name}` must be a positive int; got {value!r}. Pass e.g. "
          f"{name}={DEFAULT_MEMORY_BYTES if name == 'memory_bytes' else 8}.")
  check_calls(graph_def.library, source)
  limits = _Limits(memory_bytes, batch, source)
  limits.nodes(graph_def.node, "")
  for function in graph_def.library.function:
    limits.nodes(function.node_def, function.signature.name)


# -- the function library ----------------------------------------------------


def _callees(function, library: Mapping) -> List[str]:
  """The functions of ``library`` that ``function`` (a ``FunctionDef``)
  calls: from its nodes, its attrs, its arguments' attrs and the defaults
  of its signature's attrs."""
  names = []
  for node in function.node_def:
    names += _graph_util.called_functions(node, library)
  # Not linked_functions: an api_implements alternative is no call, and two
  # alternatives would look like a cycle.
  names += [n for _, n in _graph_util.definition_functions(function)]
  # A function the library lacks calls nothing; importing it fails.
  return [n for n in names if n in library]


def check_calls(library: function_pb2.FunctionDefLibrary,
                source: str = "") -> None:
  """Refuses a function library with recursion or calls nested too deep.

  Args:
    library: a ``GraphDef``'s ``library``.
    source: where the graph comes from, to start the messages with.

  Raises:
    GraphLimitError: if a function calls itself, directly or through
      others, or a chain of calls is more than :data:`MAX_CALL_DEPTH`
      functions deep.

  Example:
    >>> library = tf.compat.v1.GraphDef().library
    >>> f = library.function.add()
    >>> f.signature.name = "f"
    >>> _ = f.node_def.add(name="again", op="f")
    >>> try:
    ...   check_calls(library)
    ... except GraphLimitError as e:
    ...   print(e)
    function 'f' calls itself (f -> f): TensorFlow's import of a recursive
    function recurses until the process crashes, ...
  """
  prefix = f"{source}: " if source else ""
  functions = {f.signature.name: f for f in library.function}
  callees = {name: _callees(f, functions) for name, f in functions.items()}
  depth: Dict[str, int] = {}
  deepest_callee: Dict[str, Optional[str]] = {}
  for root in functions:
    if root in depth:
      continue
    # Depth-first, with an explicit stack: a chain of thousands of
    # functions is what this guards against.
    path, on_path = [root], {root: 0}
    pending = [iter(callees[root])]
    while pending:
      name = path[-1]
      for callee in pending[-1]:
        if callee in on_path:
          _refuse_cycle(prefix, path[on_path[callee]:] + [callee])
        if callee not in depth:
          on_path[callee] = len(path)
          path.append(callee)
          pending.append(iter(callees[callee]))
          break
      else:
        pending.pop()
        del on_path[path.pop()]
        below = max(callees[name], key=depth.__getitem__, default=None)
        depth[name] = 1 + (depth[below] if below else 0)
        deepest_callee[name] = below
  top = max(functions, key=depth.__getitem__, default=None)
  if top is None or depth[top] <= MAX_CALL_DEPTH:
    return
  chain = [top]
  while deepest_callee[chain[-1]]:
    chain.append(deepest_callee[chain[-1]])
  shown = (" -> ".join(chain) if len(chain) <= 4 else
           f"{chain[0]} -> {chain[1]} -> ... -> {chain[-1]}")
  raise GraphLimitError(
      f"{prefix}function {top!r} starts a chain of {depth[top]} functions, "
      f"each calling the next ({shown}): more than the {MAX_CALL_DEPTH} "
      f"nested functions graphgrad imports, as TensorFlow's import recurses "
      f"once per level (real models nest a few). Inline the nested "
      f"functions and save the model again; otherwise the file is corrupt "
      f"or crafted.")


def _refuse_cycle(prefix: str, cycle: List[str]) -> None:
  shown = " -> ".join(cycle)
  who = (f"function {cycle[0]!r} calls itself" if len(cycle) == 2 else
         f"functions {', '.join(map(repr, cycle[:-1]))} call each other")
  raise GraphLimitError(
      f"{prefix}{who} ({shown}): TensorFlow's import of a recursive "
      f"function recurses until the process crashes, so graphgrad imports "
      f"no recursion in the function library. TensorFlow never saves one: "
      f"the file is corrupt or crafted; use the file TensorFlow wrote.")


# -- gradient overrides ------------------------------------------------------


_KINDS = {"i": "an int", "f": "a float", "b": "a bool", "type": "a dtype",
          "shape": "a shape", "tensor": "a tensor", "list": "a list",
          "func": "a function", "placeholder": "a function-attr placeholder",
          None: "no value"}


def _where(node_def, function: str = "") -> str:
  return (f"node {node_def.name!r} ({node_def.op})"
          + (f" of function {function!r}" if function else ""))


def gradient_override(node_def, function: str = "",
                      source: str = "") -> Optional[str]:
  """The name a node's ``_gradient_op_type`` attr holds, or ``None``.

  ``gradient_override_map({"Identity": "FlipGradient"})`` records
  ``"FlipGradient"`` there; ``tf.gradients`` then looks the gradient up by
  that name instead of the op type.

  Args:
    node_def: the node's ``NodeDef``.
    function: the function whose body holds the node, if any.
    source: where the graph comes from, to start the messages with.

  Raises:
    GraphLimitError: if the attr holds no string, or bytes that are not
      UTF-8.

  Example:
    >>> node = tf.compat.v1.NodeDef(name="flip", op="Identity")
    >>> node.attr["_gradient_op_type"].s = b"FlipGradient"
    >>> gradient_override(node)
    'FlipGradient'
  """
  if "_gradient_op_type" not in node_def.attr:
    return None
  prefix = f"{source}: " if source else ""
  value = node_def.attr["_gradient_op_type"]
  kind = value.WhichOneof("value")
  if kind != "s":
    shown = (f" ({getattr(value, kind)!r})" if kind in ("i", "f", "b")
             else "")
    raise GraphLimitError(
        f"{prefix}{_where(node_def, function)} has a `_gradient_op_type` "
        f"attr holding {_KINDS.get(kind, kind)}{shown}, not a string: "
        f"gradient_override_map records the name of a registered gradient "
        f"there, so the file is corrupt or crafted. {_FIX_OVERRIDE}")
  try:
    return value.s.decode("utf-8")
  except UnicodeDecodeError:
    raise GraphLimitError(
        f"{prefix}{_where(node_def, function)} has a `_gradient_op_type` "
        f"attr {value.s[:40]!r} that is not UTF-8 text, so it names no "
        f"gradient function: the file is corrupt or crafted. "
        f"{_FIX_OVERRIDE}") from None


def _a(op_type: str) -> str:
  """``"an Identity"``, ``"a Conv2D"``."""
  return f"{'an' if op_type[:1] in 'AEIOU' else 'a'} {op_type}"


def _misfit(node_def, own, borrowed) -> Optional[str]:
  """How ``node_def`` (of OpDef ``own``, or ``None`` if unknown) differs
  from what the gradient of ``borrowed`` (an OpDef) reads, or ``None``."""
  types = {a.name: a.type for a in own.attr} if own else {}
  missing = sorted(a.name for a in borrowed.attr
                   if a.name not in node_def.attr and a.name not in types)
  if missing:
    return (f"{_a(node_def.op)} has no attr "
            f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
  retyped = sorted(a.name for a in borrowed.attr
                   if a.name in types and types[a.name] != a.type)
  if retyped:
    return (f"{_a(node_def.op)}'s attr {retyped[0]} is of another type "
            f"than {_a(borrowed.name)}'s")
  inputs = sum(1 for i in node_def.input if not i.startswith("^"))
  wanted = _arg_count(borrowed.input_arg, node_def, borrowed)
  if wanted is not None and wanted != inputs:
    return (f"{_a(borrowed.name)} takes {wanted} inputs and this node "
            f"{inputs}")
  if own:
    have = _arg_count(own.output_arg, node_def, own)
    wanted = _arg_count(borrowed.output_arg, node_def, borrowed)
    if None not in (have, wanted) and have != wanted:
      return (f"{_a(borrowed.name)} gives {wanted} outputs and "
              f"{_a(node_def.op)} {have}")
  return None


# -- sizes -------------------------------------------------------------------


def _attr(node_def, op_def, name: str):
  """The node's attr ``name``, or its signature's default, or ``None``."""
  if name in node_def.attr:
    return node_def.attr[name]
  for a in op_def.attr:
    if a.name == name and a.HasField("default_value"):
      return a.default_value
  return None


def _arg_count(args, node_def, op_def) -> Optional[int]:
  """How many tensors ``args`` (a signature's input or output args) stand
  for on this node, or ``None`` if its attrs do not say."""
  count = 0
  for arg in args:
    if arg.number_attr or arg.type_list_attr:
      value = _attr(node_def, op_def, arg.number_attr or arg.type_list_attr)
      if value is None:
        return None
      count += value.i if arg.number_attr else len(value.list.type)
    else:
      count += 1
  return count


def _dtype(enum: int) -> Optional[tf.DType]:
  try:
    return tf.dtypes.as_dtype(enum).base_dtype
  except (TypeError, ValueError):
    return None


def _element_bytes(dtype: Optional[tf.DType]) -> int:
  if dtype is None:
    return 1
  return dtype.size if dtype.size > 0 else OBJECT_BYTES


def _output_dtype(node_def, op_def) -> Optional[tf.DType]:
  """The dtype of the node's first output; for a handle (a TensorArray's,
  a TensorList's), the largest of its type attrs, which its slots hold."""
  arg = op_def.output_arg[0] if op_def.output_arg else None
  if arg is not None and arg.type_attr:
    value = _attr(node_def, op_def, arg.type_attr)
    return None if value is None else _dtype(value.type)
  if arg is not None and arg.type and arg.type not in _HANDLES:
    return _dtype(arg.type)
  found = [_dtype(v.type) for a in op_def.attr if a.type == "type"
           for v in [_attr(node_def, op_def, a.name)] if v is not None]
  found = [d for d in found if d is not None]
  return max(found, key=_element_bytes, default=None)


def _dtype_text(dtype: Optional[tf.DType]) -> str:
  return dtype.name if dtype is not None else "an unknown dtype"


def _product(values: Iterable[int]) -> int:
  """The product of ``values``, capped at ``_CAP``."""
  product = 1
  for v in values:
    product *= v
    if product == 0:
      return 0
    product = min(product, _CAP)
  return product


def _size(n: int) -> str:
  if n >= _CAP:
    return "more than 2**80 bytes"
  if n < 2 ** 20:
    return f"{n:,} bytes"
  unit = _GIB if n >= _GIB else 2 ** 20
  return f"{n / unit:.1f} {'GiB' if unit == _GIB else 'MiB'}"


def _shape_text(dims: List[int]) -> str:
  shown = ", ".join("?" if d < 0 else str(d) for d in dims[:8])
  return f"[{shown}{', ...' if len(dims) > 8 else ''}]"


class _Limits:
  """The per-node checks of :func:`check`, for one ``memory_bytes``."""

  def __init__(self, memory_bytes: int, batch: int, source: str):
    self.memory_bytes, self.batch, self.source = memory_bytes, batch, source
    self.prefix = f"{source}: " if source else ""
    self.op_defs: Dict[str, object] = {}
    # Op type -> (has a shape attr, has an input named like a size).
    self.sizing: Dict[str, tuple] = {}

  def op_def(self, op_type: str):
    if op_type not in self.op_defs:
      own = self.op_defs[op_type] = _compat.op_def(op_type)
      self.sizing[op_type] = (
          own is not None and any(a.type in ("shape", "list(shape)")
                                  for a in own.attr),
          own is not None and any(a.name in SIZE_ARGS
                                  for a in own.input_arg))
    return self.op_defs[op_type]

  def nodes(self, nodes, function: str) -> None:
    """Checks the nodes of the graph (``function`` empty) or of a function
    body."""
    by_name = {n.name: n for n in nodes}
    # The Const behind a node, and a Const's values, found once each.
    consts: Dict[str, object] = {}
    values: Dict[str, Optional[List[int]]] = {}
    for node in nodes:
      own = self.op_def(node.op)
      self.tensors(node, function)
      shaped, sized = self.sizing[node.op]
      if shaped:
        self.shapes(node, own, function)
      if sized:
        self.sized_inputs(node, own, function, by_name, consts, values)
      self.override(node, own, function)

  def refuse(self, node, function: str, claim: str, size: int,
             fix: str = _FIX_SIZE) -> None:
    raise GraphLimitError(
        f"{self.prefix}{_where(node, function)} {claim}: {_size(size)}, "
        f"more than the {_size(self.memory_bytes)} memory limit "
        f"(memory_bytes), so graphgrad does not import the graph. {fix}")

  def tensors(self, node, function: str) -> None:
    """A tensor-valued attr takes what its proto's shape claims."""
    for key in sorted(node.attr):
      value = node.attr[key]
      kind = value.WhichOneof("value")
      protos = ([value.tensor] if kind == "tensor" else
                list(value.list.tensor) if kind == "list" else [])
      for proto in protos:
        dims = _dims(proto)
        dtype = _dtype(proto.dtype)
        size = _product(dims + [_element_bytes(dtype)])
        if size > self.memory_bytes:
          self.refuse(
              node, function,
              f"holds in its `{key}` attr a "
              f"{dtype.name if dtype else 'tensor'} tensor of shape "
              f"{_shape_text(dims)} ({_product(dims):,} elements; its proto "
              f"stores {proto.ByteSize():,} bytes and TensorFlow fills the "
              f"rest)", size)

  def shapes(self, node, own, function: str) -> None:
    """A shape attr of the signature sizes tensors of the node's dtype."""
    dtype = _output_dtype(node, own)
    element = _element_bytes(dtype)
    for a in own.attr:
      if a.type not in ("shape", "list(shape)"):
        continue
      value = _attr(node, own, a.name)
      if value is None:
        continue
      shapes = [value.shape] if a.type == "shape" else list(value.list.shape)
      for shape in shapes:
        if shape.unknown_rank:
          continue
        dims = [d.size for d in shape.dim]
        unknown = any(d < 0 for d in dims)
        size = _product([self.batch if d < 0 else d for d in dims]
                        + [element])
        if size > self.memory_bytes:
          counted = (f", unknown dimensions counted as the batch "
                     f"{self.batch}" if unknown else "")
          fix = (_FIX_SIZE.replace("--memory", "--memory or a smaller "
                                   "--batch") if unknown and self.batch > 1
                 else _FIX_SIZE)
          self.refuse(node, function,
                      f"declares `{a.name}` {_shape_text(dims)} of "
                      f"{_dtype_text(dtype)}{counted}", size, fix)

  def sized_inputs(self, node, own, function: str, by_name, consts,
                   values) -> None:
    """An input named like a size, fed by a Const, sizes an allocation."""
    inputs = [i for i in node.input if not i.startswith("^")]
    handles = any(a.type in _HANDLES for a in own.output_arg)
    position = 0
    for arg in own.input_arg:
      if position >= len(inputs):
        return
      if arg.number_attr or arg.type_list_attr:
        value = _attr(node, own, arg.number_attr or arg.type_list_attr)
        if value is None:
          return
        count = value.i if arg.number_attr else len(value.list.type)
      else:
        count = 1
      if arg.name in SIZE_ARGS:
        for i in range(position, min(position + max(count, 0), len(inputs))):
          self.sized_input(node, own, function, arg.name, inputs[i],
                           handles and arg.name in _SLOT_ARGS, by_name,
                           consts, values)
      position += max(count, 0)

  def sized_input(self, node, own, function: str, arg: str, tensor: str,
                  slots: bool, by_name, consts, values_of) -> None:
    source = _const_behind(tensor.split(":")[0], by_name, consts)
    if source is None:
      return
    if source.name not in values_of:
      values_of[source.name] = _shape_values(source)
    values = values_of[source.name]
    if values is None:
      return
    # -1 stands for a dimension the op infers.
    count = _product(1 if v < 0 else v for v in values)
    dtype = _output_dtype(node, own)
    element = _element_bytes(dtype)
    what = f"elements of {_dtype_text(dtype)}"
    if slots and element < OBJECT_BYTES:
      element = OBJECT_BYTES
      what = (f"slots of {_dtype_text(dtype)} tensors, at least "
              f"{OBJECT_BYTES} bytes each")
    size = _product([count, element])
    if size > self.memory_bytes:
      shown = ", ".join(map(str, values[:8])) + (
          ", ..." if len(values) > 8 else "")
      self.refuse(node, function,
                  f"takes its `{arg}` input from Const {source.name!r} = "
                  f"[{shown}]: {count:,} {what}", size)

  def override(self, node, own, function: str) -> None:
    """A gradient override that is not a string, or borrowed from an op
    whose signature the node does not share."""
    name = gradient_override(node, function, self.source)
    if name is None or name == node.op:
      return
    registered, fn = _compat.gradient_named(name)
    borrowed = self.op_def(name)
    if not registered or fn is None or borrowed is None:
      return
    misfit = _misfit(node, own, borrowed)
    if misfit is None:
      return
    raise GraphLimitError(
        f"{self.prefix}{_where(node, function)} has `_gradient_op_type` "
        f"{name!r}, the gradient TensorFlow registered for {name} ops, "
        f"which reads {_a(name)}'s attrs and inputs, but {misfit}: "
        f"tf.gradients would fail there or compute a wrong gradient, so "
        f"graphgrad does not import the graph. Remove the attr, or name a "
        f"gradient written for {node.op} (for a straight-through "
        f"estimator, gradient_override_map({{{node.op!r}: 'Identity'}})).")


def _dims(tensor_proto) -> List[int]:
  """A TensorProto's claimed dimensions (a negative one, which no tensor
  has, as 1)."""
  return [d.size if d.size >= 0 else 1 for d in tensor_proto.tensor_shape.dim]


def _shape_values(const) -> Optional[List[int]]:
  """The values of an integer or bool Const small enough to be a shape or
  a count, or ``None``."""
  if "value" not in const.attr:
    return None
  proto = const.attr["value"].tensor
  dtype = _dtype(proto.dtype)
  if (_product(_dims(proto)) > _MAX_SHAPE_VALUES or dtype is None
      or not (dtype.is_integer or dtype.is_bool)):
    return None
  try:
    return [int(v) for v in tf.make_ndarray(proto).reshape(-1).tolist()]
  except Exception:  # pylint: disable=broad-except
    return None  # not a readable tensor: the import refuses it


def _const_behind(name: str, by_name, memo: Dict[str, object]):
  """The Const that feeds ``name`` directly or through Identity ops."""
  if name in memo:
    return memo[name]
  chain, seen = [], set()
  node = by_name.get(name)
  while (node is not None and node.op == "Identity" and node.input
         and node.name not in seen and node.name not in memo):
    seen.add(node.name)
    chain.append(node.name)
    node = by_name.get(node.input[0].split(":")[0])
  if node is not None and node.name in memo:
    found = memo[node.name]
  else:
    found = node if node is not None and node.op == "Const" else None
  for n in chain + [name]:
    memo[n] = found
  return found
