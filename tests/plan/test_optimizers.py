"""Which optimizers GradientPlan.apply_gradients accepts, and what they do."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import graphgrad as gg
from graphgrad.plan import _optimizer
from helpers import dense

tf1 = tf.compat.v1
LR = 0.125


def _net():
  x = tf.constant(np.random.default_rng(3).normal(size=(5, 4)), tf.float32)
  h = dense(x, 3, "l1", tf.nn.tanh)
  loss = tf.reduce_sum(tf.square(dense(h, 2, "l2")))
  return h, loss


def _plan_and_reference():
  """A plan halving l2's upstream, and the same gradients by tf.gradients."""
  h, loss = _net()
  variables = tf1.trainable_variables()
  l1, l2 = variables[:2], variables[2:]
  plan = gg.GradientPlan(loss).transform_upstream(
      "l2", gg.transforms.scale(0.5))
  g_h, = tf.gradients(loss, [h])
  ref = tf.gradients(h, l1, grad_ys=0.5 * g_h) + tf.gradients(loss, l2)
  return plan, variables, ref


def _step(train, variables, ref, step=None):
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    w0, g = sess.run([variables, ref])
    sess.run(train)
    w1 = sess.run(variables)
    return w0, g, w1, (sess.run(step) if step is not None else None)


def _assert_sgd_step(w0, g, w1):
  for a, b, grad in zip(w0, w1, g):
    # LR is a power of two: lr * g is exact, so w0 - lr * g rounds once, in
    # TensorFlow as in numpy.
    np.testing.assert_array_equal(b, a - np.float32(LR) * grad)
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("make", [
    lambda net: tf1.train.GradientDescentOptimizer(LR),
    lambda net: tf_keras.optimizers.legacy.SGD(LR),
    lambda net: gg.AfterAggregation(tf_keras.optimizers.legacy.SGD(LR), net),
], ids=["v1", "tf_keras_legacy", "after_aggregation_of_legacy"])
def test_accepted_optimizer_takes_the_sgd_step(graph, make):
  plan, variables, ref = _plan_and_reference()
  opt = make(plan.net)
  step = tf1.train.get_or_create_global_step()
  train = plan.apply_gradients(opt, global_step=step)
  assert isinstance(train, tf.Operation), type(train)
  w0, g, w1, n = _step(train, variables, ref, step)
  _assert_sgd_step(w0, g, w1)
  assert n == 1


def test_tf_keras_legacy_optimizer_without_global_step_returns_its_op(graph):
  plan, variables, ref = _plan_and_reference()
  opt = tf_keras.optimizers.legacy.SGD(LR)
  train = plan.apply_gradients(opt, name="train")
  assert isinstance(train, tf.Operation)
  w0, g, w1, _ = _step(train, variables, ref)
  _assert_sgd_step(w0, g, w1)


def test_an_object_with_apply_gradients_is_still_accepted(graph):
  class Wrapper:
    def __init__(self):
      self.inner = tf1.train.GradientDescentOptimizer(LR)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
      return self.inner.apply_gradients(grads_and_vars, global_step, name)

  plan, variables, ref = _plan_and_reference()
  w0, g, w1, _ = _step(plan.apply_gradients(Wrapper()), variables, ref)
  _assert_sgd_step(w0, g, w1)


def test_the_silent_no_op_of_newer_keras_optimizers_exists():
  """Why they are refused: TF1-graph apply_gradients changes no weight."""
  with tf.Graph().as_default():
    w = tf1.get_variable("w", initializer=[1.0, 2.0])
    opt = tf_keras.optimizers.SGD(LR)
    op = opt.apply_gradients([(tf.constant([1.0, 1.0]), w)])
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run(op)
      np.testing.assert_array_equal(sess.run(w), [1.0, 2.0])


@pytest.mark.parametrize("make,module", [
    (lambda: tf_keras.optimizers.SGD(LR), r"tf_keras\."),
    (lambda: tf_keras.optimizers.Adam(LR), r"tf_keras\."),
    (lambda: keras.optimizers.SGD(LR), r"keras\."),
], ids=["tf_keras_sgd", "tf_keras_adam", "keras3_sgd"])
def test_newer_keras_optimizers_are_refused_with_the_fix(graph, make, module):
  _, loss = _net()
  opt = make()
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError,
                     match=rf"`optimizer` is the Keras optimizer {module}.*"
                     r"running it changes no weight\. Pass a "
                     r"tf.compat.v1.train optimizer.*gg.KerasPlan"):
    plan.apply_gradients(opt)
  with pytest.raises(gg.GraphGradError, match=r"`optimizer` is the Keras"):
    gg.AfterAggregation(opt, gg.analyze(loss))


def test_an_optimizer_class_is_refused(graph):
  _, loss = _net()
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError,
                     match=r"`optimizer` must be an optimizer instance; got the "
                     r"class AdamOptimizer\. Create one: "
                     r"AdamOptimizer\(learning_rate=\.\.\.\)"):
    plan.apply_gradients(tf1.train.AdamOptimizer)
  with pytest.raises(gg.GraphGradError,
                     match=r"got the class SGD\. Pass a tf.compat.v1.train"):
    plan.apply_gradients(keras.optimizers.SGD)
  with pytest.raises(gg.GraphGradError, match=r"got the class SGD\. Create"):
    plan.apply_gradients(tf_keras.optimizers.legacy.SGD)


def test_plan_and_after_aggregation_share_one_check(graph):
  _, loss = _net()
  pattern = (r"`optimizer` must have an apply_gradients\(grads_and_vars, "
             r"global_step, name\) method.*got object\. Pass a")
  with pytest.raises(gg.GraphGradError, match=pattern):
    gg.GradientPlan(loss).apply_gradients(object())
  with pytest.raises(gg.GraphGradError, match=pattern):
    gg.AfterAggregation(object(), gg.analyze(loss))
  assert _optimizer.check_optimizer(
      tf1.train.SyncReplicasOptimizer(tf1.train.AdamOptimizer(0.1), 2)) == "v1"
  assert _optimizer.check_optimizer(
      tf_keras.optimizers.legacy.Adam(0.1)) == "keras_v2"
