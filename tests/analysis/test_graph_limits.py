"""Saved graphs that would crash or exhaust the process are refused first.

Each crafted file is made by editing the protos of a small saved model, and
is never imported: the command line must print one line, and the check must
come before ``import_meta_graph`` or ``import_graph_def`` (both are replaced
by a function that fails the test while a bomb is loaded).
"""

import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import function_pb2
from tensorflow.core.protobuf import saved_model_pb2

from graphgrad.analysis import _graph_limits, _metagraph
from graphgrad.analysis._graph_limits import GraphLimitError
from helpers import dense, error_line

tf1 = tf.compat.v1
GIB = 2 ** 30
LIMIT = "8.0 GiB"
FLOAT = tf.float32.as_datatype_enum
INT32 = tf.int32.as_datatype_enum


def _here(command):
  """``command`` in this process (--no-sandbox), where ``no_import`` sees
  it: these tests are of the checks before import, not of the sandbox."""
  return [command, "--no-sandbox"]


@pytest.fixture
def no_import(monkeypatch):
  """Fails the test if anything imports a graph (in this process)."""
  def refuse(*args, **kwargs):
    raise AssertionError("a crafted graph reached the import")
  monkeypatch.setattr(tf1.train, "import_meta_graph", refuse)
  monkeypatch.setattr(tf1, "import_graph_def", refuse)


def _model():
  """The MetaGraphDef of x -> l1 -> l2 -> loss, never saved by itself."""
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    h = tf.identity(dense(x, 4, "l1", tf.tanh), name="h")
    loss = tf.reduce_mean(tf.square(dense(h, 2, "l2")), name="loss")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    return tf1.train.export_meta_graph()


def _write(tmp_path, meta, name="bomb.meta"):
  path = str(tmp_path / name)
  with open(path, "wb") as f:
    f.write(meta.SerializeToString())
  return path


def _node(graph_def, name):
  return next(n for n in graph_def.node if n.name == name)


def _function(name, calls=()):
  """A FunctionDef ``name(x: float) -> x`` whose body calls ``calls`` by
  op type."""
  f = function_pb2.FunctionDef()
  f.signature.name = name
  f.signature.input_arg.add(name="x", type=FLOAT)
  f.signature.output_arg.add(name="y", type=FLOAT)
  for i, callee in enumerate(calls):
    f.node_def.add(name=f"call{i}", op=callee, input=["x"])
  f.ret["y"] = "x"
  return f


def _call(graph_def, function):
  """Makes the graph call ``function`` on ``x``, as a tf.function would."""
  node = graph_def.node.add(name="call", op="PartitionedCall", input=["x"])
  node.attr["Tin"].list.type.append(FLOAT)
  node.attr["Tout"].list.type.append(FLOAT)
  node.attr["f"].func.name = function


def _const(nodes, name, value, dtype=tf.int32):
  """Adds a Const to ``nodes`` (a graph's or a function's)."""
  node = nodes.add(name=name, op="Const")
  node.attr["dtype"].type = dtype.as_datatype_enum
  node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype))
  return node


# -- recursion and call depth -------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "grads"])
def test_a_self_recursive_function_is_refused(tmp_path, capsys, no_import,
                                              command):
  meta = _model()
  meta.graph_def.library.function.append(_function("f", ["f"]))
  _call(meta.graph_def, "f")
  path = _write(tmp_path, meta)
  assert error_line(capsys, [*_here(command), path]) == (
      f"graphgrad {command}: error: {path!r}: function 'f' calls itself "
      f"(f -> f): TensorFlow's import of a recursive function recurses "
      f"until the process crashes, so graphgrad imports no recursion in the "
      f"function library. TensorFlow never saves one: the file is corrupt "
      f"or crafted; use the file TensorFlow wrote.")


def _cycle_by_attr(f, callee):
  node = f.node_def.add(name="call", op="PartitionedCall", input=["x"])
  node.attr["f"].func.name = callee


def _cycle_by_nested_attr(f, callee):
  node = f.node_def.add(name="map", op="MapDataset", input=["x"])
  node.attr["f"].func.name = "nowhere"
  node.attr["f"].func.attr["inner"].func.name = callee


def _cycle_by_list(f, callee):
  node = f.node_def.add(name="case", op="Case", input=["x"])
  node.attr["branches"].list.func.add(name="nowhere")
  node.attr["branches"].list.func.add(name=callee)


def _cycle_by_default(f, callee):
  attr = f.signature.attr.add(name="body", type="func")
  attr.default_value.func.name = callee


@pytest.mark.parametrize("link", [
    lambda f, callee: f.node_def.add(name="call", op=callee, input=["x"]),
    _cycle_by_attr, _cycle_by_nested_attr, _cycle_by_list, _cycle_by_default,
], ids=["op_type", "func_attr", "nested_attr", "func_list",
        "signature_default"])
def test_a_cycle_through_any_kind_of_call_is_refused(link):
  library = function_pb2.FunctionDefLibrary()
  f, g, h = _function("f", ["g"]), _function("g", ["h"]), _function("h")
  link(h, "f")
  library.function.extend([f, g, h])
  with pytest.raises(GraphLimitError) as e:
    _graph_limits.check_calls(library, "'m.meta'")
  assert str(e.value) == (
      "'m.meta': functions 'f', 'g', 'h' call each other (f -> g -> h -> f): "
      "TensorFlow's import of a recursive function recurses until the "
      "process crashes, so graphgrad imports no recursion in the function "
      "library. TensorFlow never saves one: the file is corrupt or crafted; "
      "use the file TensorFlow wrote.")


def _chain(n):
  library = function_pb2.FunctionDefLibrary()
  library.function.extend(
      _function(f"f{i}", [f"f{i + 1}"] if i + 1 < n else [])
      for i in range(n))
  return library


def test_a_chain_of_5000_functions_is_refused(tmp_path, capsys, no_import):
  meta = _model()
  meta.graph_def.library.CopyFrom(_chain(5000))
  _call(meta.graph_def, "f0")
  path = _write(tmp_path, meta)
  assert error_line(capsys, ["inspect", "--no-sandbox", path]) == (
      f"graphgrad inspect: error: {path!r}: function 'f0' starts a chain of "
      f"5000 functions, each calling the next (f0 -> f1 -> ... -> f4999): "
      f"more than the 100 nested functions graphgrad imports, as "
      f"TensorFlow's import recurses once per level (real models nest a "
      f"few). Inline the nested functions and save the model again; "
      f"otherwise the file is corrupt or crafted.")


def test_the_call_depth_limit_is_100_functions():
  _graph_limits.check_calls(_chain(100))
  with pytest.raises(GraphLimitError, match=r"^function 'f0' starts a chain "
                     r"of 101 functions, each calling the next \(f0 -> f1 -> "
                     r"\.\.\. -> f100\): more than the 100 nested"):
    _graph_limits.check_calls(_chain(101))


def test_a_function_called_from_several_places_is_no_cycle():
  library = function_pb2.FunctionDefLibrary()
  library.function.extend([_function("a", ["b", "c"]),
                           _function("b", ["c"]), _function("c"),
                           _function("d", ["c", "b"])])
  _graph_limits.check_calls(library)


# -- allocations sized by Const inputs ---------------------------------------


def _allocating(nodes, op, arg_value, dtype_attr):
  """Adds ``op`` whose first input is a Const of ``arg_value``, consumed by
  nothing; returns the node."""
  _const(nodes, "n", arg_value)
  node = nodes.add(name="alloc", op=op, input=["n"])
  node.attr[dtype_attr].type = FLOAT
  return node


def test_a_tensor_array_of_2_31_slots_is_refused(tmp_path, capsys,
                                                 no_import):
  meta = _model()
  _allocating(meta.graph_def.node, "TensorArrayV3", 2 ** 31 - 1, "dtype")
  path = _write(tmp_path, meta)
  want = (2 ** 31 - 1) * _graph_limits.OBJECT_BYTES / GIB
  assert error_line(capsys, ["inspect", "--no-sandbox", path]) == (
      f"graphgrad inspect: error: {path!r}: node 'alloc' (TensorArrayV3) "
      f"takes its `size` input from Const 'n' = [2147483647]: 2,147,483,647 "
      f"slots of float32 tensors, at least 24 bytes each: {want:.1f} GiB, "
      f"more than the {LIMIT} memory limit (memory_bytes), so graphgrad "
      f"does not import the graph. Pass a larger --memory if the model "
      f"really needs that much; otherwise the file is corrupt or crafted.")


@pytest.mark.parametrize("op, arg, dtype_attr", [
    ("Fill", "dims", "T"), ("Empty", "shape", "dtype"),
])
def test_fill_and_empty_of_a_huge_shape_are_refused(tmp_path, capsys,
                                                    no_import, op, arg,
                                                    dtype_attr):
  meta = _model()
  node = _allocating(meta.graph_def.node, op, [100000, 100000, 10],
                     dtype_attr)
  if op == "Fill":
    _const(meta.graph_def.node, "zero", 0.0, tf.float32)
    node.input.append("zero")
  path = _write(tmp_path, meta)
  want = 100000 * 100000 * 10 * 4 / GIB
  assert error_line(capsys, ["grads", "--no-sandbox", path]) == (
      f"graphgrad grads: error: {path!r}: node 'alloc' ({op}) takes its "
      f"`{arg}` input from Const 'n' = [100000, 100000, 10]: "
      f"100,000,000,000 elements of float32: {want:.1f} GiB, more than the "
      f"{LIMIT} memory limit (memory_bytes), so graphgrad does not import "
      f"the graph. Pass a larger --memory if the model really needs that "
      f"much; otherwise the file is corrupt or crafted.")


def test_a_size_behind_identity_in_a_function_body_is_found():
  graph_def = tf1.GraphDef()
  f = _function("f")
  _const(f.node_def, "n", [4, 1024, 1024])
  f.node_def.add(name="n_read", op="Identity", input=["n:output:0"])
  fill = f.node_def.add(name="fill", op="Fill",
                        input=["n_read:output:0", "x"])
  fill.attr["T"].type = FLOAT
  graph_def.library.function.append(f)
  _graph_limits.check(graph_def, memory_bytes=16 * 2 ** 20)
  with pytest.raises(GraphLimitError) as e:
    _graph_limits.check(graph_def, memory_bytes=10 * 2 ** 20)
  assert str(e.value) == (
      "node 'fill' (Fill) of function 'f' takes its `dims` input from "
      "Const 'n' = [4, 1024, 1024]: 4,194,304 elements of float32: 16.0 "
      "MiB, more than the 10.0 MiB memory limit (memory_bytes), so "
      "graphgrad does not import the graph. Pass a larger --memory if the "
      "model really needs that much; otherwise the file is corrupt or "
      "crafted.")


# -- tensors and shapes -------------------------------------------------------


def test_a_tiny_frozen_graph_whose_const_claims_1e10_floats(tmp_path, capsys,
                                                            no_import):
  graph_def = tf1.GraphDef()
  x = graph_def.node.add(name="x", op="Placeholder")
  x.attr["dtype"].type = FLOAT
  big = graph_def.node.add(name="big", op="Const")
  big.attr["dtype"].type = FLOAT
  big.attr["value"].tensor.dtype = FLOAT
  big.attr["value"].tensor.tensor_shape.dim.add(size=10 ** 10)
  y = graph_def.node.add(name="y", op="AddV2", input=["x", "big"])
  y.attr["T"].type = FLOAT
  path = str(tmp_path / "frozen.pb")
  with open(path, "wb") as f:
    f.write(graph_def.SerializeToString())
  assert os.path.getsize(path) < 400
  stored = big.attr["value"].tensor.ByteSize()
  assert error_line(capsys, [*_here("inspect"), path, "--output", "y"]) == (
      f"graphgrad inspect: error: {path!r}: node 'big' (Const) holds in its "
      f"`value` attr a float32 tensor of shape [10000000000] "
      f"(10,000,000,000 elements; its proto stores {stored} bytes and "
      f"TensorFlow fills the rest): {4e10 / GIB:.1f} GiB, more than the "
      f"{LIMIT} memory limit (memory_bytes), so graphgrad does not import "
      f"the graph. Pass a larger --memory if the model really needs that "
      f"much; otherwise the file is corrupt or crafted.")


def test_a_tensor_with_a_zero_dimension_takes_nothing():
  graph_def = tf1.GraphDef()
  empty = graph_def.node.add(name="empty", op="Const")
  empty.attr["value"].tensor.dtype = FLOAT
  for size in (0, 10 ** 12):
    empty.attr["value"].tensor.tensor_shape.dim.add(size=size)
  _graph_limits.check(graph_def, memory_bytes=1)


def test_gg_thaw_checks_a_graph_def_before_reading_its_constants():
  import graphgrad as gg  # pylint: disable=g-import-not-at-top
  graph_def = tf1.GraphDef()
  _const(graph_def.node, "big", np.zeros([4, 1024], np.float32), tf.float32)
  with tf.Graph().as_default():
    with pytest.raises(GraphLimitError, match=r"^node 'big' \(Const\) holds "
                       r"in its `value` attr a float32 tensor of shape "
                       r"\[4, 1024\] \(4,096 elements; .*: 16,384 bytes, "
                       r"more than the 16,000 bytes memory limit"):
      gg.thaw(graph_def, memory_bytes=16000)


def test_a_placeholder_of_10_12_floats_is_refused_by_grads(tmp_path, capsys,
                                                          no_import):
  meta = _model()
  x = _node(meta.graph_def, "x")
  x.attr["shape"].shape.Clear()
  for size in (100000, 100000, 100):
    x.attr["shape"].shape.dim.add(size=size)
  path = _write(tmp_path, meta)
  assert error_line(capsys, ["grads", "--no-sandbox", path]) == (
      f"graphgrad grads: error: {path!r}: node 'x' (Placeholder) declares "
      f"`shape` [100000, 100000, 100] of float32: {4e12 / GIB:.1f} GiB, more "
      f"than the {LIMIT} memory limit (memory_bytes), so graphgrad does not "
      f"import the graph. Pass a larger --memory if the model really needs "
      f"that much; otherwise the file is corrupt or crafted.")


@pytest.mark.parametrize("op", ["PlaceholderWithDefault", "VarHandleOp",
                                "VariableV2"])
def test_other_static_shapes_are_checked(op):
  graph_def = tf1.GraphDef()
  node = graph_def.node.add(name="v", op=op)
  node.attr["dtype"].type = tf.float64.as_datatype_enum
  node.attr["shape"].shape.dim.add(size=1024)
  node.attr["shape"].shape.dim.add(size=1024)
  if op == "PlaceholderWithDefault":
    node.input.append("default")
  _graph_limits.check(graph_def, memory_bytes=8 * 2 ** 20)
  with pytest.raises(GraphLimitError) as e:
    _graph_limits.check(graph_def, memory_bytes=8 * 2 ** 20 - 1)
  assert str(e.value).startswith(
      f"node 'v' ({op}) declares `shape` [1024, 1024] of float64: 8.0 MiB, "
      f"more than the 8.0 MiB memory limit (memory_bytes)")


def test_unknown_dimensions_count_as_the_batch(tmp_path, capsys, no_import):
  meta = _model()
  x = _node(meta.graph_def, "x")
  x.attr["shape"].shape.dim[1].size = 2 ** 29  # [?, 2**29]: 2 GiB a row
  path = _write(tmp_path, meta)
  _graph_limits.check(meta.graph_def, batch=4)
  assert error_line(capsys, [*_here("grads"), path, "--batch", "5"]) == (
      f"graphgrad grads: error: {path!r}: node 'x' (Placeholder) declares "
      f"`shape` [?, 536870912] of float32, unknown dimensions counted as "
      f"the batch 5: {5 * 2 ** 31 / GIB:.1f} GiB, more than the {LIMIT} "
      f"memory limit (memory_bytes), so graphgrad does not import the "
      f"graph. Pass a larger --memory or a smaller --batch if the model "
      f"really needs that much; otherwise the file is corrupt or crafted.")


def test_memory_bytes_and_batch_must_be_positive_ints():
  graph_def = tf1.GraphDef()
  with pytest.raises(GraphLimitError, match=r"^`memory_bytes` must be a "
                     r"positive int; got 0\. Pass e\.g\. "
                     r"memory_bytes=8589934592\.$"):
    _graph_limits.check(graph_def, memory_bytes=0)
  with pytest.raises(GraphLimitError, match=r"^`batch` must be a positive "
                     r"int; got 2\.5\. Pass e\.g\. batch=8\.$"):
    _graph_limits.check(graph_def, batch=2.5)
  with pytest.raises(GraphLimitError, match=r"got True"):
    _graph_limits.check(graph_def, batch=True)


# -- undecodable files --------------------------------------------------------


def _decode_error(message, data):
  try:
    message.ParseFromString(data)
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {str(e).splitlines()[0]}"
  raise AssertionError("the data parsed")


def test_a_corrupt_saved_model_is_one_line(tmp_path, capsys, no_import):
  (tmp_path / "sm").mkdir()
  file = tmp_path / "sm" / "saved_model.pb"
  data = np.random.default_rng(0).bytes(300)
  file.write_bytes(data)
  why = _decode_error(saved_model_pb2.SavedModel(), data)
  fix = ("Pass the directory that tf.compat.v1.saved_model.simple_save or "
         "SavedModelBuilder wrote, or a .meta or frozen .pb file.")
  for command in ("inspect", "grads"):
    assert error_line(capsys, [*_here(command), str(tmp_path / "sm")]) == (
        f"graphgrad {command}: error: cannot read {str(file)!r} as a "
        f"SavedModel ({why}). {fix}")
  file.write_bytes(b"")
  assert error_line(capsys, [*_here("inspect"), str(tmp_path / "sm")]) == (
      f"graphgrad inspect: error: {str(file)!r} is not a SavedModel: it "
      f"holds no MetaGraph (an empty file, or another kind of protocol "
      f"buffer). {fix}")
  # A GraphDef parses as a SavedModel without MetaGraphs.
  file.write_bytes(_model().graph_def.SerializeToString())
  assert error_line(capsys, [*_here("inspect"), str(tmp_path / "sm")]).endswith(
      "is not a SavedModel: it holds no MetaGraph (an empty file, or another "
      f"kind of protocol buffer). {fix}")


def test_a_saved_model_whose_meta_graph_has_nameless_nodes(tmp_path, capsys,
                                                           no_import):
  model = saved_model_pb2.SavedModel()
  meta = model.meta_graphs.add()
  meta.meta_info_def.tags.append("serve")
  meta.graph_def.node.add(op="Const")
  (tmp_path / "sm").mkdir()
  file = tmp_path / "sm" / "saved_model.pb"
  file.write_bytes(model.SerializeToString())
  assert error_line(capsys, [*_here("inspect"), str(tmp_path / "sm")]) == (
      f"graphgrad inspect: error: the MetaGraph tagged 'serve' of "
      f"{str(file)!r} is not a graph: its graph has nodes without a name or "
      f"an op type (another kind of protocol buffer, or a corrupt file). "
      f"Pass the directory that tf.compat.v1.saved_model.simple_save or "
      f"SavedModelBuilder wrote, or a .meta or frozen .pb file.")


def test_a_corrupt_meta_graph_is_one_line(tmp_path, capsys, no_import):
  from tensorflow.core.protobuf import meta_graph_pb2  # pylint: disable=g-import-not-at-top
  path = tmp_path / "bad.meta"
  data = np.random.default_rng(0).bytes(300)
  path.write_bytes(data)
  why = _decode_error(meta_graph_pb2.MetaGraphDef(), data)
  fix = ("Pass a .meta file written by tf.compat.v1.train.Saver or "
         "export_meta_graph.")
  assert error_line(capsys, ["grads", "--no-sandbox", str(path)]) == (
      f"graphgrad grads: error: cannot read {str(path)!r} as a MetaGraph "
      f"({why}). {fix}")
  meta = meta_graph_pb2.MetaGraphDef()
  meta.graph_def.node.add(name="x")
  path.write_bytes(meta.SerializeToString())
  assert error_line(capsys, ["inspect", "--no-sandbox", str(path)]) == (
      f"graphgrad inspect: error: {str(path)!r} is not a MetaGraph: its "
      f"graph has nodes without a name or an op type (another kind of "
      f"protocol buffer, or a corrupt file). {fix}")


def test_a_corrupt_frozen_graph_is_one_line(tmp_path, capsys, no_import):
  path = tmp_path / "bad.pb"
  path.write_bytes(np.random.default_rng(0).bytes(300))
  line = error_line(capsys, ["inspect", "--no-sandbox", str(path)])
  assert line == (
      f"graphgrad inspect: error: `graph_def_or_path` {str(path)!r} is not a "
      f"GraphDef, binary or text. Pass a frozen graph written by "
      f"tf.io.write_graph(graph_def, dir, name); a .meta "
      f"file is a MetaGraph (tf.compat.v1.train.import_meta_graph) and a "
      f"saved_model.pb a SavedModel (tf.compat.v1.saved_model.loader.load).")


def test_a_graph_tensorflow_cannot_import_is_one_line(tmp_path, capsys):
  meta = _model()
  meta.graph_def.node.add(name="odd", op="NoSuchOp", input=["x"])
  path = _write(tmp_path, meta)
  with tf.Graph().as_default():
    try:
      tf1.train.import_meta_graph(meta)
      raise AssertionError("TensorFlow imported an unknown op type")
    except Exception as e:  # pylint: disable=broad-except
      why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
  assert error_line(capsys, ["inspect", path]) == (
      f"graphgrad inspect: error: TensorFlow {tf.__version__} cannot import "
      f"{path!r} ({why}). Pass a MetaGraph written by TensorFlow whose ops "
      f"this TensorFlow knows.")


def test_a_text_meta_graph_still_loads(tmp_path):
  meta = _model()
  path = tmp_path / "model.meta"
  path.write_text(str(meta))
  graph = _metagraph.load(str(path)).graph
  assert graph.get_tensor_by_name("loss:0").shape.rank == 0


# -- gradient overrides -------------------------------------------------------

_OVERRIDE_FIX = ("Remove the attr, or set it to the name of a gradient "
                 "registered with tf.RegisterGradient.")


@pytest.mark.parametrize("command", ["inspect", "grads"])
def test_a_gradient_override_that_is_an_int(tmp_path, capsys, no_import,
                                            command):
  meta = _model()
  _node(meta.graph_def, "h").attr["_gradient_op_type"].i = 5
  path = _write(tmp_path, meta)
  assert error_line(capsys, [*_here(command), path]) == (
      f"graphgrad {command}: error: {path!r}: node 'h' (Identity) has a "
      f"`_gradient_op_type` attr holding an int (5), not a string: "
      f"gradient_override_map records the name of a registered gradient "
      f"there, so the file is corrupt or crafted. {_OVERRIDE_FIX}")


def test_a_gradient_override_that_is_no_value_or_a_list():
  node = tf1.NodeDef(name="h", op="Identity")
  node.attr["_gradient_op_type"].list.s.append(b"Identity")
  with pytest.raises(GraphLimitError, match=r"^node 'h' \(Identity\) has a "
                     r"`_gradient_op_type` attr holding a list, not a "
                     r"string: "):
    _graph_limits.gradient_override(node)
  node.attr["_gradient_op_type"].Clear()
  with pytest.raises(GraphLimitError, match=r"attr holding no value, not a "
                     r"string"):
    _graph_limits.gradient_override(node, function="f")


@pytest.mark.parametrize("command", ["inspect", "grads"])
def test_a_gradient_override_that_is_not_utf_8(tmp_path, capsys, no_import,
                                               command):
  meta = _model()
  _node(meta.graph_def, "h").attr["_gradient_op_type"].s = b"\xff\xfeFlip"
  path = _write(tmp_path, meta)
  assert error_line(capsys, [*_here(command), path]) == (
      f"graphgrad {command}: error: {path!r}: node 'h' (Identity) has a "
      f"`_gradient_op_type` attr b'\\xff\\xfeFlip' that is not UTF-8 text, "
      f"so it names no gradient function: the file is corrupt or crafted. "
      f"{_OVERRIDE_FIX}")


@pytest.mark.parametrize("command", ["inspect", "grads"])
def test_a_gradient_borrowed_from_conv2d_is_refused(tmp_path, capsys,
                                                    no_import, command):
  meta = _model()
  _node(meta.graph_def, "h").attr["_gradient_op_type"].s = b"Conv2D"
  path = _write(tmp_path, meta)
  assert error_line(capsys, [*_here(command), path]) == (
      f"graphgrad {command}: error: {path!r}: node 'h' (Identity) has "
      f"`_gradient_op_type` 'Conv2D', the gradient TensorFlow registered for "
      f"Conv2D ops, which reads a Conv2D's attrs and inputs, but an Identity "
      f"has no attr data_format, dilations, explicit_paddings, padding, "
      f"strides, use_cudnn_on_gpu: tf.gradients would fail there or compute "
      f"a wrong gradient, so graphgrad does not import the graph. Remove "
      f"the attr, or name a gradient written for Identity (for a "
      f"straight-through estimator, gradient_override_map({{'Identity': "
      f"'Identity'}})).")


@pytest.mark.parametrize("borrowed, misfit", [
    ("ConcatV2", "an Identity has no attr N, Tidx"),
    ("Split", "an Identity has no attr num_split"),
    ("AddV2", "an AddV2 takes 2 inputs and this node 1"),
    ("Unpack", "an Identity has no attr axis, num"),
])
def test_other_borrowed_gradients_that_do_not_fit(borrowed, misfit):
  graph_def = _model().graph_def
  h = _node(graph_def, "h")
  h.attr["_gradient_op_type"].s = borrowed.encode()
  with pytest.raises(GraphLimitError) as e:
    _graph_limits.check(graph_def)
  assert f", but {misfit}: tf.gradients would fail" in str(e.value)


def test_gradients_that_fit_or_are_registered_overrides_pass():
  graph_def = _model().graph_def
  h = _node(graph_def, "h")
  sign = graph_def.node.add(name="sign", op="Sign", input=["h"])
  sign.attr["T"].type = FLOAT
  # The straight-through estimator: Sign differentiated as Identity.
  sign.attr["_gradient_op_type"].s = b"Identity"
  h.attr["_gradient_op_type"].s = b"StopGradient"  # not differentiable
  _graph_limits.check(graph_def)

  @tf.RegisterGradient("graphgrad_test/GraphLimitsFlip")
  def _flip(op, grad):  # pylint: disable=unused-argument
    return -grad
  h.attr["_gradient_op_type"].s = b"graphgrad_test/GraphLimitsFlip"
  _graph_limits.check(graph_def)
  h.attr["_gradient_op_type"].s = b"graphgrad_test/NeverRegistered"
  _graph_limits.check(graph_def)  # a lost override: analyze names it


# -- normal models ------------------------------------------------------------


def test_real_models_pass_with_their_functions_loops_and_arrays():
  with tf.Graph().as_default() as g:
    x = tf1.placeholder(tf.float32, [None, 3], name="x")

    @tf.function
    def inner(v):
      return tf.tanh(v)

    @tf.function
    def outer(v):
      return inner(v) * 2.0
    h = outer(dense(x, 4, "l1"))
    array = tf.TensorArray(tf.float32, size=5)
    _, array = tf.while_loop(lambda i, a: i < 5,
                             lambda i, a: (i + 1, a.write(i, h)),
                             (0, array))
    tf.add(tf.reduce_sum(array.stack()),
           tf.reduce_sum(tf.zeros([1000, 1000])), name="loss")
  graph_def = g.as_graph_def()
  ops = {n.op for n in graph_def.node}
  ops |= {n.op for f in graph_def.library.function for n in f.node_def}
  # inner, outer (which calls inner), the loop's cond and body.
  assert len(graph_def.library.function) == 4
  assert {"TensorListReserve", "Fill"} <= ops and ops & {"While",
                                                         "StatelessWhile"}
  _graph_limits.check(graph_def, batch=64)
