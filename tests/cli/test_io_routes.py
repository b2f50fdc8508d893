"""Each known I/O op, by each route a function can be reached, is refused.

The matrix of graphgrad's allowlist: six I/O ops (writes, prints, saves,
reads, listings and a file named in an attr) times seven routes (the loss's
own ops, a ``tf.function``, a ``cond`` branch and a ``while`` body inside
one, a dataset's ``map``, a function bound in another call's attrs, and a
signature attr's default). Each is refused before any Session exists, in one
line naming the op. The commands run in this process (``--no-sandbox``): the
allowlist is what is tested; the kernel's containment of each op kind,
whatever route it came by, is tests/cli/test_sandbox.py's.
"""

import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2

from helpers import dense, error_line

tf1 = tf.compat.v1


def _wait(v, x):
  """``v``, computed after ``x`` (an op, or a tensor of any dtype)."""
  if isinstance(x, tf.Operation):
    with tf.control_dependencies([x]):
      return tf.identity(v)
  return v + tf.cast(tf.reduce_sum(tf.cast(
      tf.strings.length(x) if x.dtype == tf.string else x, tf.int64)) * 0,
      v.dtype)


IO = {
    "WriteFile": lambda t, v: tf.io.write_file(t, tf.strings.as_string(
        tf.reduce_sum(tf.cast(v, tf.float32)))),
    "PrintV2": lambda t, v: tf.print(v, output_stream=f"file://{t}"),
    "SaveV2": lambda t, v: tf.raw_ops.SaveV2(
        prefix=t, tensor_names=["v"], shape_and_slices=[""],
        tensors=[tf.cast(v, tf.float32)]),
    "ReadFile": lambda t, v: tf.io.read_file(t),
    "MatchingFiles": lambda t, v: tf.io.matching_files(t + "*"),
    "FixedUnigramCandidateSampler":
        lambda t, v: tf.raw_ops.FixedUnigramCandidateSampler(
            true_classes=tf.zeros([1, 1], tf.int64), num_true=1,
            num_sampled=1, unique=True, range_max=2, vocab_file=t)[0],
}


def _direct(io):
  return lambda h: _wait(h, io(h))


def _function(io):
  def hide(h):
    @tf.function
    def f(v):
      return _wait(v, io(v))
    return f(h)
  return hide


def _cond(io):
  def hide(h):
    @tf.function
    def f(v):
      return tf.cond(tf.reduce_sum(v) > -1e9, lambda: _wait(v, io(v)),
                     lambda: v)
    return f(h)
  return hide


def _while(io):
  def hide(h):
    @tf.function
    def f(v):
      return tf.while_loop(lambda i, s: i < 1,
                           lambda i, s: (i + 1, _wait(s, io(s))),
                           [tf.constant(0), v])[1]
    return f(h)
  return hide


def _dataset_map(io):
  def hide(h):
    ds = tf.data.Dataset.range(1).map(lambda i: _wait(i, io(i)))
    return _wait(h, tf.data.experimental.get_single_element(ds))
  return hide


def _called(io):
  """A tf.function call named ``call_site``, which the edits re-route."""
  def hide(h):
    @tf.function
    def evil(v):
      return _wait(v, io(v))
    return tf.identity(evil(h), name="call_site")
  return hide


def _bound_by_call(meta, default):
  """``call_site`` calls ``outer``, which calls ``$inner``: the writing
  function is bound to ``inner`` by the call's attrs, or (``default``)
  is only the default of outer's signature attr."""
  graph = meta.graph_def
  call = next(n for n in graph.node if n.name == "call_site")
  caller = next(n for n in graph.node if n.name == call.input[0].split(":")[0])
  evil = caller.attr["f"].func.name
  outer = graph.library.function.add()
  outer.signature.name = "outer"
  arg = outer.signature.input_arg.add(name="a", type=types_pb2.DT_FLOAT)
  del arg
  outer.signature.output_arg.add(name="o", type=types_pb2.DT_FLOAT)
  inner = outer.signature.attr.add(name="inner", type="func")
  node = outer.node_def.add(name="c", op="PartitionedCall", input=["a"])
  node.attr["Tin"].list.type.append(types_pb2.DT_FLOAT)
  node.attr["Tout"].list.type.append(types_pb2.DT_FLOAT)
  node.attr["f"].placeholder = "inner"
  outer.ret["o"] = "c:output:0"
  caller.attr["f"].func.name = "outer"
  if default:
    inner.default_value.func.name = evil
  else:
    caller.attr["f"].func.attr["inner"].func.name = evil


ROUTES = {
    "direct": (_direct, None, "saved graph op "),
    "function": (_function, None, "-> function '__inference_f_"),
    "cond": (_cond, None, "-> function 'cond_true_"),
    "while": (_while, None, "-> function 'while_body_"),
    "dataset_map": (_dataset_map, None, "MapDataset' -> function '"),
    # A function named anywhere in a call's attrs counts as called by it.
    "bound_by_call": (_called, lambda m: _bound_by_call(m, False),
                      "PartitionedCall' -> function '__inference_evil_"),
    "signature_default": (_called, lambda m: _bound_by_call(m, True),
                          "-> function 'outer' (the default of its attr "
                          "'inner') -> function '__inference_evil_"),
}


def _save(tmp_path, hide, edit):
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    h = hide(dense(x, 4, "l1", tf.tanh))
    loss = tf.reduce_mean(tf.square(dense(h, 2, "l2")), name="loss")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    meta = tf1.train.export_meta_graph()
  if edit is not None:
    edit(meta)
  path = tmp_path / "model.meta"
  path.write_bytes(meta.SerializeToString())
  return str(path)


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("op_type", sorted(IO))
def test_each_io_op_by_each_route_is_refused(tmp_path, capsys, op_type,
                                             route):
  target = str(tmp_path / "target")
  build, edit, where = ROUTES[route]
  meta = _save(tmp_path, build(lambda v: IO[op_type](target, v)), edit)
  line = error_line(capsys, ["grads", "--no-sandbox", meta])
  assert where in line, line
  assert f"({op_type}): " in line, line
  assert line.endswith("; pass --allow-io to run it"), line
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model.meta"]
