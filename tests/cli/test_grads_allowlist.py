"""`graphgrad grads` runs only pure compute ops, wherever a graph hides others.

Each hostile graph is saved to ``tmp_path`` and handed to the command line
in-process; the refusal must come before any ``Session`` exists, and the
file it would write must not exist afterwards.
"""

import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

from graphgrad.cli import _main as _cli
from helpers import dense, error_line

tf1 = tf.compat.v1


def _forbid_sessions(monkeypatch):
  """From now on, a Session the command line creates fails the test.

  The tests that use it run the command in this process (--no-sandbox),
  where the patch can see it: they test the allowlist, which refuses
  before any Session; tests/cli/test_sandbox.py tests the sandbox.
  graphgrad's one-time self-tests of TensorFlow may still make theirs.
  """
  real = tf1.Session

  def session(*args, **kwargs):
    caller = sys._getframe(1).f_globals.get("__name__", "")  # pylint: disable=protected-access
    if caller.startswith(("graphgrad.cli", "graphgrad.analysis._metagraph")):
      raise AssertionError(f"{caller} created a Session")
    return real(*args, **kwargs)
  monkeypatch.setattr(tf1, "Session", session)


@pytest.fixture
def no_session(monkeypatch):
  """Fails the test if the command creates a Session."""
  _forbid_sessions(monkeypatch)


def _net(x, hide):
  h = hide(dense(x, 4, "l1", tf.tanh))
  return tf.reduce_mean(tf.square(dense(h, 2, "l2")), name="loss")


def _save_meta(tmp_path, hide):
  """x -> l1 -> hide -> l2 -> loss, as a .meta file."""
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, _net(x, hide))
    tf1.train.export_meta_graph(str(tmp_path / "model.meta"))
  return str(tmp_path / "model.meta")


def _after(op, h):
  with tf.control_dependencies([op]):
    return tf.identity(h)


def _plus(h, value):
  """``h``, waiting for ``value`` (any dtype) through a zero term."""
  return h + 0.0 * tf.cast(tf.reduce_sum(tf.cast(value, tf.int64)),
                           tf.float32)


def _write(target, v):
  return tf.io.write_file(str(target), tf.strings.as_string(
      tf.reduce_sum(tf.cast(v, tf.float32))))


def _in_function(target):
  def hide(h):
    @tf.function
    def f(v):
      _write(target, v)
      return v * 1.0
    return f(h)
  return hide


def _in_case(target):
  def hide(h):
    return tf.switch_case(tf.constant(1), [
        lambda: tf.identity(h), lambda: _after(_write(target, h), h)])
  return hide


def _cond_in_function(target):
  def hide(h):
    @tf.function
    def f(v):
      return tf.cond(tf.reduce_sum(v) > -1e9,
                     lambda: _after(_write(target, v), v),
                     lambda: tf.identity(v))
    return f(h)
  return hide


def _dataset_map(target):
  def hide(h):
    ds = tf.data.Dataset.range(1).map(
        lambda i: _after(_write(target, i), i))
    return _plus(h, tf.data.experimental.get_single_element(ds))
  return hide


def _dataset_reduce(target):
  def hide(h):
    total = tf.data.Dataset.range(2).reduce(
        tf.constant(0, tf.int64), lambda s, i: _after(_write(target, i), s))
    return _plus(h, total)
  return hide


def _to_tfrecord(target):
  def hide(h):
    ds = tf.data.Dataset.from_tensors(tf.constant("record"))
    return _after(tf.data.experimental.TFRecordWriter(str(target)).write(ds),
                  h)
  return hide


def _cache(target):
  def hide(h):
    ds = tf.data.Dataset.range(1).cache(str(target))
    return _plus(h, tf.data.experimental.get_single_element(ds))
  return hide


def _snapshot(target):
  def hide(h):
    ds = tf.data.Dataset.range(1).snapshot(str(target))
    return _plus(h, tf.data.experimental.get_single_element(ds))
  return hide


def _iterator_over_prefetch(target):
  def hide(h):
    ds = tf.data.Dataset.range(1).map(
        lambda i: _after(_write(target, i), i)).prefetch(1)
    it = tf1.data.make_initializable_iterator(ds)
    return _after(it.initializer, h)
  return hide


def _debug(op):
  def build(target):
    url = "file://" + str(target)
    def hide(h):
      if op == "DebugIdentity":
        return tf.raw_ops.DebugIdentity(input=h, debug_urls=[url])
      if op == "DebugIdentityV2":
        return tf.raw_ops.DebugIdentityV2(input=h, debug_urls=[url],
                                          op_name="l1", output_slot=0)
      return _plus(h, tf.raw_ops.DebugNumericSummary(input=h,
                                                     debug_urls=[url]))
    return hide
  return build


WRITES = [
    ("function", _in_function, "-> function '__inference_f_", "'WriteFile' "
     "(WriteFile): writes a file; pass --allow-io to run it"),
    ("switch_case", _in_case,
     "-> function 'switch_case_indexed_case_branch1_",
     "(WriteFile): writes a file; pass --allow-io"),
    ("cond_in_function", _cond_in_function, "-> function 'cond_true_",
     "(WriteFile): writes a file"),
    ("dataset_map", _dataset_map, "MapDataset' -> function '__inference_",
     "(WriteFile): writes a file"),
    ("dataset_reduce", _dataset_reduce, "ReduceDataset' -> function '",
     "(WriteFile): writes a file"),
    ("to_tfrecord", _to_tfrecord, "'DatasetToTFRecord' ",
     "(DatasetToTFRecord): writes a file"),
    ("cache", _cache, "(CacheDataset)", "may cache to a file"),
    ("snapshot", _snapshot, "(SnapshotDatasetV2)",
     "writes a snapshot to files"),
    ("iterator_over_prefetch", _iterator_over_prefetch,
     "MapDataset' -> function '__inference_", "(WriteFile): writes a file"),
    ("DebugIdentity", _debug("DebugIdentity"), "(DebugIdentity)",
     "writes debug dumps"),
    ("DebugIdentityV2", _debug("DebugIdentityV2"), "(DebugIdentityV2)",
     "writes debug dumps"),
    ("DebugNumericSummary", _debug("DebugNumericSummary"),
     "(DebugNumericSummary)", "writes debug dumps"),
]


@pytest.mark.parametrize("build, where, why", [w[1:] for w in WRITES],
                         ids=[w[0] for w in WRITES])
def test_a_hidden_write_is_refused_before_any_session(tmp_path, capsys,
                                                      no_session, build,
                                                      where, why):
  target = tmp_path / "written"
  meta = _save_meta(tmp_path, build(target))
  line = error_line(capsys, ["grads", "--no-sandbox", meta])
  assert line.startswith("graphgrad grads: error: saved graph op '"), line
  assert where in line and why in line, line
  assert line.endswith("; pass --allow-io to run it"), line
  assert not target.exists()
  assert sorted(os.listdir(tmp_path)) == ["model.meta"]


def _table_from_text_file(source):
  def hide(h):
    table = tf.lookup.StaticHashTable(tf.lookup.TextFileInitializer(
        str(source), tf.string, 0, tf.int64, 1, delimiter=" "), -1)
    return _after(tf1.tables_initializer(),
                  _plus(h, table.lookup(tf.constant("a"))))
  return hide


def _sampler(vocab=None):
  """A candidate sampler of two classes, weighted by the counts the file
  ``vocab`` lists, or without one by counts given in its attrs."""
  return tf.raw_ops.FixedUnigramCandidateSampler(
      true_classes=tf.constant([[0]], tf.int64), num_true=1, num_sampled=1,
      unique=True, range_max=2, vocab_file=str(vocab or ""),
      unigrams=[] if vocab else [1.0, 3.0])[0]


def _sampler_in_function(vocab):
  def hide(h):
    @tf.function
    def f(v):
      return _plus(v, _sampler(vocab))
    return f(h)
  return hide


READS = [
    ("TFRecordDataset", lambda s: lambda h: _plus(h, tf.strings.length(
        tf.data.experimental.get_single_element(tf.data.TFRecordDataset(
            str(s))))), "(TFRecordDataset", "reads files"),
    ("TextLineDataset", lambda s: lambda h: _plus(h, tf.strings.length(
        tf.data.experimental.get_single_element(tf.data.TextLineDataset(
            str(s))))), "(TextLineDataset", "reads files"),
    ("ImmutableConst", lambda s: lambda h: h + tf.reduce_sum(
        tf.raw_ops.ImmutableConst(dtype=tf.float32, shape=[1],
                                  memory_region_name=str(s))),
     "(ImmutableConst)", "reads a file (memory-mapped)"),
    ("lookup_table", _table_from_text_file,
     "(InitializeTableFromTextFileV2)", "reads a file (a lookup table's)"),
    ("vocab_file", lambda s: lambda h: _plus(h, _sampler(s)),
     "op 'FixedUnigramCandidateSampler' (FixedUnigramCandidateSampler)",
     "opens the file its attr 'vocab_file' names"),
    ("vocab_file_in_function", _sampler_in_function,
     "-> function '__inference_f_", "'FixedUnigramCandidateSampler' "
     "(FixedUnigramCandidateSampler): opens the file its attr 'vocab_file' "
     "names"),
]


@pytest.mark.parametrize("build, where, why", [r[1:] for r in READS],
                         ids=[r[0] for r in READS])
def test_a_hidden_read_is_refused_before_any_session(tmp_path, capsys,
                                                     no_session, build,
                                                     where, why):
  """No Session exists, so the file (absent here) is never opened."""
  meta = _save_meta(tmp_path, build(tmp_path / "secret"))
  line = error_line(capsys, ["grads", "--no-sandbox", meta])
  assert line.startswith("graphgrad grads: error: saved graph op '"), line
  assert where in line and why + "; pass --allow-io to run it" in line, line


def test_an_allowlisted_op_that_names_a_file_runs_with_allow_io(tmp_path,
                                                              capsys):
  """FixedUnigramCandidateSampler is pure compute when its counts are in
  its attrs, and known I/O when it reads them from a file: with --allow-io
  the sandbox lets it read the model's own directory."""
  meta = _save_meta(tmp_path, lambda h: _plus(h, _sampler()))
  assert _cli.main(["grads", meta]) == 0
  vocab = tmp_path / "vocab.csv"
  vocab.write_text("a,1\nb,3\n")
  meta = _save_meta(tmp_path, lambda h: _plus(h, _sampler(vocab)))
  assert _cli.main(["grads", meta, "--allow-io"]) == 0


def test_an_op_neither_pure_nor_io_is_refused_even_with_allow_io(
    tmp_path, capsys, no_session):
  """A serialized dataset graph is not parsed, so never run."""
  graph_def = tf.Graph().as_graph_def().SerializeToString()
  meta = _save_meta(tmp_path, lambda h: _after(
      tf.raw_ops.DatasetFromGraph(graph_def=graph_def).op, h))
  line = error_line(capsys, ["grads", "--no-sandbox", meta, "--allow-io"])
  assert line == (
      "graphgrad grads: error: saved graph op 'DatasetFromGraph' "
      "(DatasetFromGraph): not a pure compute op, so grads refuses it even "
      "with --allow-io"), line


def test_allow_io_runs_a_write_inside_a_function(tmp_path, capsys):
  """--allow-io lets the op run; the sandbox still refuses the write, and
  only --no-sandbox lets it reach the file."""
  target = tmp_path / "written"
  meta = _save_meta(tmp_path, _in_function(target))
  line = error_line(capsys, ["grads", meta, "--allow-io"])
  assert line.startswith("graphgrad grads: error: the sandbox refused what "
                         "the graph tried while running the graph ("), line
  assert not target.exists()
  assert _cli.main(["grads", meta, "--allow-io", "--no-sandbox"]) == 0
  assert target.exists()


# Functions that no node names. `wrapper` calls `twice`; `evil`, in the
# library but called by nothing, writes the target. Each edit below plants
# a way for TensorFlow to run `evil` all the same.


def _library_meta(tmp_path, target, plant):
  """x -> l1 -> (waits for a call of `wrapper`) -> l2 -> loss, saved as a
  .meta after ``plant(functions)`` edited its protos: ``functions`` maps
  "wrapper", "twice" and "evil" to their FunctionDefs, and "call" to the
  graph's NodeDef that calls `wrapper`."""
  with tf.Graph().as_default():
    @tf.function
    def evil(v):
      _write(target, v)
      return v * 2.0

    @tf.function
    def twice(v):
      return v * 2.0

    @tf.function
    def wrapper(v):
      return twice(v)
    evil.get_concrete_function(tf.TensorSpec([], tf.float32)).add_to_graph()
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    loss = _net(x, lambda h: _plus(h, wrapper(tf.reduce_sum(h))))
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    meta = tf1.train.export_meta_graph()
  functions = {name: f for f in meta.graph_def.library.function
               for name in ("wrapper", "twice", "evil")
               if f.signature.name.startswith(f"__inference_{name}_")}
  functions["call"] = next(
      n for n in meta.graph_def.node if n.op.endswith("PartitionedCall")
      and n.attr["f"].func.name == functions["wrapper"].signature.name)
  # Stateful calls, so that TensorFlow keeps a callee's write when it
  # inlines the call (a stateless one keeps only its outputs).
  for node in (functions["call"], _call_in(functions["wrapper"])):
    node.op = "StatefulPartitionedCall"
  plant(functions)
  path = tmp_path / "model.meta"
  path.write_bytes(meta.SerializeToString())
  return str(path)


def _call_in(function):
  """The node of ``function`` that calls another function."""
  return next(n for n in function.node_def
              if n.op.endswith("PartitionedCall"))


def _wrapper_calls_inner(functions):
  """`wrapper`'s call of `twice` becomes a call of its func attr `inner`:
  the function its caller binds there, else the attr's default."""
  node = _call_in(functions["wrapper"])
  node.attr["f"].Clear()
  node.attr["f"].placeholder = "inner"
  return functions["wrapper"].signature.attr.add(name="inner", type="func")


def _bound_by_the_call(functions):
  _wrapper_calls_inner(functions)
  functions["call"].attr["f"].func.attr["inner"].func.name = (
      functions["evil"].signature.name)


def _signature_default(functions):
  inner = _wrapper_calls_inner(functions)
  inner.default_value.func.name = functions["evil"].signature.name


LINKED = [
    ("bound_by_the_call", _bound_by_the_call,
     r"^saved graph op '[^']*PartitionedCall' -> function "
     r"'__inference_evil_\d+' -> 'WriteFile' "),
    ("signature_default", _signature_default,
     r"^saved graph op '[^']*PartitionedCall' -> function "
     r"'__inference_wrapper_\d+' \(the default of its attr 'inner'\) -> "
     r"function '__inference_evil_\d+' -> 'WriteFile' "),
]


@pytest.mark.parametrize("plant, path", [l[1:] for l in LINKED],
                         ids=[l[0] for l in LINKED])
def test_a_function_that_no_node_names_is_checked(tmp_path, capsys,
                                                  monkeypatch, plant, path):
  target = tmp_path / "written"
  meta = _library_meta(tmp_path, target, plant)
  _forbid_sessions(monkeypatch)
  line = error_line(capsys, ["grads", "--no-sandbox", meta, "--loss", "loss"])
  head = "graphgrad grads: error: "
  assert line.startswith(head) and re.search(path, line[len(head):]), line
  assert line.endswith("(WriteFile): writes a file; pass --allow-io to run "
                       "it"), line
  assert not target.exists()
  monkeypatch.undo()
  # TensorFlow does run `evil`: allowed, it writes the file.
  assert _cli.main(["grads", "--no-sandbox", meta, "--loss", "loss",
                    "--allow-io"]) == 0
  assert target.exists()


def _same_api(functions):
  """`twice` and `evil` implement one API, and `evil` prefers the CPU that
  `wrapper`'s call of `twice` is placed on."""
  for name, device in (("twice", b"GPU"), ("evil", b"CPU")):
    functions[name].attr["api_implements"].s = b"times2"
    functions[name].attr["api_preferred_device"].s = device
  _call_in(functions["wrapper"]).device = "/device:CPU:0"


def test_a_function_the_implementation_selector_may_swap_in_is_checked(
    tmp_path, capsys, monkeypatch):
  target = tmp_path / "written"
  meta = _library_meta(tmp_path, target, _same_api)
  _forbid_sessions(monkeypatch)
  line = error_line(capsys, ["grads", "--no-sandbox", meta, "--loss", "loss"])
  assert re.fullmatch(
      r"graphgrad grads: error: saved graph op '[^']*PartitionedCall' -> "
      r"function '__inference_wrapper_\d+' -> function "
      r"'__inference_twice_\d+' \(may be swapped for another of "
      r"api_implements 'times2'\) -> function '__inference_evil_\d+' -> "
      r"'WriteFile' \(WriteFile\): writes a file; pass --allow-io to run "
      r"it", line), line
  assert not target.exists()
  monkeypatch.undo()
  # grads turns the selector off, so even allowed, `twice` runs.
  assert _cli.main(["grads", "--no-sandbox", meta, "--loss", "loss",
                    "--allow-io"]) == 0
  assert not target.exists()
  # A Session as TensorFlow configures it runs `evil` instead.
  with tf.Graph().as_default():
    tf1.train.import_meta_graph(meta)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run("loss:0", {"x:0": np.ones((2, 3), np.float32)})
  assert target.exists()


def test_the_checkpoint_restore_and_what_it_runs_are_checked(
    tmp_path, capsys, monkeypatch):
  """grads' Saver restores every global variable: the handle op of one the
  loss never reads waits for a write."""
  target = tmp_path / "written"
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, _net(x, tf.identity))
    write = _write(target, tf.constant(1.0))
    tf1.get_variable("unread", initializer=1.0)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      prefix = tf1.train.Saver().save(sess, str(tmp_path / "ckpt"))
    meta = tf1.train.export_meta_graph()
  # A variable's op ignores control dependencies (it is made in an
  # init_scope), so the wait is planted in the proto.
  next(n for n in meta.graph_def.node if n.name == "unread").input.append(
      "^" + write.name)
  path = tmp_path / "model.meta"
  path.write_bytes(meta.SerializeToString())
  _forbid_sessions(monkeypatch)
  line = error_line(capsys, ["grads", "--no-sandbox", str(path),
                             "--checkpoint", prefix])
  assert line == (
      f"graphgrad grads: error: --checkpoint {prefix!r}: restoring it runs "
      f"saved graph op 'WriteFile' (WriteFile): writes a file; pass "
      f"--allow-io to run it"), line
  assert not target.exists()
  monkeypatch.undo()
  # Without a checkpoint, grads initializes the variables the loss reads.
  assert _cli.main(["grads", "--no-sandbox", str(path)]) == 0
  assert not target.exists()
  # Allowed, the restore does run the write.
  assert _cli.main(["grads", "--no-sandbox", str(path), "--checkpoint", prefix,
                    "--allow-io"]) == 0
  assert target.exists()


def _function_model(target):
  """A graph whose loss calls a tf.function that writes ``target``."""
  x = tf1.placeholder(tf.float32, [None, 3], name="x")
  loss = _net(x, _in_function(target))
  tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
  return x, loss


def test_a_write_in_a_saved_model_function_is_refused(tmp_path, capsys,
                                                      monkeypatch):
  target = tmp_path / "written"
  with tf.Graph().as_default(), tf1.Session() as sess:
    x, loss = _function_model(target)
    sess.run(tf1.global_variables_initializer())
    tf1.saved_model.simple_save(sess, str(tmp_path / "sm"), {"x": x},
                                {"loss": loss})
  _forbid_sessions(monkeypatch)
  line = error_line(capsys, ["grads", "--no-sandbox", str(tmp_path / "sm")])
  assert "-> function '__inference_f_" in line, line
  assert line.endswith("'WriteFile' (WriteFile): writes a file; pass "
                       "--allow-io to run it"), line
  assert not target.exists()


def test_a_write_in_a_frozen_graph_function_is_refused(tmp_path, capsys,
                                                       monkeypatch):
  target = tmp_path / "written"
  with tf.Graph().as_default() as g, tf1.Session() as sess:
    _function_model(target)
    sess.run(tf1.global_variables_initializer())
    frozen = tf1.graph_util.convert_variables_to_constants(
        sess, g.as_graph_def(), ["loss"])
  tf.io.write_graph(frozen, str(tmp_path), "frozen.pb", as_text=False)
  _forbid_sessions(monkeypatch)
  line = error_line(capsys, ["grads", "--no-sandbox",
                             str(tmp_path / "frozen.pb"), "--loss", "loss"])
  assert "-> function '__inference_f_" in line, line
  assert line.endswith("(WriteFile): writes a file; pass --allow-io to run "
                       "it"), line
  assert not target.exists()


def _normal_model():
  """Dense layers, a tf.function call, a cond and a while-loop RNN, in v1
  control flow as a legacy TF1 graph has them (functional ``If`` and
  ``While`` ops are in test_grads_functional.py)."""
  x = tf1.placeholder(tf.float32, [None, 3], name="x")

  @tf.function
  def gate(v):
    return v * tf.sigmoid(v)
  h = gate(dense(x, 4, "l1"))
  with tf1.variable_scope("rnn"):
    w = tf1.get_variable("kernel", initializer=np.eye(4, dtype=np.float32)
                         * 0.5)

  def step(t, s, total):
    s = tf.tanh(tf.matmul(s, w) + h)
    return t + 1, s, total + s
  was_v2 = tf1.control_flow_v2_enabled()
  tf1.disable_control_flow_v2()
  try:
    h = tf.cond(tf.reduce_sum(h) > -1e9, lambda: h * 2.0, lambda: h)
    _, _, total = tf.while_loop(lambda t, s, total: t < 3, step, [
        tf.constant(0), h, tf.zeros_like(h)])
  finally:
    if was_v2:  # as the process had it
      tf1.enable_control_flow_v2()
  loss = tf.reduce_mean(tf.square(dense(total, 2, "l2")), name="loss")
  tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
  return x, loss


def test_a_normal_model_passes_and_its_gradients_are_right(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  feed = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
  np.savez(tmp_path / "feed.npz", x=feed)
  with tf.Graph().as_default():
    x, loss = _normal_model()
    types = {op.type for op in tf1.get_default_graph().get_operations()}
    assert {"Enter", "Exit", "NextIteration", "Switch"} <= types, types
    assert types & {"PartitionedCall", "StatefulPartitionedCall"}, types
    tf1.train.export_meta_graph(str(tmp_path / "model.meta"))
    variables = tf1.trainable_variables()
    grad_tensors = tf.gradients(loss, variables)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      grads = sess.run(grad_tensors, {x: feed})
      expected = {scope: np.sqrt(sum(
          np.sum(np.square(g)) for v, g in zip(variables, grads)
          if v.op.name.startswith(scope + "/"))) for scope in ("l1", "l2",
                                                               "rnn")}
  out = tmp_path / "g.json"
  assert _cli.main(["grads", str(tmp_path / "model.meta"), "--feed",
                    str(tmp_path / "feed.npz"), "--json", str(out)]) == 0
  rows = {r["name"]: r for r in json.loads(out.read_text())["layers"]}
  for scope, norm in expected.items():
    np.testing.assert_allclose(rows[scope]["grad_norm"]["before"], norm,
                               rtol=1e-4)


def _endless(tmp_path):
  return _save_meta(tmp_path, lambda h: _plus(h, tf.while_loop(
      lambda i: i >= 0, lambda i: i + 1, [tf.constant(0)])))


def test_timeout_ends_the_sandboxed_child_and_keeps_this_process(
    tmp_path, capsys):
  import time  # pylint: disable=g-import-not-at-top
  meta = _endless(tmp_path)
  start = time.perf_counter()
  line = error_line(capsys, ["grads", meta, "--timeout", "8"])
  assert line == (
      "graphgrad grads: error: --timeout 8: the model ran for 8 s without "
      "finishing (while running the graph), so graphgrad grads stopped it; "
      "pass a larger --timeout if it needs more time"), line
  assert time.perf_counter() - start < 60


def test_timeout_without_the_sandbox_ends_the_process(tmp_path):
  """With --no-sandbox the loop runs in the command line's own process,
  and ending that process is the only way to stop it."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  meta = _endless(tmp_path)
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="3")
  start = time.perf_counter()
  done = subprocess.run(
      [sys.executable, "-m", "graphgrad", "grads", meta, "--timeout", "3",
       "--no-sandbox"],
      capture_output=True, text=True, env=env, timeout=120, check=False)
  took = time.perf_counter() - start
  assert done.returncode == 2, done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0] == (
      "graphgrad grads: error: --timeout 3: the model ran for 3 s without "
      "finishing, so graphgrad grads stopped it (and this process, since "
      "--no-sandbox runs it here); pass a larger --timeout if it needs more "
      "time"), done.stderr
  assert "Traceback" not in done.stderr and done.stdout == ""
  assert took < 60, took


def test_timeout_must_be_positive(tmp_path, capsys):
  line = error_line(capsys, ["grads", str(tmp_path / "m.meta"),
                             "--timeout", "0"])
  assert line.endswith("argument --timeout: expected a positive finite "
                       "number (above 0); got '0'"), line


def test_inspect_runs_nothing_of_a_hostile_saved_model(tmp_path, capsys,
                                                       monkeypatch):
  """A v1 loader would run the main op and the restore; inspect reads the
  MetaGraphDef only, and creates no Session."""
  main_target, loss_target = tmp_path / "by_main_op", tmp_path / "by_loss"
  with tf.Graph().as_default(), tf1.Session() as sess:
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    loss = _net(x, _in_function(loss_target))
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    sess.run(tf1.global_variables_initializer())
    builder = tf1.saved_model.Builder(str(tmp_path / "sm"))
    builder.add_meta_graph_and_variables(
        sess, ["serve"], main_op=_write(main_target, tf.constant(1.0)))
    builder.save()
  assert not main_target.exists() and not loss_target.exists()
  _forbid_sessions(monkeypatch)
  assert _cli.main(["inspect", "--no-sandbox", str(tmp_path / "sm")]) == 0
  assert "loss:0" in capsys.readouterr().out
  assert not main_target.exists() and not loss_target.exists()


def test_inspect_runs_nothing_of_a_hostile_meta_graph(tmp_path, capsys,
                                                      no_session):
  target = tmp_path / "written"
  meta = _save_meta(tmp_path, _dataset_map(target))
  assert _cli.main(["inspect", "--no-sandbox", meta]) == 0
  assert "l1" in capsys.readouterr().out
  assert not target.exists()
