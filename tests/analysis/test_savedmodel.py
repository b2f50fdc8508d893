"""A v1 SavedModel: load it, analyse it, train it with a plan, save it again."""

import numpy as np
import tensorflow as tf

import graphgrad as gg
from helpers import assert_grads_close, dense

tf1 = tf.compat.v1
RNG = np.random.default_rng(5)
X = RNG.normal(size=(16, 6)).astype(np.float32)
Y = np.eye(3, dtype=np.float32)[RNG.integers(0, 3, 16)]


def _simple_save(path):
  """An inference model, saved with simple_save: no loss in its signature."""
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 6], name="x")
    h = dense(x, 8, "encoder", tf.nn.relu)
    h = dense(h, 8, "hidden", tf.nn.relu)
    logits = tf.identity(dense(h, 3, "classifier"), name="logits")
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      tf1.saved_model.simple_save(sess, str(path), inputs={"x": x},
                                  outputs={"logits": logits})


def _signature_tensors(graph, meta_graph):
  sig = meta_graph.signature_def["serving_default"]
  return (graph.get_tensor_by_name(sig.inputs["x"].name),
          graph.get_tensor_by_name(sig.outputs["logits"].name))


def test_load_analyse_train_with_a_plan_and_save_again(tmp_path):
  _simple_save(tmp_path / "v1")
  with tf.Graph().as_default() as g, tf1.Session() as sess:
    meta = tf1.saved_model.loader.load(sess, ["serve"], str(tmp_path / "v1"))
    x, logits = _signature_tensors(g, meta)
    loaded = tf1.global_variables()
    y = tf1.placeholder(tf.float32, [None, 3], name="y")
    loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
        labels=y, logits=logits))
    net = gg.analyze(loss)
    assert net.names == ("encoder", "hidden", "classifier")
    plan = (gg.GradientPlan(loss, net)
            .transform_upstream("hidden", gg.transforms.scale(0.5))
            .transform_gradients("classifier", gg.transforms.scale(2.0)))
    gv = plan.compute_gradients()
    plain = tf.gradients(loss, [v for _, v in gv])
    factor = {"encoder": 0.5, "hidden": 1.0, "classifier": 2.0}
    expected = [p * factor[net.layer_of_variable(v)]
                for p, (_, v) in zip(plain, gv)]
    train = plan.apply_gradients(tf1.train.MomentumOptimizer(0.05, 0.9))
    sess.run(tf1.variables_initializer(
        [v for v in tf1.global_variables() if v not in loaded]))
    feed = {x: X, y: Y}
    assert_grads_close(sess.run([g for g, _ in gv], feed),
                       sess.run(expected, feed), rtol=1e-6)
    losses = [sess.run([train, loss], feed)[1] for _ in range(10)]
    assert losses[-1] < losses[0]
    trained = sess.run(logits, {x: X})
    builder = tf1.saved_model.Builder(str(tmp_path / "v2"))
    builder.add_meta_graph_and_variables(
        sess, ["serve", "train"],
        signature_def_map={"serving_default": meta.signature_def[
            "serving_default"]})
    builder.save()
  with tf.Graph().as_default() as g, tf1.Session() as sess:
    meta = tf1.saved_model.loader.load(sess, ["serve", "train"],
                                         str(tmp_path / "v2"))
    x, logits = _signature_tensors(g, meta)
    np.testing.assert_array_equal(sess.run(logits, {x: X}), trained)
