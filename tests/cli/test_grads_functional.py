"""`graphgrad grads` on functional control flow, and its backward-pass check.

The gradient of a functional ``While`` or ``If`` (control flow v2) adds
outputs to the forward op, which a ``Session`` that has already run the
graph cannot take; ``grads`` builds its gradients before its ``Session``
exists, and checks their ops against the allowlist before it runs them.
"""

import contextlib
import json
import re

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.analysis import _metagraph
from graphgrad.cli import _grads
from graphgrad.cli import _main as _cli
from helpers import dense, error_line

tf1 = tf.compat.v1


@contextlib.contextmanager
def _v2():
  """Control flow v2 (functional While and If) for the ops built inside;
  the process's own setting after."""
  was = tf1.control_flow_v2_enabled()
  tf1.enable_control_flow_v2()
  try:
    yield
  finally:
    if not was:
      tf1.disable_control_flow_v2()


def _model(kind):
  """x -> l1 -> a While (RNN) or an If over rnn/kernel -> l2 -> loss."""
  x = tf1.placeholder(tf.float32, [None, 3], name="x")
  h = dense(x, 4, "l1", tf.tanh)
  with tf1.variable_scope("rnn"):
    w = tf1.get_variable("kernel", initializer=np.eye(4, dtype=np.float32)
                         * 0.5)
  if kind == "while":
    def step(t, s):
      return t + 1, tf.tanh(tf.matmul(s, w) + h)
    h = tf.while_loop(lambda t, s: t < 3, step, [tf.constant(0), h])[1]
  else:
    h = tf.cond(tf.reduce_sum(h) > -1e9, lambda: tf.matmul(h, w) * 2.0,
                lambda: h)
  loss = tf.reduce_mean(tf.square(dense(h, 2, "l2")), name="loss")
  tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
  return x, loss


def _reference(graph, feed):
  """Per layer, the norm of tf.gradients' parameter gradients in ``graph``."""
  with graph.as_default():
    loss = graph.get_tensor_by_name("loss:0")
    variables = tf1.trainable_variables()
    grads = tf.gradients(loss, variables)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      values = sess.run(grads, {graph.get_tensor_by_name("x:0"): feed})
  return {scope: np.sqrt(sum(np.sum(np.square(g))
                             for v, g in zip(variables, values)
                             if v.op.name.startswith(scope + "/")))
          for scope in ("l1", "rnn", "l2")}


def _check(tmp_path, monkeypatch, model, types):
  """Runs grads on ``model``; compares its figures with tf.gradients in
  the graph it imported.

  The reference differentiates the same imported graph: differentiating a
  second import in this process would add a loop body or branch named as
  grads' rewrite named its own (``<function>_rewritten``) to TensorFlow's
  process-wide function library, with another definition, which
  TensorFlow refuses.
  """
  feed = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
  np.savez(tmp_path / "feed.npz", x=feed)
  out = tmp_path / "g.json"
  loaded = []
  load = _grads.load_model
  monkeypatch.setattr(
      _grads, "load_model",
      lambda path, **limits: loaded.append(load(path, **limits)) or loaded[-1])
  # In this process, to compare with the very graph grads imported.
  assert _cli.main(["grads", model, "--feed", str(tmp_path / "feed.npz"),
                    "--json", str(out), "--no-sandbox"]) == 0
  (graph,) = [m.graph for m in loaded]
  assert types & {op.type for op in graph.get_operations()}
  rows = {r["name"]: r for r in json.loads(out.read_text())["layers"]}
  for scope, norm in _reference(graph, feed).items():
    assert norm > 0, scope
    np.testing.assert_allclose(rows[scope]["grad_norm"]["before"], norm,
                               rtol=1e-5)


def test_a_functional_while_in_a_meta_graph(tmp_path, monkeypatch):
  with tf.Graph().as_default(), _v2():
    _model("while")
    tf1.train.export_meta_graph(str(tmp_path / "model.meta"))
  _check(tmp_path, monkeypatch, str(tmp_path / "model.meta"),
         {"While", "StatelessWhile"})


def test_a_functional_while_of_a_saved_training_graph(tmp_path,
                                                      monkeypatch):
  """The saved graph already holds a gradient of the loop: its body is a
  ``_rewritten`` function, and the library holds both versions."""
  with tf.Graph().as_default(), _v2():
    _, loss = _model("while")
    tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    tf1.train.export_meta_graph(str(tmp_path / "model.meta"))
  _check(tmp_path, monkeypatch, str(tmp_path / "model.meta"),
         {"While", "StatelessWhile"})


def test_a_functional_cond_in_a_saved_model(tmp_path, monkeypatch):
  with tf.Graph().as_default(), tf1.Session() as sess, _v2():
    x, loss = _model("cond")
    sess.run(tf1.global_variables_initializer())
    tf1.saved_model.simple_save(sess, str(tmp_path / "sm"), {"x": x},
                                {"loss": loss})
  _check(tmp_path, monkeypatch, str(tmp_path / "sm"), {"If", "StatelessIf"})


@pytest.mark.parametrize("kind", ["while", "cond"])
def test_gradient_report_twice_with_functional_control_flow(kind):
  """Once one gradient of the loop or branch exists before the Session
  runs the graph, every report after it runs; without it, the report says
  so instead of failing inside TensorFlow."""
  feed = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
  for prebuilt in (True, False):
    with tf.Graph().as_default():
      with _v2():
        x, loss = _model(kind)
      net = gg.analyze(loss)
      variables = tf1.trainable_variables()
      reference = tf.gradients(loss, variables) if prebuilt else None
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        if not prebuilt:
          with pytest.raises(gg.GraphGradError,
                             match="added outputs to it after `sess` had "
                                   "run the graph"):
            gg.gradient_report(sess, net, {x: feed})
          continue
        values = sess.run(reference, {x: feed})
        reports = [gg.gradient_report(sess, net, {x: feed})
                   for _ in range(2)]
    for scope in ("l1", "rnn", "l2"):
      norm = np.sqrt(sum(np.sum(np.square(g))
                         for v, g in zip(variables, values)
                         if v.op.name.startswith(scope + "/")))
      for report in reports:
        np.testing.assert_allclose(report[scope]["grad_norm"]["before"],
                                   norm, rtol=1e-5)


def test_a_loop_in_an_imported_tf_function_is_refused(tmp_path, capsys):
  """An imported tf.function has no Python gradient: tf.gradients takes
  SymbolicGradient, which gives zeros through the While inside (the
  gradient of the graph that defined the function is not zero)."""
  feed = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
  with tf.Graph().as_default() as graph:
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    h = dense(x, 4, "l1", tf.tanh)

    @tf.function
    def loop(h):
      return tf.while_loop(lambda t, s: t < 3, lambda t, s: (
          t + 1, tf.tanh(s) + h), [tf.constant(0), h])[1]
    loss = tf.reduce_mean(tf.square(dense(loop(h), 2, "l2")), name="loss")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
    tf1.train.export_meta_graph(str(tmp_path / "model.meta"))
    own = tf.gradients(loss, tf1.trainable_variables(scope="l1"))
  imported = _grads.load_model(str(tmp_path / "model.meta")).graph
  with imported.as_default():
    symbolic = tf.gradients(imported.get_tensor_by_name("loss:0"),
                            tf1.trainable_variables(scope="l1"))
  for g, grads in ((graph, own), (imported, symbolic)):
    with g.as_default(), tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      norm = np.linalg.norm(sess.run(grads[0], {
          g.get_tensor_by_name("x:0"): feed}))
    assert (norm > 0) == (g is graph), norm
  line = error_line(capsys, ["grads", str(tmp_path / "model.meta")])
  assert re.search(r"with TensorFlow's SymbolicGradient; that cannot take "
                   r"the (Stateless)?While 'while' in function "
                   r"'__inference_loop_\d+'", line), line


def test_a_second_import_differentiated_elsewhere_is_named(tmp_path):
  """Two imports of one saved graph, each differentiated in this process,
  hold two different ``<loop function>_rewritten``: TensorFlow refuses the
  second, and gradient_report says why."""
  with tf.Graph().as_default(), _v2():
    _model("while")
    tf1.train.export_meta_graph(str(tmp_path / "model.meta"))
  first = _grads.load_model(str(tmp_path / "model.meta")).graph
  with first.as_default():
    tf.gradients(first.get_tensor_by_name("loss:0"),
                 tf1.trainable_variables())
  second = _grads.load_model(str(tmp_path / "model.meta")).graph
  with second.as_default():
    net = gg.analyze(second.get_tensor_by_name("loss:0"))
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      with pytest.raises(gg.GraphGradError,
                         match=r"adds 'while_(cond|body)_\d+_rewritten' to "
                               r"TensorFlow's process-wide function library"):
        gg.gradient_report(sess, net)


_WRITTEN = []


@tf.RegisterGradient("GraphgradTestWritingTanh")
def _writing_tanh_grad(op, grad):
  """Tanh's gradient, after writing a file named in ``_WRITTEN``."""
  write = tf.io.write_file(_WRITTEN[-1], tf.strings.as_string(
      tf.reduce_sum(grad)))
  with tf.control_dependencies([write]):
    return grad * (1.0 - tf.square(op.outputs[0]))


def test_the_backward_pass_is_checked_before_it_runs(tmp_path, capsys,
                                                     monkeypatch):
  """A gradient function that writes a file, under a pure forward pass.

  A saved graph cannot carry a Python-registered gradient (the override
  map names a gradient function of this process), so the model is built
  here and handed to ``grads`` as its loaded graph. Only the check of the
  backward pass's ops refuses it: the forward pass is pure.
  """
  target = tmp_path / "written"
  _WRITTEN.append(str(target))
  graph = tf.Graph()
  with graph.as_default():
    x = tf1.placeholder(tf.float32, [None, 3], name="x")
    with graph.gradient_override_map({"Tanh": "GraphgradTestWritingTanh"}):
      h = dense(x, 4, "l1", tf.tanh)
    loss = tf.reduce_mean(tf.square(dense(h, 2, "l2")), name="loss")
    tf1.add_to_collection(tf1.GraphKeys.LOSSES, loss)
  assert "WriteFile" not in {op.type for op in graph.get_operations()}
  monkeypatch.setattr(_grads, "load_model",
                      lambda path, **_: _metagraph.Model(graph, "MetaGraph"))
  (tmp_path / "model.meta").write_bytes(b"")  # the path must exist
  line = error_line(capsys, ["grads", str(tmp_path / "model.meta"),
                             "--no-sandbox"])
  assert line.startswith("graphgrad grads: error: saved graph op "
                         "'gradient_report/gradients/"), line
  assert line.endswith("(WriteFile): writes a file; pass --allow-io to "
                       "run it"), line
  assert not target.exists()
