"""gg.thaw: a frozen GraphDef becomes trainable, bit for bit the same model."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import assert_grads_close

tf1 = tf.compat.v1
RNG = np.random.default_rng(7)
X = RNG.normal(size=(4, 8, 8, 3)).astype(np.float32)
Y = np.eye(5, dtype=np.float32)[RNG.integers(0, 5, 4)]
SCOPES = ["conv1", "bn1", "hidden", "out"]


def _network(x, use_resource):
  """tf.compat.v1.layers and get_variable, with batch norm in inference mode."""
  with tf1.variable_scope("", use_resource=use_resource):
    h = tf1.layers.conv2d(x, 4, 3, name="conv1")
    h = tf.nn.relu(tf1.layers.batch_normalization(h, training=False,
                                                  name="bn1"))
    h = tf.reshape(h, [-1, 6 * 6 * 4])
    with tf1.variable_scope("hidden"):
      w = tf1.get_variable("weights", [144, 16])
      b = tf1.get_variable("biases", [16])
      h = tf.nn.relu(tf.matmul(h, w) + b)
    logits = tf1.layers.dense(h * 0.5, 5, name="out")
  return tf.identity(logits, name="logits")


def _frozen(use_resource=True):
  """The network with random weights and statistics, frozen; its outputs."""
  with tf.Graph().as_default() as g:
    tf1.set_random_seed(1)
    x = tf1.placeholder(tf.float32, [None, 8, 8, 3], name="x")
    logits = _network(x, use_resource)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      for v in tf1.global_variables("bn1"):  # non-trivial gamma, beta, stats
        sess.run(v.assign(v + tf.random.uniform(v.shape, 0.1, 1.0, seed=2)))
      frozen = tf1.graph_util.convert_variables_to_constants(
          sess, g.as_graph_def(), ["logits"])
      return frozen, sess.run(logits, {x: X})


def _loss(logits, y):
  return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
      labels=y, logits=logits), name="loss")


@pytest.mark.parametrize("use_resource", [True, False],
                         ids=["resource", "reference"])
def test_outputs_equal_bit_for_bit_and_layers_are_found(use_resource):
  frozen, expected = _frozen(use_resource)
  with tf.Graph().as_default() as g:
    variables = gg.thaw(frozen)
    names = [v.op.name for v in variables]
    assert names == [
        "conv1/kernel", "conv1/bias", "bn1/gamma", "bn1/beta",
        "bn1/moving_mean", "bn1/moving_variance", "hidden/weights",
        "hidden/biases", "out/kernel", "out/bias"]
    assert [v.op.name for v in variables if not v.trainable] == [
        "bn1/moving_mean", "bn1/moving_variance"]
    logits = g.get_tensor_by_name("logits:0")
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      np.testing.assert_array_equal(sess.run(logits, {"x:0": X}), expected)
    y = tf1.placeholder(tf.float32, [None, 5])
    net = gg.analyze(_loss(logits, y))
    assert net.names == tuple(SCOPES)
    assert [v.op.name for v in net["bn1"].variables] == ["bn1/gamma",
                                                         "bn1/beta"]


def test_default_leaves_shapes_axes_and_scalars_constant():
  frozen, _ = _frozen()
  with tf.Graph().as_default() as g:
    gg.thaw(frozen)
    consts = {op.name for op in g.get_operations() if op.type == "Const"
              and not op.name.endswith("initial_value")}
  # Reshape's shape (int32), the 0.5 scalar and batch norm's epsilon stay.
  assert "Reshape/shape" in consts and "mul/y" in consts
  assert not consts & {"conv1/kernel", "hidden/weights", "bn1/moving_mean"}


def test_plan_trains_saves_and_restores_into_the_original_code(tmp_path):
  frozen, _ = _frozen()
  with tf.Graph().as_default() as g:
    gg.thaw(frozen)
    y = tf1.placeholder(tf.float32, [None, 5], name="y")
    loss = _loss(g.get_tensor_by_name("logits:0"), y)
    net = gg.analyze(loss)
    plan = gg.GradientPlan(loss, net).transform_upstream(
        "hidden", gg.transforms.scale(0.25))
    gv = plan.compute_gradients()
    # Reference: hidden and out get the plain gradient, everything below
    # hidden a quarter of it (the chain has no bypass).
    plain = tf.gradients(loss, [v for _, v in gv])
    expected = [p * (1.0 if net.layer_of_variable(v) in ("hidden", "out")
                     else 0.25) for p, (_, v) in zip(plain, gv)]
    train = plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.05))
    saver = tf1.train.Saver()
    feed = {"x:0": X, y: Y}
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      stats = tf1.global_variables("bn1/moving")
      before = sess.run(stats)
      assert_grads_close(sess.run([g for g, _ in gv], feed),
                         sess.run(expected, feed), rtol=1e-6)
      losses = [sess.run([train, loss], feed)[1] for _ in range(5)]
      trained = sess.run("logits:0", feed)
      assert_grads_close(sess.run(stats), before, rtol=0, atol=0)
      saver.save(sess, str(tmp_path / "thawed"))
  assert losses[-1] < losses[0]
  # The checkpoint restores into the network's own training code by name.
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 8, 8, 3])
    logits = _network(x, True)
    with tf1.Session() as sess:
      tf1.train.Saver().restore(sess, str(tmp_path / "thawed"))
      np.testing.assert_array_equal(sess.run(logits, {x: X}), trained)


def test_from_a_pb_file_with_a_prefix(tmp_path):
  frozen, expected = _frozen()
  tf.io.write_graph(frozen, str(tmp_path), "frozen.pb", as_text=False)
  with tf.Graph().as_default() as g:
    variables = gg.thaw(str(tmp_path / "frozen.pb"), name="net")
    assert variables[0].op.name == "net/conv1/kernel"
    logits = g.get_tensor_by_name("net/logits:0")
    loss = tf.reduce_sum(logits)
    assert gg.analyze(loss).names == tuple("net/" + s for s in SCOPES)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      np.testing.assert_array_equal(sess.run(logits, {"net/x:0": X}), expected)


@pytest.mark.parametrize("select", [
    r"^(conv1|out)/(kernel|bias)$",
    ["conv1/kernel", "conv1/bias:0", "out/kernel", "out/bias"],
    lambda node: node.name.split("/")[0] in ("conv1", "out"),
], ids=["regex", "list", "predicate"])
def test_select(select):
  frozen, expected = _frozen()
  with tf.Graph().as_default() as g:
    variables = gg.thaw(frozen, select=select)
    assert [v.op.name for v in variables] == [
        "conv1/kernel", "conv1/bias", "out/kernel", "out/bias"]
    logits = g.get_tensor_by_name("logits:0")
    assert gg.analyze(tf.reduce_sum(logits)).names == ("conv1", "out")
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      # The frozen and the thawed graph share no ops (constants against
      # variables), and oneDNN may sum a convolution in another order in
      # each: equal to float32 rounding of the O(1) logits, not bit for bit.
      np.testing.assert_allclose(sess.run(logits, {"x:0": X}), expected,
                                 rtol=1e-6, atol=1e-7)


def test_a_path_that_is_not_a_graph_def(tmp_path):
  text = tmp_path / "notes.pb"
  text.write_text("this is not a protobuf\n")
  with tf.Graph().as_default():
    with pytest.raises(gg.GraphGradError,
                       match=r"notes\.pb' is not a GraphDef, binary or text\. "
                             r"Pass a frozen graph written by "
                             r"tf\.io\.write_graph"):
      gg.thaw(str(text))
    with pytest.raises(gg.GraphGradError, match=r"no such file: .*nope\.pb"):
      gg.thaw(str(tmp_path / "nope.pb"))
    with pytest.raises(gg.GraphGradError, match=r"is a directory.*SavedModel"):
      gg.thaw(str(tmp_path))
    with pytest.raises(gg.GraphGradError,
                       match=r"GraphDef or the path of a binary \.pb file; "
                             r"got int"):
      gg.thaw(3)


def test_a_meta_graph_file_is_not_a_graph_def(tmp_path):
  with tf.Graph().as_default():
    tf1.Variable(1.0, name="v")
    tf1.train.export_meta_graph(str(tmp_path / "m.meta"))
  with tf.Graph().as_default():
    with pytest.raises(
        gg.GraphGradError, match=r"a \.meta file is a MetaGraph"):
      gg.thaw(str(tmp_path / "m.meta"))


def test_select_that_matches_nothing():
  frozen, _ = _frozen()
  with tf.Graph().as_default():
    with pytest.raises(gg.GraphGradError,
                       match=r"`select` regex 'encoder' matched no Const node"
                             r".*Weight-like constants it holds: conv1/kernel"):
      gg.thaw(frozen, select="encoder")
    with pytest.raises(gg.GraphGradError, match=r"predicate .* matched no"):
      gg.thaw(frozen, select=lambda node: False)


def test_select_that_matches_integer_constants():
  frozen, _ = _frozen()
  with tf.Graph().as_default():
    with pytest.raises(gg.GraphGradError,
                       match=r"matched constants that are not floating-point: "
                             r"Reshape/shape \(int32\).*Narrow `select`"):
      gg.thaw(frozen, select=r"^(Reshape|hidden)/")


def test_select_names_that_are_not_constants():
  frozen, _ = _frozen()
  with tf.Graph().as_default():
    with pytest.raises(gg.GraphGradError,
                       match=r"`select` names 'conv1/Conv2D', which is not a "
                             r"Const node"):
      gg.thaw(frozen, select=["conv1/kernel", "conv1/Conv2D"])
    with pytest.raises(gg.GraphGradError, match=r"not a valid regular"):
      gg.thaw(frozen, select="conv1/(")
    with pytest.raises(gg.GraphGradError, match=r"a list of node names or a "
                                                r"predicate on NodeDef; got"):
      gg.thaw(frozen, select=3)


def test_names_already_taken():
  frozen, _ = _frozen()
  with tf.Graph().as_default():
    gg.thaw(frozen)
    with pytest.raises(
        gg.GraphGradError,
        match=r"already has ops named conv1/kernel.*name=\.\.\."):
      gg.thaw(frozen)
    assert gg.thaw(frozen, name="copy")[0].op.name == "copy/conv1/kernel"


def test_control_dependencies_on_a_constant_move_to_its_variable():
  with tf.Graph().as_default() as frozen:
    x = tf1.placeholder(tf.float32, [None, 2], name="x")
    w = tf.constant([[1.0], [2.0]], name="dense/kernel")
    with tf.control_dependencies([w.op]):
      z = tf.identity(x, name="z")
    tf.matmul(z, w, name="y")
  with tf.Graph().as_default() as g:
    (v,) = gg.thaw(frozen.as_graph_def())
    y = g.get_tensor_by_name("y:0")
    assert [op.name for op in g.get_operation_by_name("z").control_inputs] == [
        "dense/kernel/thaw/ReadVariableOp"]
    loss = tf.reduce_sum(y)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      np.testing.assert_array_equal(
          sess.run(tf.gradients(loss, v)[0], {"x:0": [[1.0, 3.0]]}),
          [[1.0], [3.0]])
