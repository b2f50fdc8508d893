"""Small helpers on tf.Graph structure (ops, tensors, variables).

Shared by analysis and plan.
"""

import collections
import weakref
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import tensorflow as tf

from graphgrad import _compat

_VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable"})

# graph -> {op: its index in graph.get_operations()}, which lists ops in
# creation order; ops are never removed, so the index only grows.
_ORDERS: "weakref.WeakKeyDictionary[tf.Graph, Dict[tf.Operation, int]]" = (
    weakref.WeakKeyDictionary())


def op_id(op: tf.Operation) -> int:
  """The op's creation index in its graph.

  Example:
    >>> with tf.Graph().as_default():
    ...   a = tf.constant(1.0); b = a + 1.0
    ...   op_id(a.op) < op_id(b.op)
    True
  """
  graph = op.graph
  index = _ORDERS.get(graph)
  if index is None:
    index = _ORDERS.setdefault(graph, {})
  found = index.get(op)
  if found is None:
    ops = graph.get_operations()
    for i in range(len(index), len(ops)):
      index[ops[i]] = i
    found = index[op]
  return found


def is_ref_dtype(dtype: tf.DType) -> bool:
  """True for a reference dtype (``float32_ref``), a TF1 ref variable's.

  Example:
    >>> with tf.Graph().as_default():
    ...   v = tf.compat.v1.Variable(1.0, use_resource=False)
    ...   is_ref_dtype(v.dtype), is_ref_dtype(tf.float32)
    (True, False)
  """
  return dtype.base_dtype != dtype


def is_variable_op(op: tf.Operation) -> bool:
  """True for the op that holds a variable (resource handle or ref)."""
  return op.type in _VARIABLE_OPS


def is_handle(t: tf.Tensor) -> bool:
  """True for a variable handle or reference tensor: a parameter, not data."""
  return t.dtype == tf.resource or is_ref_dtype(t.dtype)


def differentiable(t: tf.Tensor) -> bool:
  """True for a tensor a gradient can flow to: floating or complex data."""
  return (t.dtype.is_floating or t.dtype.is_complex) and not is_handle(t)


def shape_text(shape) -> str:
  """``[?,3]``-style text of a static shape; ``[?]`` for an unknown rank."""
  dims = tf.TensorShape(shape)
  if dims.rank is None:
    return "[?]"
  return "[" + ",".join("?" if d is None else str(d)
                        for d in dims.as_list()) + "]"


_HANDLE_FORWARDING_OPS = frozenset({
    "Enter", "RefEnter", "Identity", "RefIdentity", "Switch", "RefSwitch"})


def variable_of_handle(t: tf.Tensor) -> Optional[str]:
  """Name of the variable op behind a handle, through loop ``Enter`` ops."""
  op = t.op
  while op.type in _HANDLE_FORWARDING_OPS and op.inputs:
    op = op.inputs[0].op
  return op.name if op.type in _VARIABLE_OPS else None


def read_variable_source(op: tf.Operation) -> Optional[str]:
  """Name of the variable op that ``op`` reads whole, else ``None``."""
  if op.type == "ReadVariableOp" and op.inputs:
    return variable_of_handle(op.inputs[0])
  if (op.type == "Identity" and op.inputs
      and op.inputs[0].op.type in _VARIABLE_OPS):
    return op.inputs[0].op.name
  return None


def is_back_edge(t: tf.Tensor, op: tf.Operation) -> bool:
  """True for a ``tf.compat.v1`` while loop's ``NextIteration -> Merge``."""
  return (op.type in ("Merge", "RefMerge")
          and t.op.type in ("NextIteration", "RefNextIteration"))


def data_inputs(op: tf.Operation) -> List[tf.Tensor]:
  """The op's data inputs, without TF1 loop back-edges.

  A ``Merge`` of a ``tf.compat.v1`` while loop takes its ``NextIteration``
  as input; that edge makes the graph cyclic. The op graph leaves it out to
  stay a DAG; walks that must reach a loop body use ``op.inputs``.
  """
  if op.type in ("Merge", "RefMerge"):
    return [t for t in op.inputs
            if t.op.type not in ("NextIteration", "RefNextIteration")]
  return list(op.inputs)


def forward_ops(loss: tf.Tensor) -> List[tf.Operation]:
  """Every op that ``loss`` depends on through data inputs, in graph order."""
  seen: Set[str] = {loss.op.name}
  found = [loss.op]
  stack = [loss.op]
  while stack:
    op = stack.pop()
    for t in op.inputs:
      if t.op.name not in seen:
        seen.add(t.op.name)
        found.append(t.op)
        stack.append(t.op)
  found.sort(key=op_id)
  return found


def forward_consumers(fwd_ops: Iterable[tf.Operation]
                      ) -> Dict[str, List[tf.Operation]]:
  """Maps tensor name -> its consumers among ``fwd_ops``."""
  result: Dict[str, List[tf.Operation]] = collections.defaultdict(list)
  for op in fwd_ops:
    for t in op.inputs:
      result[t.name].append(op)
  return result


def trainable_variables(graph: tf.Graph) -> List[tf.Variable]:
  """The graph's trainable variables, deduplicated, in creation order."""
  found, seen = [], set()
  for key in (tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES,
              tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES):
    for v in graph.get_collection(key):
      if isinstance(v, tf.Variable) and v.op.name not in seen:
        seen.add(v.op.name)
        found.append(v)
  return found


def in_control_flow(op: tf.Operation) -> bool:
  """True when ``op``'s outputs live inside a ``tf.compat.v1`` loop or cond.

  A loop's ``Exit`` sits in the loop's context, but its output is outside.
  """
  ctx = _compat.control_flow_context(op)
  if ctx is not None and op.type in ("Exit", "RefExit"):
    ctx = ctx.outer_context
  return ctx is not None


def ops_behind(start: Iterable[tf.Operation], floor: int,
               follow: Optional[Callable[[tf.Tensor], bool]] = None
               ) -> Set[tf.Operation]:
  """The ops ``start`` depends on through inputs ``follow`` accepts.

  Ops created before op id ``floor`` (see :func:`op_id`) are not
  entered. ``follow=None`` follows every input.
  """
  seen: Set[tf.Operation] = set()
  stack = list(start)
  while stack:
    op = stack.pop()
    if op in seen or op_id(op) < floor:
      continue
    seen.add(op)
    stack.extend(t.op for t in op.inputs if follow is None or follow(t))
  return seen


def function_names(values: Iterable) -> List[str]:
  """The functions that attr values (``AttrValue`` protos) name, at any
  depth, in order: a ``func``, each ``func`` of a list, and those that
  their own attrs name (a ``NameAttrList`` carries attrs, which can be
  functions too: the call's bindings of the function's attrs, which the
  callee reaches through a placeholder, ``$inner``, in its body).

  Example:
    >>> from tensorflow.core.framework import attr_value_pb2
    >>> value = attr_value_pb2.AttrValue()
    >>> value.func.name = "outer"
    >>> value.func.attr["inner"].list.func.add().name = "inner_fn"
    >>> function_names([value])
    ['outer', 'inner_fn']
  """
  names: List[str] = []
  # (True, a NameAttrList) or (False, an AttrValue), depth first.
  stack: list = [(False, v) for v in values][::-1]
  while stack:
    is_func, item = stack.pop()
    if is_func:
      names.append(item.name)
      stack += [(False, item.attr[k]) for k in sorted(item.attr, reverse=True)]
      continue
    kind = item.WhichOneof("value")
    funcs = ([item.func] if kind == "func" else
             list(item.list.func) if kind == "list" else [])
    stack += [(True, f) for f in funcs[::-1]]
  return names


def called_functions(node_def, library: Mapping) -> List[str]:
  """The library functions a node calls: by its op type, or named anywhere
  in its attrs (a branch, a body, a dataset function, a list, or a
  function-valued attr inside another's attrs).

  A function bound to a callee's attr only reaches a node of the callee
  through a placeholder; counting every function named in the node's attrs
  as called covers that binding without resolving placeholders.
  """
  names = [node_def.op] if node_def.op in library else []
  return names + function_names(node_def.attr[k]
                                for k in sorted(node_def.attr))


def linked_functions(name: str, library: Mapping) -> List[Tuple[str, str]]:
  """The functions that can run as part of function ``name`` although no
  node of it names them: ``(how, function name)`` pairs.

  They are the functions named in the attrs of its definition rather than
  its nodes (a default of a signature attr, which a node's placeholder
  takes when the call binds nothing, a function attr, an argument attr),
  and the other library functions with the same ``api_implements``: at
  run time, TensorFlow's implementation selector (Grappler) may swap a call
  of one for another, the one whose ``api_preferred_device`` matches the
  call's device.

  Example:
    >>> from tensorflow.core.framework import function_pb2
    >>> lib = {n: function_pb2.FunctionDef() for n in ("f", "gpu", "cpu")}
    >>> attr = lib["f"].signature.attr.add(name="inner", type="func")
    >>> attr.default_value.func.name = "gpu"
    >>> linked_functions("f", lib)
    [("the default of its attr 'inner'", 'gpu')]
    >>> for n in ("gpu", "cpu"):
    ...   lib[n].attr["api_implements"].s = b"sum"
    >>> linked_functions("gpu", lib)
    [("may be swapped for another of api_implements 'sum'", 'cpu')]
  """
  fdef = library.get(name)
  if fdef is None:
    return []
  found = definition_functions(fdef)
  api = _api_implements(fdef)
  if api:
    how = (f"may be swapped for another of api_implements "
           f"{api.decode(errors='replace')!r}")
    found += [(how, other) for other in sorted(library)
              if other != name and _api_implements(library[other]) == api]
  return found


def definition_functions(fdef) -> List[Tuple[str, str]]:
  """The functions a ``FunctionDef``'s definition names rather than its
  nodes: ``(how, function name)`` pairs, from the defaults of its
  signature's attrs, its own attrs and its arguments' attrs."""
  found = [(f"the default of its attr {a.name!r}", n)
           for a in fdef.signature.attr
           for n in function_names([a.default_value])]
  found += [(f"its attr {key!r}", n) for key in sorted(fdef.attr)
            for n in function_names([fdef.attr[key]])]
  for index in sorted(fdef.arg_attr):
    attrs = fdef.arg_attr[index].attr
    found += [(f"attr {key!r} of its argument {index}", n)
              for key in sorted(attrs) for n in function_names([attrs[key]])]
  return found


def _api_implements(fdef) -> bytes:
  """The function's ``api_implements`` attr, ``b""`` if it has none (read
  without adding the key to the proto's map)."""
  return fdef.attr["api_implements"].s if "api_implements" in fdef.attr else b""


def called_node(calls: List[tf.Operation], match: Callable[[str], bool],
                library: Optional[Mapping] = None):
  """The first node whose op type ``match`` accepts in a function that
  ``calls`` call (a ``tf.function``'s body, a v2 cond's branch), or in a
  function those call or link to (:func:`called_functions`,
  :func:`linked_functions`): ``(the function's name, the NodeDef)``, or
  ``None``.

  Args:
    calls: ops of one tf.Graph that call functions.
    match: op type -> whether it is the one looked for.
    library: the graph's functions by name, if already read.
  """
  if not calls:
    return None
  if library is None:
    library = {f.signature.name: f for f in
               calls[0].graph.as_graph_def().library.function}
  todo = [n for op in calls for n in called_functions(op.node_def, library)]
  seen: Set[str] = set()
  while todo:
    name = todo.pop()
    if name in seen or name not in library:
      continue
    seen.add(name)
    for node in library[name].node_def:
      if match(node.op):
        return name, node
      todo += called_functions(node, library)
    todo += [n for _, n in linked_functions(name, library)]
  return None


def calls_node(calls: List[tf.Operation], match: Callable[[str], bool]
               ) -> bool:
  """Whether :func:`called_node` finds a node ``match`` accepts."""
  return called_node(calls, match) is not None
