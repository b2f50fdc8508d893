"""One walk of a tf.Graph's function library: the functions a node calls
and the functions a function links to, whoever asks (called_node here,
the grads allowlist in tests/cli)."""

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, function_pb2

from graphgrad.analysis import _graph_util

tf1 = tf.compat.v1


def _function(name, op):
  """A FunctionDef ``name`` whose one node ``n`` has op type ``op``."""
  f = function_pb2.FunctionDef()
  f.signature.name = name
  f.node_def.add(name="n", op=op)
  return f


def _wrapper_calling_inner():
  """A function whose one node calls its func attr ``inner``."""
  f = _function("wrapper", "StatefulPartitionedCall")
  f.node_def[0].attr["f"].placeholder = "inner"
  f.signature.attr.add(name="inner", type="func")
  return f


def _call(f):
  """A PartitionedCall op of ``f`` (a NameAttrList) in a new tf.Graph."""
  with tf.Graph().as_default():
    return tf.raw_ops.PartitionedCall(args=[tf.constant(1.0)],
                                      Tout=[tf.float32], f=f)[0].op


def _library(*functions):
  return {f.signature.name: f for f in functions}


def test_function_names_reads_a_call_s_bindings_at_any_depth():
  value = attr_value_pb2.AttrValue()
  value.func.name = "outer"
  inner = value.func.attr["inner"].func
  inner.name = "middle"
  inner.attr["deeper"].list.func.add(name="a")
  inner.attr["deeper"].list.func.add(name="b")
  assert _graph_util.function_names([value]) == ["outer", "middle", "a",
                                                  "b"]
  assert _graph_util.function_names([attr_value_pb2.AttrValue(s=b"f")]) == []


def test_called_node_finds_a_function_bound_in_the_call_s_attrs():
  f = attr_value_pb2.NameAttrList(name="wrapper")
  f.attr["inner"].func.name = "evil"
  library = _library(_wrapper_calling_inner(),
                     _function("evil", "WriteFile"))
  op = _call(f)
  assert _graph_util.called_functions(op.node_def, library) == [
      "wrapper", "evil"]
  name, node = _graph_util.called_node([op], "WriteFile".__eq__, library)
  assert (name, node.op) == ("evil", "WriteFile")


def test_called_node_finds_a_signature_default():
  wrapper = _wrapper_calling_inner()
  wrapper.signature.attr[0].default_value.func.name = "evil"
  library = _library(wrapper, _function("evil", "WriteFile"))
  assert _graph_util.linked_functions("wrapper", library) == [
      ("the default of its attr 'inner'", "evil")]
  op = _call(attr_value_pb2.NameAttrList(name="wrapper"))
  name, node = _graph_util.called_node([op], "WriteFile".__eq__, library)
  assert (name, node.op) == ("evil", "WriteFile")
  # Without the default, nothing links the two.
  wrapper.signature.attr[0].ClearField("default_value")
  assert _graph_util.called_node([op], "WriteFile".__eq__, library) is None


def test_linked_functions_reads_the_function_s_and_its_arguments_attrs():
  f = _function("f", "Identity")
  f.attr["hook"].func.name = "a"
  f.arg_attr[0].attr["hook"].list.func.add(name="b")
  assert _graph_util.linked_functions("f", _library(f)) == [
      ("its attr 'hook'", "a"), ("attr 'hook' of its argument 0", "b")]
  assert _graph_util.linked_functions("missing", _library(f)) == []


def test_called_node_finds_a_function_of_the_same_api_implements():
  """TensorFlow's implementation selector may run ``cpu`` for a call of
  ``gpu``; ``other`` implements another API."""
  library = _library(_function("gpu", "Identity"),
                     _function("cpu", "WriteFile"),
                     _function("other", "ReadFile"))
  for name, api in (("gpu", b"sum"), ("cpu", b"sum"), ("other", b"max")):
    library[name].attr["api_implements"].s = api
  assert _graph_util.linked_functions("gpu", library) == [
      ("may be swapped for another of api_implements 'sum'", "cpu")]
  op = _call(attr_value_pb2.NameAttrList(name="gpu"))
  name, node = _graph_util.called_node([op], "WriteFile".__eq__, library)
  assert (name, node.op) == ("cpu", "WriteFile")
  assert _graph_util.called_node([op], "ReadFile".__eq__, library) is None
  del library["gpu"].attr["api_implements"]
  assert _graph_util.called_node([op], "WriteFile".__eq__, library) is None
