"""`graphgrad grads` runs only what it needs and refuses a saved graph's I/O."""

import re

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from graphgrad.cli import _main as _cli
from graphgrad.cli import _ops, _untrusted
from helpers import dense, error_line

tf1 = tf.compat.v1


def _save(tmp_path, hide, name="model"):
  """Saves x -> l1 -> l2 -> loss, with ``hide(h)`` returning l1's output
  carrying a hidden op; returns the .meta path."""
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    h = hide(dense(x, 4, "l1", tf.tanh))
    loss = tf.reduce_mean(tf.square(dense(h, 2, "l2")), name="loss")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    tf1.train.export_meta_graph(str(tmp_path / f"{name}.meta"))
  return str(tmp_path / f"{name}.meta")


def _writes(path):
  """l2's kernel gradient reads l1's output, which waits for the write."""
  def hide(h):
    write = tf.io.write_file(str(path),
                             tf.strings.as_string(tf.reduce_sum(h)))
    with tf.control_dependencies([write]):
      return tf.identity(h)
  return hide


def test_a_file_write_under_the_loss_is_refused_and_not_written(tmp_path,
                                                                 capsys):
  target = tmp_path / "written.txt"
  meta = _save(tmp_path, _writes(target))
  line = error_line(capsys, ["grads", meta])
  assert line == (
      "graphgrad grads: error: saved graph op 'WriteFile' (WriteFile): "
      "writes a file; pass --allow-io to run it"), line
  assert not target.exists()
  # Allowed, it runs; the sandbox refuses the write, so nothing is
  # written; without the sandbox the file is.
  line = error_line(capsys, ["grads", meta, "--allow-io"])
  assert "the sandbox refused what the graph tried" in line, line
  assert not target.exists()
  assert _cli.main(["grads", meta, "--allow-io", "--no-sandbox"]) == 0
  assert target.exists()


@pytest.mark.parametrize("hide, op_type", [
    (lambda h: tf.raw_ops.Print(input=h, data=[h], message="x"), "Print"),
    (lambda h: h + 0.0 * tf.cast(tf.reduce_sum(tf.strings.length(
        tf.io.read_file("/etc/hostname"))), tf.float32), "ReadFile"),
    (lambda h: h + 0.0 * tf.cast(tf.size(tf.io.matching_files(
        "/tmp/*")), tf.float32), "MatchingFiles"),
], ids=["print", "read_file", "matching_files"])
def test_other_io_ops_are_refused_by_name(tmp_path, capsys, hide, op_type):
  meta = _save(tmp_path, hide)
  line = error_line(capsys, ["grads", meta])
  assert f"({op_type}): " in line and "--allow-io" in line, line


def test_an_io_op_off_the_loss_path_is_not_run_and_not_refused(tmp_path,
                                                               capsys):
  """A summary writer and a Saver elsewhere in the graph are not part of
  the loss's computation: grads neither runs nor refuses them."""
  target = tmp_path / "elsewhere.txt"

  def hide(h):
    tf.io.write_file(str(target), tf.strings.as_string(tf.reduce_sum(h)))
    return h
  meta = _save(tmp_path, hide)
  assert _cli.main(["grads", meta]) == 0
  assert not target.exists()


def test_a_write_inside_a_function_call_is_found():
  with tf.Graph().as_default() as g:
    x = tf.constant(1.0)

    @tf.function
    def f(v):
      tf.io.write_file("/nonexistent/never", tf.strings.as_string(v))
      return v * 2.0
    y = f(x)
    ops = _untrusted.ops_run([y.op])
    found = _untrusted.refusal(ops)
    assert _untrusted.refusal(ops, allow_io=True) is None
  assert found.startswith(f"saved graph op {y.op.name!r} -> function "
                          f"'__inference_f_"), found
  assert found.endswith("-> 'WriteFile' (WriteFile): writes a file; pass "
                        "--allow-io to run it"), found
  assert g is y.graph


def test_a_write_in_a_function_s_registered_gradient_is_found():
  from tensorflow.python.framework import function  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    @function.Defun(tf.float32, tf.float32)
    def grad(x, dy):
      with tf.control_dependencies([tf.io.write_file(
          "/nonexistent/never", tf.strings.as_string(x))]):
        return tf.identity(dy)

    @function.Defun(tf.float32, grad_func=grad)
    def f(x):
      return x * 2.0
    y = f(tf.constant(1.0))
    found = _untrusted.refusal(_untrusted.ops_run([y.op]))
  assert found is not None and " (its gradient) -> function 'grad_" in found
  assert found.endswith("(WriteFile): writes a file; pass --allow-io to run "
                        "it"), found


def test_a_function_missing_from_the_library_is_refused():
  with tf.Graph().as_default():
    x = tf.constant(1.0)
    call = tf.raw_ops.PartitionedCall(args=[x], Tout=[tf.float32],
                                      f=_ops_function())
  found = _untrusted.refusal([call[0].op])
  assert found is not None and found.endswith("-> function 'nowhere': not "
                                              "in the graph's function "
                                              "library, so grads cannot "
                                              "check it"), found


def _ops_function():
  """A function-valued attr naming a function no library holds."""
  from tensorflow.core.framework import attr_value_pb2  # pylint: disable=g-import-not-at-top
  return attr_value_pb2.NameAttrList(name="nowhere")


def test_the_allowlist_and_the_io_ops_do_not_overlap():
  assert not [t for t in _ops.PURE_OPS if _ops.io_kind(t)]
  for op_type in ("MatMul", "Conv2D", "ReadVariableOp", "AssignVariableOp",
                  "While", "If", "Case", "StatefulPartitionedCall", "Enter",
                  "TensorArrayV3", "MapDataset", "IteratorGetNext"):
    assert _ops.is_pure(op_type), op_type
  for op_type in ("WriteFile", "ImmutableConst", "RemoteCall", "Abort",
                  "PyFunc", "DatasetFromGraph", "DebugIdentityV2"):
    assert not _ops.is_pure(op_type), op_type


def _node(op_type, attr, value):
  """A NodeDef of ``op_type`` whose ``attr`` holds ``value``: bytes, a list
  of bytes, or ``"$name"`` for a placeholder."""
  node = node_def_pb2.NodeDef(op=op_type)
  if isinstance(value, list):
    node.attr[attr].list.s.extend(value)
  elif isinstance(value, str):
    node.attr[attr].placeholder = value[1:]
  else:
    node.attr[attr].s = value
  return node


@pytest.mark.parametrize("op_type, attr, value, named", [
    ("FixedUnigramCandidateSampler", "vocab_file", b"/dev/zero", True),
    ("FixedUnigramCandidateSampler", "vocab_file", b"", False),
    ("FixedUnigramCandidateSampler", "vocab_file", "$vocab", True),
    ("SomeFutureOp", "log_dirs", [b"", b"/tmp"], True),
    ("SomeFutureOp", "log_dirs", [b""], False),
    ("SomeFutureOp", "_source_path", b"/tmp", False),
    ("TensorArrayGradV3", "source", b"gradients", False),
    ("SomeFutureOp", "source", b"http://example.com", True),
    ("MatMul", "padding", b"SAME", False),
], ids=["name", "empty", "placeholder", "list", "empty_list",
        "bookkeeping", "tensor_array_gradient", "url", "not_a_location"])
def test_file_attr(op_type, attr, value, named):
  assert _ops.file_attr(_node(op_type, attr, value)) == (
      attr if named else None)


def test_every_allowlisted_attr_that_names_a_file_is_listed_here():
  """Reads the registered OpDef of every allowlisted op: these string attrs
  are the ones file_attr takes for a file's name, and by default they name
  none (file_attr reads a NodeDef, which can leave defaults out). A
  TensorFlow that adds such an attr, or a default, fails here."""
  from tensorflow.python.framework import op_def_registry  # pylint: disable=g-import-not-at-top
  names_a_file, in_memory, strings = {}, set(), set()
  for op_type in sorted(_ops.PURE_OPS):
    op_def = op_def_registry.get(op_type)
    for attr in op_def.attr if op_def else ():
      if attr.type not in ("string", "list(string)"):
        continue
      strings.add((op_type, attr.name))
      value = [b"x"] if attr.type == "list(string)" else b"x"
      if _ops.file_attr(_node(op_type, attr.name, value)):
        names_a_file.setdefault(op_type, []).append(attr.name)
        default = attr.default_value
        assert not default.s and not any(default.list.s), (op_type, attr)
      elif re.search("file|path|dir|url|source", attr.name):
        in_memory.add((op_type, attr.name))
  assert names_a_file == {"FixedUnigramCandidateSampler": ["vocab_file"]}
  assert in_memory == _ops.IN_MEMORY_ATTRS
  assert len(strings) > 100  # the registry did answer


@pytest.mark.parametrize("op_type, kind", [
    ("SaveV2", "saves a checkpoint"), ("RestoreV2", "restores a checkpoint"),
    ("TFRecordDatasetV2", "reads files"), ("TFRecordReaderV2", "reads files"),
    ("ParallelInterleaveDatasetV4", "runs an input pipeline"),
    ("DatasetFromGraph", None), ("RemoteCall", None),
    ("ReaderReadV2", "reads files"), ("WriteScalarSummary", "writes a summary"),
    ("CreateSummaryFileWriter", "writes a summary"), ("PrintV2", "prints"),
    ("MatMul", None), ("AssignVariableOp", None)])
def test_io_kinds(op_type, kind):
  assert _ops.io_kind(op_type) == kind


def test_non_scalar_loss_is_refused_and_output_is_accepted(tmp_path, capsys):
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    tf.identity(dense(dense(x, 4, "l1", tf.tanh), 2, "l2"), name="logits")
    tf1.train.export_meta_graph(str(tmp_path / "infer.meta"))
  meta = str(tmp_path / "infer.meta")
  line = error_line(capsys, ["grads", meta, "--loss", "logits"])
  assert line == ("graphgrad grads: error: the loss logits:0 has shape "
                  "[?,2], not a scalar: pass a scalar loss with --loss "
                  "NAME, or --output logits to report the gradients of its "
                  "sum"), line
  # No loss at all: the suggestion is --output, which grads accepts.
  line = error_line(capsys, ["grads", meta])
  assert "--output NAME" in line
  rng = np.random.default_rng(0)
  np.savez(tmp_path / "feed.npz", x=rng.normal(size=(4, 3)).astype(
      np.float32))
  assert _cli.main(["grads", meta, "--output", "logits", "--feed",
                    str(tmp_path / "feed.npz")]) == 0
  printed = capsys.readouterr().out
  assert "the sum of --output logits:0" in printed
  assert "l1" in printed and "l2" in printed


def test_help_names_the_three_formats(capsys):
  with pytest.raises(SystemExit):
    _cli.main(["grads", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert ".meta" in text and ".pb" in text and "SavedModel" in text
  assert "--allow-io" in text


def test_a_frozen_graph_says_its_variables_hold_the_frozen_values(tmp_path,
                                                                  capsys):
  with tf.Graph().as_default() as g:
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    tf.identity(dense(dense(x, 4, "l1", tf.tanh), 2, "l2"), name="logits")
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      frozen = tf1.graph_util.convert_variables_to_constants(
          sess, g.as_graph_def(), ["logits"])
  tf.io.write_graph(frozen, str(tmp_path), "frozen.pb", as_text=False)
  assert _cli.main(["grads", str(tmp_path / "frozen.pb"), "--output",
                    "logits"]) == 0
  first = capsys.readouterr().out.splitlines()[0]
  assert first.endswith("a frozen graph: the variables hold its frozen "
                        "values"), first
  assert "initial values" not in first
