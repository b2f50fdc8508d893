"""Outside a plain tf.Graph, the TF1 entry points point to gg.KerasPlan."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense

tf1 = tf.compat.v1
KERAS = r"use gg.KerasPlan\(model\)"


def _net():
  x = tf.constant(np.ones((2, 3)), tf.float32)
  return tf.reduce_sum(dense(dense(x, 3, "l1"), 2, "l2"))


def test_eager_loss_points_to_keras_plan():
  loss = tf.constant(2.0)
  with pytest.raises(gg.GraphGradError,
                     match=rf"gg.analyze: `loss` is an eager tensor.*{KERAS}"):
    gg.analyze(loss)
  with pytest.raises(gg.GraphGradError,
                     match=rf"gg.GradientPlan: `loss` is an eager.*{KERAS}"):
    gg.GradientPlan(loss)


@pytest.mark.parametrize("entry", ["analyze", "plan", "compute_gradients"])
def test_inside_tf_function_points_to_keras_plan(entry):
  w = tf.Variable([[1.0], [2.0]])
  x = tf.constant([[1.0, 1.0]])

  @tf.function
  def step():
    loss = tf.reduce_sum(x @ w)
    if entry == "analyze":
      gg.analyze(loss)
    elif entry == "plan":
      gg.GradientPlan(loss)
    else:
      # This returned [] before: the traced graph keeps no variable
      # collection, so a plan there saw no variable.
      gg.GradientPlan(loss).compute_gradients()
    return loss

  what = "gg.analyze" if entry == "analyze" else "gg.GradientPlan"
  with pytest.raises(gg.GraphGradError,
                     match=rf"{what}: called inside a tf.function.*{KERAS}"):
    step()


def test_a_graph_plan_used_inside_tf_function_is_refused():
  with tf.Graph().as_default():
    plan = gg.GradientPlan(_net())
    opt = tf1.train.GradientDescentOptimizer(0.1)

  @tf.function
  def build(which):
    if which == "compute":
      plan.compute_gradients()
    else:
      plan.apply_gradients(opt)
    return tf.constant(0.0)

  with pytest.raises(gg.GraphGradError, match=r"GradientPlan.compute_gradients:"
                     r" called inside a tf.function"):
    build("compute")
  with pytest.raises(gg.GraphGradError, match=r"GradientPlan.apply_gradients: "
                     r"called inside a tf.function"):
    build("apply")


def test_finalized_graph_says_to_build_the_plan_before_finalize(graph):
  loss = _net()
  early = gg.GradientPlan(loss).transform_upstream("l2",
                                                   gg.transforms.scale(0.5))
  built = gg.GradientPlan(loss)
  grads = built.compute_gradients()
  graph.finalize()
  # Analysis only reads the graph: it still works.
  assert gg.analyze(loss).names == ("l1", "l2")
  # A plan built before finalize() keeps its gradients.
  assert built.compute_gradients() == grads
  fix = r"is finalized.*Build the plan, up to .* before finalize\(\)"
  with pytest.raises(gg.GraphGradError, match=rf"gg.GradientPlan: the tf.Graph "
                     rf"of the loss {loss.name} {fix}"):
    gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError,
                     match=rf"GradientPlan.compute_gradients: .*{fix}"):
    early.compute_gradients()
  with pytest.raises(gg.GraphGradError,
                     match=rf"GradientPlan.apply_gradients: .*{fix}"):
    built.apply_gradients(tf1.train.GradientDescentOptimizer(0.1))


def test_plain_graph_plan_is_unaffected(graph):
  loss = _net()
  plan = gg.GradientPlan(loss)
  got = [g for g, _ in plan.compute_gradients()]
  want = tf.gradients(loss, tf1.trainable_variables())
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    for a, b in zip(sess.run(got), sess.run(want)):
      np.testing.assert_allclose(a, b)
