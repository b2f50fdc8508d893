"""The seed recipe, by hand and as a plan, in three graph styles."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import assert_grads_close, dense, evaluate

tf1 = tf.compat.v1


def _layers_dense(x, units, name):
  return tf1.layers.dense(
      x, units, name=name,
      kernel_initializer=tf1.random_normal_initializer(seed=len(name)),
      bias_initializer=tf1.random_normal_initializer(seed=len(name) + 1))


def _build(style):
  x = tf1.placeholder(tf.float32, [None, 10])
  y = tf1.placeholder(tf.float32, [None, 2])
  if style == "layers":
    h = _layers_dense(x, 20, "l1_dense")
    logits = _layers_dense(h, 2, "l2_dense")
  elif style == "get_variable":
    h = dense(x, 20, "l1_dense")
    logits = dense(h, 2, "l2_dense")
  else:  # an activation between the layers, outside both scopes
    h = tf.nn.relu(dense(x, 20, "l1_dense"))
    logits = dense(h, 2, "l2_dense")
  loss = tf.reduce_mean(
      tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits))
  rng = np.random.default_rng(7)
  feed = {x: rng.normal(size=(16, 10)).astype(np.float32),
          y: np.eye(2, dtype=np.float32)[rng.integers(0, 2, 16)]}
  return loss, logits, feed


def _upstream_fn(g):
  # Nonlinear, so that the test can tell where it is applied.
  return 3.0 * g - 0.05 * tf.sign(g)


@pytest.mark.parametrize("style", ["layers", "get_variable", "activation"])
def test_plan_reproduces_the_seed_recipe_exactly(graph, style):
  loss, l2_out, feed = _build(style)
  # The seed recipe, by hand.
  optimizer = tf1.train.AdamOptimizer(0.001)
  l2_vars = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "l2_dense")
  l1_vars = tf1.get_collection(tf1.GraphKeys.TRAINABLE_VARIABLES, "l1_dense")
  l2_gv = optimizer.compute_gradients(loss, var_list=l2_vars)
  custom_l2 = [g * 0.8 for g, _ in l2_gv]
  d_l2 = tf.gradients(loss, l2_out)[0]
  l1_grads = tf.gradients(l2_out, l1_vars, grad_ys=_upstream_fn(d_l2))
  # The plan.
  plan = (gg.GradientPlan(loss)
          .transform_upstream("l2_dense", _upstream_fn)
          .transform_gradients("l2_dense", gg.transforms.scale(0.8)))
  gv = dict((v.name, g) for g, v in plan.compute_gradients())
  got = [gv[v.name] for v in l1_vars + l2_vars]
  actual, expected = evaluate([got, l1_grads + custom_l2], feed)
  assert_grads_close(actual, expected, rtol=0, atol=0)  # the same ops
  # The modification is not a no-op.
  plain = evaluate(tf.gradients(loss, l1_vars), feed)
  assert not np.allclose(actual[0], plain[0])


def test_seed_plan_trains_with_one_apply_gradients(graph):
  loss, _, feed = _build("get_variable")
  step = tf1.train.get_or_create_global_step()
  plan = (gg.GradientPlan(loss)
          .transform_upstream("l2_dense", gg.transforms.add_noise(0.01, seed=3))
          .transform_gradients("l2_dense", gg.transforms.scale(0.8)))
  train = plan.apply_gradients(tf1.train.AdamOptimizer(0.01), global_step=step)
  assert isinstance(train, tf.Operation)
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    first = sess.run(loss, feed)
    for _ in range(30):
      sess.run(train, feed)
    assert sess.run(step) == 30
    assert sess.run(loss, feed) < first
