"""Control flow whose body reads one layer's variables belongs to that layer."""

import logging

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import control_flow_util  # pylint: disable=g-direct-tensorflow-import

import graphgrad as gg
from helpers import assert_grads_close, dense, evaluate, feed, trainable

tf1 = tf.compat.v1


@pytest.fixture(params=["v1", "v2"])
def control_flow(request):
  """Builds the test's graph with tf.compat.v1 or v2 control flow."""
  was = control_flow_util.ENABLE_CONTROL_FLOW_V2
  if request.param == "v1":
    tf1.disable_control_flow_v2()
  else:
    tf1.enable_control_flow_v2()
  try:
    with tf.Graph().as_default():
      yield request.param
  finally:
    if was:
      tf1.enable_control_flow_v2()
    else:
      tf1.disable_control_flow_v2()


def _lstm_net():
  x = tf1.placeholder(tf.float32, [None, 5, 3])
  with tf1.variable_scope("emb"):
    xe = x @ tf1.get_variable(
        "w", initializer=np.random.default_rng(1).normal(size=(3, 3)).astype(
            np.float32))
  with tf1.variable_scope("rnn"):
    cell = tf1.nn.rnn_cell.LSTMCell(
        4, initializer=tf1.glorot_uniform_initializer(seed=0))
    outputs, _ = tf1.nn.dynamic_rnn(cell, xe, dtype=tf.float32)
  top = dense(outputs[:, -1], 2, "top")
  return x, outputs, tf.reduce_sum(tf.square(top))


def test_dynamic_rnn_layer_holds_its_loop(control_flow):
  _, _, loss = _lstm_net()
  net = gg.analyze(loss)
  assert net.names == ("emb", "rnn/rnn/lstm_cell", "top")
  rnn = net["rnn/rnn/lstm_cell"]
  loop_types = {"v1": {"Enter", "Exit", "Merge", "Switch", "NextIteration"},
                "v2": {"StatelessWhile"}}[control_flow]
  types = {op.type for op in rnn.ops}
  assert loop_types <= types or (control_flow == "v2" and "While" in types)
  assert list(net.graph.edges) == [("emb", "rnn/rnn/lstm_cell"),
                                   ("rnn/rnn/lstm_cell", "top")]
  # The boundaries are activations, not TensorArray flows or variants.
  (out,) = net.boundary("rnn/rnn/lstm_cell", "top")
  assert out.dtype == tf.float32 and out.shape.as_list() == [5, None, 4]
  assert rnn.call_sites == 1
  assert gg.GradientPlan(loss, net).passes_gradient("rnn/rnn/lstm_cell")


def test_transform_upstream_on_the_rnn_changes_the_gradient_below(control_flow):
  x, outputs, loss = _lstm_net()
  plan = gg.GradientPlan(loss).transform_upstream(
      "rnn/rnn/lstm_cell", gg.transforms.scale(0.5))
  got = {v.name: g for g, v in plan.compute_gradients()}
  emb, rnn, top = trainable("emb"), trainable("rnn"), trainable("top")
  g_out = tf.gradients(loss, outputs)[0]
  want_emb = tf.gradients(outputs, emb, grad_ys=0.5 * g_out)
  want_rest = tf.gradients(loss, rnn + top)  # the layer and above: unchanged
  plain_emb = tf.gradients(loss, emb)
  actual, expected, plain = evaluate(
      [[got[v.name] for v in emb + rnn + top], want_emb + want_rest,
       plain_emb], feed(x, rows=4))
  assert_grads_close(actual, expected)
  assert np.abs(actual[0] - plain[0]).max() > 1e-4  # it did change below


def test_cond_reading_one_layer_belongs_to_it(control_flow):
  x = tf1.placeholder(tf.float32, [None, 3])
  flag = tf1.placeholder_with_default(True, [])
  h0 = dense(x, 3, "stem", tf.tanh)
  with tf1.variable_scope("gate"):
    w = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32) * 0.7)
  h = tf.cond(flag, lambda: tf.tanh(tf.matmul(h0, w)),
              lambda: tf.matmul(h0, 2.0 * w))
  loss = tf.reduce_sum(tf.square(dense(h, 2, "top")))
  net = gg.analyze(loss)
  assert set(net.graph.edges) == {("stem", "gate"), ("gate", "top")}
  plan = gg.GradientPlan(loss, net).transform_upstream(
      "gate", gg.transforms.scale(-3.0))
  got = {v.name: g for g, v in plan.compute_gradients()}
  stem = trainable("stem")
  want = tf.gradients(h, stem, grad_ys=-3.0 * tf.gradients(loss, h)[0])
  for value in (True, False):
    batch = {**feed(x, rows=4), flag: value}
    actual, expected = evaluate([[got[v.name] for v in stem], want], batch)
    assert_grads_close(actual, expected)


def _two_layer_cond():
  x = tf1.placeholder(tf.float32, [None, 3])
  flag = tf1.placeholder_with_default(True, [])
  h0 = dense(x, 3, "stem", tf.tanh)
  with tf1.variable_scope("a"):
    wa = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
  with tf1.variable_scope("b"):
    wb = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
  h = tf.cond(flag, lambda: tf.matmul(tf.tanh(tf.matmul(h0, wa)), wb),
              lambda: tf.matmul(h0, wa + wb), name="gate_cond")
  return x, tf.reduce_sum(tf.square(dense(h, 2, "top")))


def test_boundary_inside_a_v2_cond_names_the_cond(graph):
  _, loss = _two_layer_cond()
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"transform_upstream: layer 'a' is applied inside "
                           r"the tf.cond op 'gate_cond' \((Stateless)?If\) "
                           r"together with 'b', so its boundary lies in "
                           r"'gate_cond''s function body.*Declare it on a "
                           r"layer outside 'gate_cond', or make the whole "
                           r"tf.cond one layer: gg.analyze\(loss, "
                           r"layers=\{'gate_cond'"):
    plan.transform_upstream("a", gg.transforms.scale(2.0))
  with pytest.raises(gg.UnsupportedGraphError, match=r"replace_backward: "
                     r"layer 'b' is applied inside the tf.cond op 'gate_cond'"):
    plan.replace_backward("b", gg.backward.feedback_alignment(seed=0))
  # Their parameter gradients can still be transformed.
  plan.transform_gradients("a", gg.transforms.scale(2.0))


def test_the_cond_as_one_layer_can_be_transformed(graph):
  x, loss = _two_layer_cond()
  net = gg.analyze(loss, layers={"gate_cond": trainable("a") + trainable("b")})
  assert "gate_cond" in net and set(net.graph.edges) == {
      ("stem", "gate_cond"), ("gate_cond", "top")}
  plan = gg.GradientPlan(loss, net).transform_upstream(
      "gate_cond", gg.transforms.scale(0.25))
  got = {v.name: g for g, v in plan.compute_gradients()}
  stem = trainable("stem")
  (h,) = net["gate_cond"].outputs
  want = tf.gradients(h, stem, grad_ys=0.25 * tf.gradients(loss, h)[0])
  actual, expected = evaluate([[got[v.name] for v in stem], want],
                              feed(x, rows=4))
  assert_grads_close(actual, expected)


def test_a_loop_reading_two_layers_stays_glue(control_flow):
  x = tf1.placeholder(tf.float32, [None, 3])
  with tf1.variable_scope("a"):
    wa = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
  with tf1.variable_scope("b"):
    wb = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
  _, h = tf1.while_loop(lambda i, h: i < 2,
                        lambda i, h: (i + 1, tf.tanh(h @ wa) @ wb),
                        (tf.constant(0), x), name="twice")
  loss = tf.reduce_sum(dense(h, 2, "top"))
  net = gg.analyze(loss)
  loop_ops = [op for op in net.op_graph.nodes
              if op.startswith("twice/") or op == "twice"]
  glue = [o for o in loop_ops if net.op_graph.nodes[o]["op"].type
          not in ("ReadVariableOp", "Enter")]
  assert glue and all(net.op_graph.nodes[o]["layer"] is None for o in glue)
  assert set(net.names) == {"a", "b", "top"}


# -- declarations that change nothing below ---------------------------------


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records if r.name == "graphgrad"]


def test_layer_of_variable_reads_only_warns_once(graph, caplog):
  x = tf1.placeholder(tf.float32, [None, 3])
  h = dense(x, 3, "stem", tf.tanh)
  with tf1.variable_scope("scale"):
    s = tf1.get_variable("s", initializer=np.ones((3,), np.float32))
  y = h * s  # the multiply is glue: `scale` holds only its variable's read
  loss = tf.reduce_sum(tf.square(dense(y, 2, "top")))
  net = gg.analyze(loss)
  plan = gg.GradientPlan(loss, net)
  assert net["scale"].inputs == () and not plan.passes_gradient("scale")
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan.transform_upstream("scale", gg.transforms.scale(2.0))
    plan.transform_upstream("scale", gg.transforms.scale(3.0))
    plan.replace_backward("scale", lambda ctx: [])
  assert _warnings(caplog) == [
      "transform_upstream('scale') changes nothing below the layer: it has "
      "no input: it holds only its variables' reads (its computation is "
      "glue), so no gradient passes through it. Group the computation into "
      "the layer (gg.analyze(loss, layers=...) or depth=...), or declare it "
      "on a layer whose outputs depend on its inputs.",
      "replace_backward('scale') changes nothing below the layer: it has no "
      "input: it holds only its variables' reads (its computation is glue), "
      "so no gradient passes through it. Group the computation into the "
      "layer (gg.analyze(loss, layers=...) or depth=...), or declare it on a "
      "layer whose outputs depend on its inputs."]


def test_layer_with_no_path_from_inputs_to_outputs_warns(graph, caplog):
  x = tf1.placeholder(tf.float32, [None, 3])
  h = dense(x, 3, "stem", tf.tanh)
  with tf1.variable_scope("bias_only"):
    b = tf1.get_variable("b", initializer=np.ones((3,), np.float32))
    out = tf.ones_like(h) * b  # consumes h for its shape only
  loss = tf.reduce_sum(tf.square(dense(out + h, 2, "top")))
  net = gg.analyze(loss)
  assert ("stem", "bias_only") in net.graph.edges
  plan = gg.GradientPlan(loss, net)
  assert not plan.passes_gradient("bias_only")
  assert plan.passes_gradient("top")
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan.transform_upstream("top", gg.transforms.scale(2.0))
    assert not _warnings(caplog)  # top passes its gradient to what feeds it
    plan.transform_upstream("bias_only", gg.transforms.scale(2.0))
  (message,) = _warnings(caplog)
  assert message.startswith(
      "transform_upstream('bias_only') changes nothing below the layer: none "
      "of its outputs depends differentiably on its inputs")


def test_an_upstream_transform_on_the_bottom_layer_warns_once(graph, caplog):
  """transform_upstream on the bottom layer changes nothing (its own
  parameters see the plain upstream); an edge transform there acts on its
  parameters, and a replacement on every layer is a method's usual form."""
  x = tf1.placeholder(tf.float32, [None, 3])
  loss = tf.reduce_sum(dense(dense(x, 3, "stem", tf.tanh), 2, "top"))
  net = gg.analyze(loss)
  assert gg.GradientPlan(loss, net).passes_gradient("stem")
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    (gg.GradientPlan(loss, net)
     .transform_edge("stem", "top", gg.transforms.scale(2.0))
     .replace_backward("stem", gg.backward.feedback_alignment(seed=0)))
    assert not _warnings(caplog)
    for _ in range(2):
      gg.GradientPlan(loss, net).transform_upstream(
          "stem", gg.transforms.scale(0.0))
  assert _warnings(caplog) == [
      "transform_upstream('stem') changes nothing: no layer with trainable "
      "variables lies below 'stem', and its own parameters get the "
      "unmodified upstream gradient. For stem's parameter gradients declare "
      "transform_gradients('stem', fn); for what stem receives from the "
      "layer above, declare transform_upstream on that layer: "
      "transform_upstream('top', fn)."]


def test_combine_tasks_inside_a_v2_cond_names_the_cond(graph, caplog):
  x = tf1.placeholder(tf.float32, [None, 3])
  flag = tf1.placeholder_with_default(True, [])
  with tf1.variable_scope("a"):
    wa = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
  with tf1.variable_scope("b"):
    wb = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
  h = tf.cond(flag, lambda: tf.tanh(x @ wa) @ wb, lambda: x @ (wa + wb),
              name="gate_cond")
  with tf1.variable_scope("scale"):
    s = tf1.get_variable("s", initializer=np.ones((3,), np.float32))
  h = h * s  # `scale` holds only its variable's read
  la = tf.reduce_sum(tf.square(dense(h, 2, "ta")))
  lb = tf.reduce_sum(dense(h, 2, "tb"))
  plan = gg.GradientPlan(la + lb)
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"project_conflicts: layer 'a' is applied inside "
                           r"the tf.cond op 'gate_cond'"):
    plan.project_conflicts("a", [la, lb])
  assert not plan.declarations.tasks
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan.project_conflicts("scale", [la, lb])  # its own parameter sees it
  assert not _warnings(caplog) and list(plan.declarations.tasks) == ["scale"]


class _Refusing(gg.backward.Replacement):
  """A backward replacement whose check refuses every layer."""

  def backward(self, ctx):
    return [None for _ in ctx.inputs]

  def check(self, net, name):
    raise gg.UnsupportedGraphError(f"refusing {name!r}")


def test_a_refused_declaration_does_not_warn(graph, caplog):
  x = tf1.placeholder(tf.float32, [None, 3])
  h = dense(x, 3, "stem", tf.tanh)
  with tf1.variable_scope("scale"):
    s = tf1.get_variable("s", initializer=np.ones((3,), np.float32))
  loss = tf.reduce_sum(tf.square(dense(h * s, 2, "top")))
  plan = gg.GradientPlan(loss)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    with pytest.raises(gg.UnsupportedGraphError, match=r"refusing 'scale'"):
      plan.replace_backward("scale", _Refusing())
    assert not _warnings(caplog) and not plan.declarations.backward
    plan.replace_backward("scale", lambda ctx: [])
  (message,) = _warnings(caplog)
  assert message.startswith("replace_backward('scale') changes nothing")
