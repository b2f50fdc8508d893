"""Plans on grouped layers and on Keras layers in a TF1 graph."""

import tensorflow as tf

import graphgrad as gg
from helpers import assert_grads_close, dense, evaluate, feed

tf1 = tf.compat.v1


def test_upstream_on_a_depth_grouped_block(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(x, 5, "net/block1/conv", tf.tanh)
  h = dense(h, 5, "net/block1/proj")
  b1 = h
  h = dense(tf.nn.relu(h), 5, "net/block2/conv", tf.tanh)
  b2 = dense(h, 3, "net/block2/proj")
  loss = tf.reduce_sum(tf.square(b2)) + tf.reduce_sum(b1)  # b1 also a head
  net = gg.analyze(loss, depth=2)
  assert net.names == ("net/block1", "net/block2")
  plan = gg.GradientPlan(loss, net).transform_upstream(
      "net/block2", gg.transforms.scale(0.1))
  got = [g for g, _ in plan.compute_gradients()]
  block1 = tf1.trainable_variables("net/block1")
  g_b2 = tf.gradients(loss, b2)[0]
  through = tf.gradients(b2, block1, grad_ys=0.1 * g_b2)
  head = tf.gradients(tf.reduce_sum(b1), block1)
  want = [a + b for a, b in zip(through, head)]
  actual, expected = evaluate([got[:4], want], feed(x))
  assert_grads_close(actual, expected)


def test_keras_functional_model_in_a_tf1_graph_with_a_plan(graph):
  keras = tf.keras  # tf-keras: the test conftest sets TF_USE_LEGACY_KERAS
  inp = keras.Input((6,))
  h = keras.layers.Dense(5, activation="tanh", name="hidden")(inp)
  h2 = keras.layers.Dense(4, activation="tanh", name="middle")(h)
  out = keras.layers.Dense(2, name="logits")(
      keras.layers.Concatenate()([h, h2]))
  model = keras.Model(inp, out)
  loss = tf.reduce_sum(tf.square(model.output))
  net = gg.analyze(loss)
  assert net.names == ("hidden", "middle", "logits")
  assert set(net.graph.edges) == {("hidden", "middle"), ("hidden", "logits"),
                                  ("middle", "logits")}
  plan = (gg.GradientPlan(loss, net)
          .transform_upstream("middle", gg.transforms.scale(-1.0))
          .transform_edge("hidden", "logits", gg.transforms.scale(2.0)))
  got = dict((v.name, g) for g, v in plan.compute_gradients())
  hidden = model.get_layer("hidden").trainable_weights
  g_h2 = tf.gradients(loss, h2)[0]
  via_middle = tf.gradients(h2, hidden, grad_ys=-g_h2)
  direct = tf.gradients(loss, hidden, stop_gradients=[h2])
  want = [a + 2.0 * b for a, b in zip(via_middle, direct)]
  actual, expected = evaluate([[got[v.name] for v in hidden], want],
                              feed(model.input))
  assert_grads_close(actual, expected)
