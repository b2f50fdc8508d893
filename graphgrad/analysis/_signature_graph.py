"""A TF2 SavedModel's signature as one graph, its function calls inlined.

``tf.saved_model.save`` (a ``tf.Module`` or a Keras model), Keras 3's
``model.export()`` and tf-keras's ``save_format="tf"`` save functions: a
signature is one call of a function that calls others, and the variables
are captured inputs that the SavedModel's object graph describes.
graphgrad finds layers in the ops that read variables, so :func:`load`
inlines every call on the signature's path into a fresh graph (the
branches of ``If`` and ``While`` stay functions), rebuilds each captured
variable as a resource variable named and flagged as the object graph
says, and keeps each variable's object-graph node, which
:func:`checkpoint_variables` maps to the keys of a TF2 checkpoint.
"""

import collections
from typing import Any, Dict, List, NamedTuple

import tensorflow as tf

from graphgrad import _compat, _errors

# Ops that call the function in their ``f`` attr, once, with their inputs.
_CALL_TYPES = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
# Attrs naming other nodes, which inlining renames; dropped, as
# ``import_meta_graph(clear_devices=True)`` drops devices.
_DROPPED_ATTRS = ("_class",)


class SignatureError(_errors.GraphGradError, ValueError):
  """A TF2 SavedModel's signature that graphgrad cannot rebuild as a graph."""


class Signature(NamedTuple):
  """A TF2 SavedModel's signature, inlined into ``graph``.

  Attributes:
    graph: the new ``tf.Graph``.
    key: the signature's key, ``"serving_default"`` by default.
    inputs: a placeholder per signature input, named by its key.
    outputs: the signature's outputs by key.
    variables: object-graph node id -> the resource variable rebuilt for it.
    object_graph: the SavedModel's ``SavedObjectGraph``.
  """
  graph: tf.Graph
  key: str
  inputs: Dict[str, tf.Tensor]
  outputs: Dict[str, tf.Tensor]
  variables: Dict[int, tf.Variable]
  object_graph: Any


def is_tf2(meta_graph) -> bool:
  """True for a MetaGraph that TF2 saved: one with an object graph."""
  return bool(meta_graph.object_graph_def.nodes)


def signature_keys(meta_graph) -> List[str]:
  """The keys of a MetaGraph's signatures, without the init op's."""
  return sorted(k for k in meta_graph.signature_def
                if not k.startswith("__saved_model"))


def load(meta_graph, key: str = "serving_default",
         source: str = "the SavedModel") -> Signature:
  """Rebuilds signature ``key`` of a TF2 MetaGraph as a new graph.

  Args:
    meta_graph: a ``MetaGraphDef`` with an object graph (:func:`is_tf2`),
      checked by ``_graph_limits.check`` (so its calls are not recursive).
    key: the signature to rebuild.
    source: how messages name the model.

  Raises:
    SignatureError: for a missing signature, an output that is not a
      function call's, or a captured input that is neither a variable, a
      constant nor an asset.
  """
  keys = signature_keys(meta_graph)
  if not keys:
    raise SignatureError(
        f"{source} was saved without signatures, so it has no inputs and "
        f"outputs to open. Save it with one: tf.saved_model.save(obj, path, "
        f"signatures=obj.f.get_concrete_function(tf.TensorSpec(...))), or "
        f"a Keras model with model.export(path).")
  if key not in meta_graph.signature_def or key not in keys:
    raise SignatureError(
        f"--signature {key!r}: {source} has no such signature; its "
        f"signatures: {', '.join(keys) or '(none)'}. Pass one with "
        f"--signature KEY.")
  sig = meta_graph.signature_def[key]
  library = {f.signature.name: f for f in meta_graph.graph_def.library.function}
  nodes = {n.name: n for n in meta_graph.graph_def.node}
  graph = tf.Graph()
  with graph.as_default():
    inputs = {name: tf.compat.v1.placeholder(
        tf.dtypes.as_dtype(info.dtype), _shape(info.tensor_shape), name=name)
              for name, info in sorted(sig.inputs.items())}
    by_node = {info.name.split(":")[0]: inputs[name]
               for name, info in sig.inputs.items()}
    variables: Dict[int, tf.Variable] = {}
    outputs = {}
    calls: Dict[str, List[tf.Tensor]] = {}
    for out_key, info in sorted(sig.outputs.items()):
      node_name, _, index = info.name.partition(":")
      if node_name not in calls:
        call = nodes.get(node_name)
        if call is None or call.op not in _CALL_TYPES:
          raise SignatureError(
              f"--signature {key!r}: its output {out_key!r} is "
              f"{info.name!r}, which is not the output of a function call "
              f"in {source}; graphgrad opens signatures saved by "
              f"tf.saved_model.save or Keras.")
        args = _call_inputs(call, meta_graph, nodes, by_node, variables,
                            source)
        calls[node_name] = _inline_call(call, args, library, meta_graph)
      outputs[out_key] = tf.identity(calls[node_name][int(index or 0)],
                                     name=f"{key}/{out_key}")
  return Signature(graph, key, inputs, outputs, variables,
                   meta_graph.object_graph_def)


def _shape(proto) -> tf.TensorShape:
  if proto.unknown_rank:
    return tf.TensorShape(None)
  return tf.TensorShape([None if d.size < 0 else d.size for d in proto.dim])


def _call_inputs(call, meta_graph, nodes, by_node, variables,
                 source: str) -> List[tf.Tensor]:
  """The tensors the signature's call takes: the signature's placeholders,
  then its captures rebuilt from the object graph."""
  functions = meta_graph.object_graph_def.concrete_functions
  fname = call.attr["f"].func.name
  bound = list(functions[fname].bound_inputs) if fname in functions else []
  data = [i for i in call.input if not i.startswith("^")]
  captured = data[len(data) - len(bound):] if bound else []
  args = []
  for name in data[:len(data) - len(captured)]:
    node_name = name.split(":")[0]
    if node_name not in by_node:
      raise SignatureError(
          f"the signature's call {call.name!r} in {source} takes {name!r}, "
          f"which is neither a signature input nor a captured object.")
    args.append(by_node[node_name])
  for name, node_id in zip(captured, bound):
    args.append(_captured(node_id, name, meta_graph, nodes, variables,
                          source))
  return args


def _captured(node_id: int, name: str, meta_graph, nodes, variables,
              source: str) -> tf.Tensor:
  """The tensor for captured object ``node_id`` (graph node ``name``)."""
  objects = meta_graph.object_graph_def.nodes
  if not 0 <= node_id < len(objects):
    raise SignatureError(
        f"the signature captures object {node_id}, which {source}'s object "
        f"graph of {len(objects)} nodes does not hold.")
  obj = objects[node_id]
  kind = obj.WhichOneof("kind")
  if kind == "variable":
    if node_id not in variables:
      saved = obj.variable
      shape = _shape(saved.shape)
      dtype = tf.dtypes.as_dtype(saved.dtype)
      initial = tf.zeros([d or 0 for d in shape.as_list()]
                         if shape.rank is not None else [], dtype)
      variables[node_id] = tf.compat.v1.Variable(
          initial, name=saved.name or name.split(":")[0],
          trainable=saved.trainable, use_resource=True,
          shape=shape, validate_shape=shape.is_fully_defined())
    return variables[node_id].handle
  if kind == "constant":
    const = nodes.get(obj.constant.operation)
    if const is not None and const.op == "Const":
      return tf.constant(tf.make_ndarray(const.attr["value"].tensor),
                         name=const.name)
  if kind == "asset":
    files = meta_graph.asset_file_def
    index = obj.asset.asset_file_def_index
    if 0 <= index < len(files):
      return tf.constant(files[index].filename, name="asset")
  raise SignatureError(
      f"the signature captures {name!r}, a {kind or 'nameless object'} in "
      f"the object graph of {source}; graphgrad rebuilds captured variables, "
      f"constants and assets only (a lookup table or another resource is "
      f"not rebuilt). Open a model whose signature captures none.")


def _inline_call(call, args: List[tf.Tensor], library, meta_graph
                 ) -> List[tf.Tensor]:
  """Imports ``call``'s function, every call in it inlined, fed ``args``.

  The body's nodes keep their names (``functional_1/fc0/MatMul``), made
  unique against the graph and each other by a ``_1`` suffix, as TensorFlow
  names ops, so layers and their boundaries read as the model named them.
  """
  fdef = library.get(call.attr["f"].func.name)
  if fdef is None:
    raise SignatureError(
        f"the call {call.name!r} names function "
        f"{call.attr['f'].func.name!r}, which the library does not hold.")
  graph = tf.compat.v1.get_default_graph()
  inliner = _Inliner(library, {op.name for op in graph.get_operations()})
  graph_def = tf.compat.v1.GraphDef()
  graph_def.versions.CopyFrom(meta_graph.graph_def.versions)
  graph_def.library.CopyFrom(meta_graph.graph_def.library)
  arg_names = []
  for arg in fdef.signature.input_arg:
    node = graph_def.node.add(name=inliner.unique("graphgrad_arg"),
                              op="Placeholder")
    node.attr["dtype"].type = arg.type
    arg_names.append(node.name)
  outputs = inliner.function(fdef, arg_names, 0)
  graph_def.node.extend(inliner.nodes)
  input_map = {f"{n}:0": t for n, t in zip(arg_names, args)}
  try:
    return tf.import_graph_def(graph_def, input_map=input_map,
                               return_elements=outputs, name="")
  except (ValueError, TypeError, tf.errors.OpError) as e:
    first = (str(e).strip().splitlines() or [""])[0][:200]
    raise SignatureError(
        f"TensorFlow {tf.__version__} cannot import the function "
        f"{fdef.signature.name!r} that the signature calls "
        f"({first}).") from None


class _Inliner:
  """Flattens function bodies into graph nodes, inlining their calls."""

  def __init__(self, library, taken):
    self.library = library
    self.taken = set(taken)
    self.nodes: List = []

  def unique(self, name: str) -> str:
    """``name``, or ``name_1``, ``name_2``... when it is taken."""
    found, i = name, 0
    while found in self.taken:
      i += 1
      found = f"{name}_{i}"
    self.taken.add(found)
    return found

  def function(self, fdef, args: List[str], depth: int) -> List[str]:
    """Adds ``fdef``'s nodes, its inputs wired to ``args`` (tensor names),
    its calls inlined; returns the tensor names of its outputs."""
    if depth > 100:  # _graph_limits refuses deeper chains before import
      raise SignatureError(f"function {fdef.signature.name!r} nests calls "
                           f"more than 100 deep.")
    arg_of = {a.name: t for a, t in zip(fdef.signature.input_arg, args)}
    body = {n.name: n for n in fdef.node_def}
    named: Dict[str, str] = {}            # body node -> graph node
    inlined: Dict[str, List[str]] = {}    # body call -> its outputs

    def refs(ref: str) -> List[str]:
      """The graph's names for input ``ref`` of the function's body."""
      if ref.startswith("^"):
        name = ref[1:]
        if name in inlined:  # a control input on an inlined call
          return ["^" + o.split(":")[0] for o in inlined[name]]
        return ["^" + named[name]]
      if ref in arg_of:
        return [arg_of[ref]]
      name, out_arg, index = (ref.split(":") + ["", ""])[:3]
      if name not in body:
        raise SignatureError(
            f"function {fdef.signature.name!r} reads {ref!r}, which is "
            f"neither its argument nor one of its nodes.")
      flat = _flat_index(body[name], out_arg, int(index or 0), self.library)
      if name in inlined:
        return [inlined[name][flat]]
      return [f"{named[name]}:{flat}"]

    for node in _topological(fdef.node_def):
      if _is_call(node, self.library):
        callee = self.library[node.attr["f"].func.name
                              if node.op in _CALL_TYPES else node.op]
        data = [refs(i)[0] for i in node.input if not i.startswith("^")]
        inlined[node.name] = self.function(callee, data, depth + 1)
        continue
      copy = tf.compat.v1.NodeDef()
      copy.CopyFrom(node)
      copy.name = named[node.name] = self.unique(node.name)
      del copy.input[:]
      for ref in node.input:
        copy.input.extend(refs(ref))
      copy.device = ""
      for attr in _DROPPED_ATTRS:
        if attr in copy.attr:
          del copy.attr[attr]
      self.nodes.append(copy)
    return [refs(fdef.ret[a.name])[0] for a in fdef.signature.output_arg]


def _is_call(node, library) -> bool:
  if node.op in _CALL_TYPES:
    return node.attr["f"].func.name in library
  return node.op in library


def _topological(node_defs) -> List:
  """``node_defs`` ordered so every node comes after its inputs (a
  FunctionDef's order is free)."""
  by_name = {n.name: n for n in node_defs}
  waiting: Dict[str, int] = collections.Counter()
  users = collections.defaultdict(list)
  for n in node_defs:
    for ref in n.input:
      src = ref.lstrip("^").split(":")[0]
      if src in by_name:
        waiting[n.name] += 1
        users[src].append(n.name)
  ready = [n.name for n in node_defs if not waiting[n.name]]
  order = []
  while ready:
    name = ready.pop()
    order.append(by_name[name])
    for user in users[name]:
      waiting[user] -= 1
      if not waiting[user]:
        ready.append(user)
  if len(order) != len(node_defs):
    raise SignatureError("a function of the SavedModel has a cycle among its "
                         "nodes outside any loop.")
  return order


def _flat_index(node, out_arg: str, index: int, library) -> int:
  """The flat output index of ``node``'s output ``out_arg:index``: the
  sizes of the output args before it, read from the op's signature."""
  if node.op in _CALL_TYPES:
    return index
  if node.op in library:
    names = [a.name for a in library[node.op].signature.output_arg]
    return names.index(out_arg) if out_arg in names else index
  op_def = _compat.op_def(node.op)
  if op_def is None:
    raise SignatureError(
        f"node {node.name!r} has op type {node.op!r}, which this TensorFlow "
        f"does not register, so its outputs cannot be wired.")
  flat = 0
  for arg in op_def.output_arg:
    if arg.name == out_arg:
      return flat + index
    flat += _arg_size(node, arg, op_def)
  raise SignatureError(f"node {node.name!r} ({node.op}) has no output "
                       f"{out_arg!r}.")


def _arg_size(node, arg, op_def) -> int:
  def attr(name):
    if name in node.attr:
      return node.attr[name]
    return next((a.default_value for a in op_def.attr if a.name == name),
                None)
  if arg.number_attr:
    value = attr(arg.number_attr)
    return value.i if value is not None else 1
  if arg.type_list_attr:
    value = attr(arg.type_list_attr)
    return len(value.list.type) if value is not None else 0
  return 1


def checkpoint_variables(signature: Signature, reader, source: str
                         ) -> Dict[str, tf.Variable]:
  """Checkpoint key -> variable, for a TF2 checkpoint of the same objects.

  A TF2 checkpoint keys each variable by its path in the checkpoint's own
  object graph; both graphs are walked from the root by child names.

  Args:
    signature: the loaded signature.
    reader: a ``tf.train.load_checkpoint`` reader of the checkpoint.
    source: how messages name the checkpoint.

  Raises:
    SignatureError: if the checkpoint has no object graph, or lacks one of
      the signature's variables.
  """
  from tensorflow.core.protobuf import trackable_object_graph_pb2  # pylint: disable=g-import-not-at-top
  key = "_CHECKPOINTABLE_OBJECT_GRAPH"
  if not reader.has_tensor(key):
    raise SignatureError(
        f"{source} is a name-based (TF1) checkpoint, which keys variables "
        f"by name; a TF2 SavedModel's variables are restored from a TF2 "
        f"checkpoint (tf.train.Checkpoint, or the model's variables/).")
  ckpt = trackable_object_graph_pb2.TrackableObjectGraph()
  ckpt.ParseFromString(reader.get_tensor(key))
  saved = signature.object_graph
  pairs = {0: 0}
  queue = [0]
  while queue:
    node = queue.pop(0)
    ckpt_children = {c.local_name: c.node_id
                     for c in ckpt.nodes[pairs[node]].children}
    for child in saved.nodes[node].children:
      if child.node_id not in pairs and child.local_name in ckpt_children:
        pairs[child.node_id] = ckpt_children[child.local_name]
        queue.append(child.node_id)
  found = {}
  for node_id, variable in signature.variables.items():
    keys = [a.checkpoint_key for a in ckpt.nodes[pairs[node_id]].attributes
            if a.name == "VARIABLE_VALUE"] if node_id in pairs else []
    if not keys or not reader.has_tensor(keys[0]):
      raise SignatureError(
          f"{source} holds no value for the variable {variable.op.name!r}: "
          f"it is a checkpoint of other objects. Pass the model's own "
          f"variables/ or a checkpoint of the same model.")
    found[keys[0]] = variable
  return found
