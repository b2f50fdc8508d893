"""The full loop on a model that exists only as .meta plus checkpoint."""

import numpy as np
import tensorflow as tf

import graphgrad as gg
from helpers import assert_grads_close, dense

tf1 = tf.compat.v1

RNG = np.random.default_rng(3)
BATCHES = [(RNG.normal(size=(16, 6)).astype(np.float32),
            np.eye(3, dtype=np.float32)[RNG.integers(0, 3, 16)])
           for _ in range(6)]


def _save_model(path, use_resource=True):
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 6], name="x")
    y = tf1.placeholder(tf.float32, [None, 3], name="y")
    with tf1.variable_scope("", use_resource=use_resource):
      h = dense(x, 8, "encoder", tf.nn.relu)
      logits = dense(h, 3, "classifier")
    tf.identity(tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
        labels=y, logits=logits)), name="loss")
    saver = tf1.train.Saver()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      saver.save(sess, str(path / "model"))
  return str(path / "model")


def _plan_train_op(graph):
  loss = graph.get_tensor_by_name("loss:0")
  net = gg.analyze(loss)
  step = tf1.train.get_or_create_global_step()
  plan = (gg.GradientPlan(loss, net)
          .transform_upstream("classifier", gg.transforms.clip_by_norm(0.05))
          .transform_gradients("encoder", gg.transforms.scale(0.5)))
  train = plan.apply_gradients(tf1.train.AdamOptimizer(0.01), global_step=step,
                               name="train")
  tf1.add_to_collection("train_op", train)
  return net, plan, train


def _train(sess, graph, train, batches):
  x, y = graph.get_tensor_by_name("x:0"), graph.get_tensor_by_name("y:0")
  for xb, yb in batches:
    sess.run(train, {x: xb, y: yb})


def _values(sess):
  return sess.run(tf1.global_variables())


def test_import_transform_train_save_restore_resume(tmp_path):
  prefix = _save_model(tmp_path)
  # Straight through: import, restore, six steps.
  with tf.Graph().as_default() as g:
    saver = tf1.train.import_meta_graph(prefix + ".meta")
    net, plan, train = _plan_train_op(g)
    assert net.names == ("encoder", "classifier")
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      saver.restore(sess, prefix)
      _train(sess, g, train, BATCHES)
      straight = _values(sess)
      names = [v.name for v in tf1.global_variables()]
  # Three steps, save everything (slots and global step included) ...
  with tf.Graph().as_default() as g:
    saver = tf1.train.import_meta_graph(prefix + ".meta")
    _, _, train = _plan_train_op(g)
    full_saver = tf1.train.Saver()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      saver.restore(sess, prefix)
      _train(sess, g, train, BATCHES[:3])
      full_saver.save(sess, str(tmp_path / "resumed"))
  # ... then import that checkpoint's MetaGraph, with the plan's train op in
  # it, restore, and run the last three steps.
  with tf.Graph().as_default() as g:
    saver = tf1.train.import_meta_graph(str(tmp_path / "resumed.meta"))
    train = tf1.get_collection("train_op")[0]
    with tf1.Session() as sess:
      saver.restore(sess, str(tmp_path / "resumed"))
      assert sess.run(tf1.train.get_global_step()) == 3
      _train(sess, g, train, BATCHES[3:])
      resumed = dict(zip([v.name for v in tf1.global_variables()],
                         _values(sess)))
  assert any("Adam" in n for n in names)  # optimizer slots round-tripped
  assert_grads_close([resumed[n] for n in names], straight, rtol=1e-6,
                     atol=1e-7)
  assert resumed["global_step:0"] == 6


def test_imported_graph_gradients_match_a_hand_reference(tmp_path):
  prefix = _save_model(tmp_path)
  with tf.Graph().as_default() as g:
    saver = tf1.train.import_meta_graph(prefix + ".meta")
    loss = g.get_tensor_by_name("loss:0")
    logits = g.get_tensor_by_name("classifier/BiasAdd:0")
    plan = gg.GradientPlan(loss).transform_upstream(
        "classifier", gg.transforms.scale(3.0))
    got = [gr for gr, _ in plan.compute_gradients()]
    enc = tf1.trainable_variables("encoder")
    g_logits = tf.gradients(loss, logits)[0]
    want = (tf.gradients(logits, enc, grad_ys=3.0 * g_logits)
            + tf.gradients(loss, tf1.trainable_variables("classifier")))
    x, y = g.get_tensor_by_name("x:0"), g.get_tensor_by_name("y:0")
    with tf1.Session() as sess:
      saver.restore(sess, prefix)
      feed = {x: BATCHES[0][0], y: BATCHES[0][1]}
      actual, expected = sess.run([got, want], feed)
  assert_grads_close(actual, expected)


def test_legacy_reference_variables(tmp_path):
  prefix = _save_model(tmp_path, use_resource=False)
  with tf.Graph().as_default() as g:
    saver = tf1.train.import_meta_graph(prefix + ".meta")
    assert g.get_operation_by_name("encoder/kernel").type == "VariableV2"
    net, plan, train = _plan_train_op(g)
    assert [v.name for v in net["encoder"].variables] == [
        "encoder/kernel:0", "encoder/bias:0"]
    loss = g.get_tensor_by_name("loss:0")
    logits = g.get_tensor_by_name("classifier/BiasAdd:0")
    enc = list(net["encoder"].variables)
    got = dict((v.name, gr) for gr, v in plan.compute_gradients())
    g_logits = tf.gradients(loss, logits)[0]
    want = [0.5 * gr for gr in tf.gradients(
        logits, enc, grad_ys=tf.clip_by_norm(g_logits, 0.05))]
    x, y = g.get_tensor_by_name("x:0"), g.get_tensor_by_name("y:0")
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      saver.restore(sess, prefix)
      feed = {x: BATCHES[0][0], y: BATCHES[0][1]}
      actual, expected = sess.run([[got[v.name] for v in enc], want], feed)
      assert_grads_close(actual, expected)
      before = sess.run(loss, feed)
      for _ in range(20):
        sess.run(train, feed)
      assert sess.run(loss, feed) < before
