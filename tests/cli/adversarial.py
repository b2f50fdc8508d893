"""Crafted saved graphs that try to touch files, the network, or the process.

Each builder writes a ``.meta`` under ``folder`` and returns its path; the
graph is x -> l1 -> (the attack) -> loss, so ``graphgrad grads`` runs the
attack on its forward pass. ``target`` is a file the attack would write, or
a secret it would read. Shared by the sandbox's tests, which run each graph
with graphgrad's own checks and, with ``--no-checks``, with the sandbox
alone.
"""

import os

import tensorflow as tf
from tensorflow.core.framework import function_pb2, types_pb2

tf1 = tf.compat.v1


def _save(folder, name, attack, edit=None):
  """x -> l1 -> attack(h) -> loss, exported to ``folder/name.meta``;
  ``edit(meta_graph_def)`` may change the proto before it is written."""
  path = os.path.join(str(folder), f"{name}.meta")
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    w = tf1.get_variable("l1/kernel", [3, 2],
                         initializer=tf1.constant_initializer(0.5))
    h = attack(tf.matmul(x, w, name="l1/MatMul"))
    loss = tf.reduce_mean(tf.square(h), name="loss")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    meta = tf1.train.export_meta_graph()
  if edit is not None:
    edit(meta)
  with open(path, "wb") as f:
    f.write(meta.SerializeToString())
  return path


def _after(h, op):
  """``h``, computed only after ``op`` ran."""
  with tf.control_dependencies([op]):
    return tf.identity(h)


def _uses(h, value):
  """``h`` plus zero times ``value``'s sum: ``value`` runs."""
  return h + 0.0 * tf.cast(tf.reduce_sum(value), tf.float32)


def write_file(folder, target):
  return _save(folder, "write_file", lambda h: _after(
      h, tf.io.write_file(str(target), "written")))


def print_to_file(folder, target):
  return _save(folder, "print_to_file", lambda h: _after(
      h, tf.print("written", output_stream=f"file://{target}")))


def save_v2(folder, target):
  return _save(folder, "save_v2", lambda h: _after(
      h, tf.raw_ops.SaveV2(prefix=str(target), tensor_names=["h"],
                           shape_and_slices=[""], tensors=[h])))


def read_file(folder, secret):
  return _save(folder, "read_file", lambda h: _uses(
      h, tf.strings.length(tf.io.read_file(str(secret)))))


def whole_file_reader(folder, secret):
  def attack(h):
    reader = tf.raw_ops.WholeFileReaderV2()
    queue = tf.raw_ops.FIFOQueueV2(component_types=[tf.string])
    enqueue = tf.raw_ops.QueueEnqueueV2(handle=queue,
                                        components=[tf.constant(str(secret))])
    with tf.control_dependencies([enqueue]):
      _, value = tf.raw_ops.ReaderReadV2(reader_handle=reader,
                                         queue_handle=queue)
    return _uses(h, tf.strings.length(value))
  return _save(folder, "whole_file_reader", attack)


def list_files(folder, target):
  return _save(folder, "list_files", lambda h: _uses(
      h, tf.strings.length(tf.io.matching_files(
          os.path.join(os.path.dirname(str(target)), "*")))))


def vocab_file(folder, secret):
  """FixedUnigramCandidateSampler opens the file its attr names."""
  return _save(folder, "vocab_file", lambda h: _uses(
      h, tf.raw_ops.FixedUnigramCandidateSampler(
          true_classes=tf.zeros([1, 1], tf.int64), num_true=1, num_sampled=1,
          unique=True, range_max=2, vocab_file=str(secret))[0]))


def write_in_nested_function(folder, target):
  """A function reached only through a function-valued attr nested in
  another call's attrs: ``f={name: outer, attr: {inner: evil}}``."""
  def attack(h):
    return tf.identity(h, name="call_site")

  def edit(meta):
    lib = meta.graph_def.library
    evil = lib.function.add()
    evil.signature.name = "evil"
    _signature(evil)
    write = evil.node_def.add()
    write.name, write.op = "w", "WriteFile"
    write.input.extend(["filename:output:0", "contents:output:0"])
    for name, value in (("filename", str(target)), ("contents", "written")):
      const = evil.node_def.add()
      const.name, const.op = name, "Const"
      const.attr["dtype"].type = types_pb2.DT_STRING
      const.attr["value"].tensor.dtype = types_pb2.DT_STRING
      const.attr["value"].tensor.string_val.append(value.encode())
    ident = evil.node_def.add()
    ident.name, ident.op = "out", "Identity"
    ident.input.extend(["a", "^w"])
    ident.attr["T"].type = types_pb2.DT_FLOAT
    evil.ret["o"] = "out:output:0"
    outer = lib.function.add()
    outer.signature.name = "outer"
    _signature(outer)
    inner = outer.signature.attr.add()
    inner.name, inner.type = "inner", "func"
    call = outer.node_def.add()
    call.name, call.op = "call", "PartitionedCall"
    call.input.append("a")
    call.attr["Tin"].list.type.append(types_pb2.DT_FLOAT)
    call.attr["Tout"].list.type.append(types_pb2.DT_FLOAT)
    call.attr["f"].placeholder = "inner"
    outer.ret["o"] = "call:output:0"
    node = next(n for n in meta.graph_def.node if n.name == "call_site")
    node.op = "PartitionedCall"
    node.attr.clear()
    node.attr["Tin"].list.type.append(types_pb2.DT_FLOAT)
    node.attr["Tout"].list.type.append(types_pb2.DT_FLOAT)
    node.attr["f"].func.name = "outer"
    node.attr["f"].func.attr["inner"].func.name = "evil"
  return _save(folder, "write_in_nested_function", attack, edit)


def _signature(fdef: function_pb2.FunctionDef) -> None:
  arg = fdef.signature.input_arg.add()
  arg.name, arg.type = "a", types_pb2.DT_FLOAT
  out = fdef.signature.output_arg.add()
  out.name, out.type = "o", types_pb2.DT_FLOAT


def _call_site(h):
  """An identity named ``call_site``, which an edit turns into a call."""
  return tf.identity(h, name="call_site")


def _call_site_calls(meta, function: str) -> None:
  """``call_site`` becomes a call of the library function ``function``."""
  node = next(n for n in meta.graph_def.node if n.name == "call_site")
  node.op = function
  node.attr.clear()


def recursive_function(folder, target=None):
  """A function that calls itself: TensorFlow recurses while importing."""
  del target

  def edit(meta):
    rec = meta.graph_def.library.function.add()
    rec.signature.name = "rec"
    _signature(rec)
    call = rec.node_def.add()
    call.name, call.op = "again", "rec"
    call.input.append("a")
    rec.ret["o"] = "again:o:0"
    _call_site_calls(meta, "rec")
  return _save(folder, "recursive_function", _call_site, edit)


def huge_tensor_array(folder, target=None):
  del target
  return _save(folder, "huge_tensor_array", lambda h: _uses(
      h, tf.raw_ops.TensorArrayV3(size=tf.constant(2**31 - 1),
                                  dtype=tf.float32)[1]))


def endless_allocation(folder, target=None):
  """A loop that doubles a tensor until memory runs out."""
  del target
  return _save(folder, "endless_allocation", lambda h: _uses(
      h, tf.while_loop(lambda v: tf.size(v) > 0,
                       lambda v: tf.concat([v, v], 0), [tf.ones([1024])],
                       shape_invariants=[tf.TensorShape([None])])))


def endless_loop(folder, target=None):
  del target
  return _save(folder, "endless_loop", lambda h: _uses(
      h, tf.while_loop(lambda i: i >= 0, lambda i: i + 1,
                       [tf.constant(0)])))


# Graphs that try to touch ``target`` (write it, or read it as a secret).
TOUCHING = {
    "write_file": write_file,
    "print_to_file": print_to_file,
    "save_v2": save_v2,
    "read_file": read_file,
    "whole_file_reader": whole_file_reader,
    "list_files": list_files,
    "vocab_file": vocab_file,
    "write_in_nested_function": write_in_nested_function,
}
# Graphs that try to crash or exhaust the process.
EXHAUSTING = {
    "recursive_function": recursive_function,
    "huge_tensor_array": huge_tensor_array,
    "endless_allocation": endless_allocation,
    "endless_loop": endless_loop,
}


def write_by_signature_default(folder, target):
  """The function that writes is only the default of a signature attr of
  the function the graph calls; no node names it."""
  path = write_in_nested_function(folder, target)
  meta = tf1.MetaGraphDef()
  with open(path, "rb") as f:
    meta.ParseFromString(f.read())
  outer = next(f for f in meta.graph_def.library.function
               if f.signature.name == "outer")
  outer.signature.attr[0].default_value.func.name = "evil"
  node = next(n for n in meta.graph_def.node if n.name == "call_site")
  node.attr["f"].func.attr.clear()
  path = os.path.join(str(folder), "write_by_signature_default.meta")
  with open(path, "wb") as f:
    f.write(meta.SerializeToString())
  return path


def write_on_restore(folder, target):
  """A variable's handle op waits for a write: restoring the checkpoint
  runs it. Returns ``(meta, checkpoint prefix)``."""
  prefix = os.path.join(str(folder), "restore.ckpt")
  with tf.Graph().as_default():
    w = tf1.get_variable("l1/kernel", [3, 2],
                         initializer=tf1.constant_initializer(0.5))
    with tf1.Session() as sess:
      sess.run(w.initializer)
      tf1.train.Saver().save(sess, prefix)

  def attack(h):
    tf.io.write_file(str(target), "written", name="hidden_write")
    return h

  def edit(meta):
    handle = next(n for n in meta.graph_def.node if n.name == "l1/kernel")
    handle.input.append("^hidden_write")
  return _save(folder, "write_on_restore", attack, edit), prefix


def huge_placeholder(folder, target=None):
  """A placeholder of [100000, 100000, 100] floats: grads would feed as
  much."""
  del target
  return _save(folder, "huge_placeholder", lambda h: _uses(
      h, tf1.placeholder(tf.float32, [100000, 100000, 100], name="big")))


def _gradient_override(folder, name, value):
  """l1's MatMul carries ``value`` (an ``AttrValue`` field and its
  content) as its ``_gradient_op_type``."""
  field, content = value

  def edit(meta):
    node = next(n for n in meta.graph_def.node if n.name == "l1/MatMul")
    setattr(node.attr["_gradient_op_type"], field, content)
  return _save(folder, name, lambda h: h, edit)


def gradient_override_of_int(folder, target=None):
  """``_gradient_op_type`` must be a string; this one is an int."""
  del target
  return _gradient_override(folder, "gradient_override_of_int", ("i", 7))


def chain_of_functions(folder, target=None, length=5000):
  """f0 calls f1 calls ... f4999."""
  del target

  def edit(meta):
    lib = meta.graph_def.library
    for i in range(length):
      f = lib.function.add()
      f.signature.name = f"f{i}"
      _signature(f)
      node = f.node_def.add()
      node.name = "next"
      if i + 1 < length:
        node.op = f"f{i + 1}"
        node.input.append("a")
        f.ret["o"] = "next:o:0"
      else:
        node.op = "Identity"
        node.input.append("a")
        node.attr["T"].type = types_pb2.DT_FLOAT
        f.ret["o"] = "next:output:0"
    _call_site_calls(meta, "f0")
  return _save(folder, "chain_of_functions", _call_site, edit)


def corrupt_saved_model(folder, target=None):
  del target
  path = os.path.join(str(folder), "corrupt_saved_model")
  os.makedirs(path)
  with open(os.path.join(path, "saved_model.pb"), "wb") as f:
    f.write(b"\x0a\xff\xff\xff\xff\x0f not a protocol buffer")
  return path


def gradient_override_not_utf8(folder, target=None):
  del target
  return _gradient_override(folder, "gradient_override_not_utf8",
                            ("s", b"\xff\xfe"))


def gradient_borrowed_from_conv2d(folder, target=None):
  """MatMul claims Conv2D's registered gradient, which reads attrs a
  MatMul lacks."""
  del target
  return _gradient_override(folder, "gradient_borrowed_from_conv2d",
                            ("s", b"Conv2D"))


def frozen_const_bomb(folder, target=None):
  """A frozen GraphDef of a few hundred bytes whose Const claims 1e10
  floats."""
  del target
  graph_def = tf1.GraphDef()
  const = graph_def.node.add(name="big", op="Const")
  const.attr["dtype"].type = types_pb2.DT_FLOAT
  const.attr["value"].tensor.dtype = types_pb2.DT_FLOAT
  const.attr["value"].tensor.tensor_shape.dim.add().size = 10**10
  const.attr["value"].tensor.float_val.append(1.0)
  out = graph_def.node.add(name="y", op="Identity", input=["big"])
  out.attr["T"].type = types_pb2.DT_FLOAT
  path = os.path.join(str(folder), "frozen_const_bomb.pb")
  with open(path, "wb") as f:
    f.write(graph_def.SerializeToString())
  return path


# -- SavedModels: the attack inside functions, the restore and the init op --


class _Module(tf.Module):
  """A tf.Module whose ``f(x)`` is ``body(x, v)`` for its variable ``v``."""

  def __init__(self, body):
    super().__init__()
    self.v = tf.Variable([[0.5, -0.5], [1.0, 2.0]], name="v")
    self.body = body

  @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32)])
  def f(self, x):
    return self.body(x, self.v)


def _save_module(folder, name, body):
  """``tf.saved_model.save`` of a :class:`_Module` to ``folder/name``."""
  path = os.path.join(str(folder), name)
  tf.saved_model.save(_Module(body), path)
  return path


def clean_functional_control_flow(folder, target=None):
  """A TF2 SavedModel whose function holds a ``cond`` and a ``while``."""
  del target

  def body(x, v):
    y = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.matmul(x, v),
                lambda: tf.matmul(x, -v))
    return tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2.0),
                         [tf.constant(0), y])[1]
  return _save_module(folder, "clean_functional_control_flow", body)


def print_in_cond_branch(folder, target):
  """PrintV2 to ``file://target`` in the true branch of a ``cond`` of a
  ``tf.function``."""
  def body(x, v):
    def then():
      tf.print("written", output_stream=f"file://{target}")
      return tf.matmul(x, v)
    return tf.cond(tf.reduce_sum(x) > 0, then, lambda: tf.matmul(x, -v))
  return _save_module(folder, "print_in_cond_branch", body)


def save_in_while_body(folder, target):
  """SaveV2 of ``target`` in the body of a ``while`` of a ``tf.function``."""
  def body(x, v):
    def step(i, y):
      tf.raw_ops.SaveV2(prefix=str(target), tensor_names=["y"],
                        shape_and_slices=[""], tensors=[y])
      return i + 1, y * 2.0
    return tf.while_loop(lambda i, y: i < 2, step,
                         [tf.constant(0), tf.matmul(x, v)])[1]
  return _save_module(folder, "save_in_while_body", body)


def write_in_dataset_function(folder, target):
  """WriteFile in the ``map`` function of a dataset a ``tf.function``
  reduces."""
  def body(x, v):
    def write(i):
      with tf.control_dependencies([tf.io.write_file(str(target), "w")]):
        return tf.identity(i)
    total = tf.data.Dataset.range(2).map(write).reduce(
        tf.constant(0, tf.int64), lambda a, b: a + b)
    return tf.matmul(x, v) + tf.cast(total, tf.float32)
  return _save_module(folder, "write_in_dataset_function", body)


def as_pbtxt(saved_model, name=None):
  """A copy of the SavedModel directory ``saved_model`` whose graph is
  ``saved_model.pbtxt`` (text format) instead of ``saved_model.pb``."""
  import shutil  # pylint: disable=g-import-not-at-top

  from google.protobuf import text_format  # pylint: disable=g-import-not-at-top
  from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.dirname(saved_model),
                      name or os.path.basename(saved_model) + "_pbtxt")
  shutil.copytree(saved_model, path)
  model = saved_model_pb2.SavedModel()
  with open(os.path.join(path, "saved_model.pb"), "rb") as f:
    model.ParseFromString(f.read())
  os.remove(os.path.join(path, "saved_model.pb"))
  with open(os.path.join(path, "saved_model.pbtxt"), "w",
            encoding="utf-8") as f:
    f.write(text_format.MessageToString(model))
  return path


def _edit_saved_model(path, edit):
  """Rewrites ``path/saved_model.pb`` with ``edit(meta_graph_def)``."""
  from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=g-import-not-at-top
  file = os.path.join(path, "saved_model.pb")
  model = saved_model_pb2.SavedModel()
  with open(file, "rb") as f:
    model.ParseFromString(f.read())
  edit(model.meta_graphs[0])
  with open(file, "wb") as f:
    f.write(model.SerializeToString())
  return path


def _string_const(nodes, name, value):
  const = nodes.add()
  const.name, const.op = name, "Const"
  const.attr["dtype"].type = types_pb2.DT_STRING
  const.attr["value"].tensor.dtype = types_pb2.DT_STRING
  const.attr["value"].tensor.string_val.append(value.encode())
  return const


def write_in_restore_function(folder, target):
  """A TF2 SavedModel whose checkpoint restore function also writes
  ``target``: every loader that runs the graph's restore runs it."""
  path = clean_functional_control_flow(folder)
  final = os.path.join(str(folder), "write_in_restore_function")
  os.rename(path, final)

  def edit(meta):
    restore = _name_of(meta.saver_def.restore_op_name)
    call = next(n for n in meta.graph_def.node if n.name == restore)
    fdef = next(f for f in meta.graph_def.library.function
                if f.signature.name == call.attr["f"].func.name)
    _string_const(fdef.node_def, "target", str(target))
    _string_const(fdef.node_def, "contents", "written")
    write = fdef.node_def.add()
    write.name, write.op = "hidden_write", "WriteFile"
    write.input.extend(["target:output:0", "contents:output:0"])
    fdef.control_ret["hidden_write"] = "hidden_write"
    fdef.signature.control_output.append("hidden_write")
  return _edit_saved_model(final, edit)


def _name_of(text):
  return text.lstrip("^").split(":")[0]


def clean_v1_saved_model(folder, target=None, name="clean_v1_saved_model",
                         legacy_init_op=None):
  """``simple_save`` of a v1 graph with v1 control flow (``Switch``,
  ``Merge``, ``Enter``, ``Exit``, ``NextIteration``): a ``cond`` and a
  ``while_loop``, a resource and a ref variable."""
  del target
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  path = os.path.join(str(folder), name)
  was = control_flow_util.ENABLE_CONTROL_FLOW_V2
  control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
  try:
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [None, 2], name="x")
      w = tf1.get_variable("w", [2, 2], use_resource=True)
      r = tf1.get_variable("r", [2], use_resource=False)
      y = tf1.cond(tf.reduce_sum(x) > 0, lambda: tf.matmul(x, w),
                   lambda: -tf.matmul(x, w)) + r
      y = tf1.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2.0),
                         [tf.constant(0), y])[1]
      init = legacy_init_op() if legacy_init_op else None
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        tf1.saved_model.simple_save(sess, path, {"x": x}, {"y": y},
                                    legacy_init_op=init)
  finally:
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = was
  return path


def write_in_legacy_init_op(folder, target):
  """A v1 SavedModel whose ``legacy_init_op`` writes ``target``."""
  return clean_v1_saved_model(
      folder, name="write_in_legacy_init_op",
      legacy_init_op=lambda: tf.group(
          tf.io.write_file(str(target), "written", name="init_write"),
          name="legacy_init"))


def print_in_v1_restore(folder, target):
  """A v1 SavedModel whose ``save/restore_all`` also waits for a PrintV2
  to ``file://target``."""
  path = clean_v1_saved_model(folder, name="print_in_v1_restore")

  def edit(meta):
    _string_const(meta.graph_def.node, "hidden_text", "written")
    printed = meta.graph_def.node.add()
    printed.name, printed.op = "hidden_print", "PrintV2"
    printed.input.append("hidden_text")
    printed.attr["output_stream"].s = f"file://{target}".encode()
    printed.attr["end"].s = b"\n"
    restore = _name_of(meta.saver_def.restore_op_name)
    node = next(n for n in meta.graph_def.node if n.name == restore)
    node.input.append("^hidden_print")
  return _edit_saved_model(path, edit)


def unknown_op(folder, target=None):
  """A ``.meta`` whose graph holds an op type no TensorFlow defines."""
  del target

  def edit(meta):
    node = next(n for n in meta.graph_def.node if n.name == "call_site")
    node.op = "GraphgradCustomOp"
    node.attr.clear()
  return _save(folder, "unknown_op", _call_site, edit)


def save_v1(folder, target):
  """The v1 ``Save`` op (not SaveV2) writes ``target``."""
  return _save(folder, "save_v1", lambda h: _after(
      h, tf.raw_ops.Save(filename=str(target), tensor_names=["h"],
                         data=[h])))
