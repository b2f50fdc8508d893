"""A transform that changes a gradient's shape fails, naming what it was."""

import re

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense

tf1 = tf.compat.v1


def _halve_batch(g):
  """A transform of the wrong run-time shape: drops half the batch."""
  return g[: tf.shape(g)[0] // 2]


def _net(batch):
  x = tf1.placeholder(tf.float32, [batch, 3], name="x")
  h = dense(dense(x, 4, "l1", tf.tanh), 4, "l2", tf.tanh)
  return x, tf.reduce_sum(dense(h, 2, "l3"))


def test_a_wrong_run_time_shape_names_the_transform_layer_and_shapes(graph):
  x, loss = _net(None)
  plan = gg.GradientPlan(loss).transform_upstream("l2", _halve_batch)
  grads = [g for g, _ in plan.compute_gradients()]
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
      sess.run(grads, {x: np.ones((4, 3), np.float32)})
  message = info.value.message
  # TF escapes the quotes of the assertion's message.
  assert re.search(r"transform_upstream\(\\?'l2\\?'\) on l2/Tanh:0: the "
                   r"transform .*_halve_batch", message), message
  assert "static (None, 4) for (None, 4)" in message
  assert "[4 4]" in message and "[2 4]" in message  # both run-time shapes


def test_a_right_run_time_shape_gives_the_reference_gradients(graph):
  x, loss = _net(None)
  plan = gg.GradientPlan(loss).transform_upstream("l2", lambda g: 0.5 * g)
  gv = plan.compute_gradients()
  ref = tf.gradients(loss, [v for _, v in gv])
  weights = [0.5 if v.op.name.startswith("l1/") else 1.0 for _, v in gv]
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    feed = {x: np.arange(12.0).reshape(4, 3) / 12}
    got, want = sess.run([[g for g, _ in gv], ref], feed)
  for a, b, w in zip(got, want, weights):
    np.testing.assert_allclose(a, w * b, rtol=1e-6)


def test_a_static_shape_mismatch_fails_at_build_time(graph):
  _, loss = _net(4)
  plan = gg.GradientPlan(loss).transform_upstream("l2", _halve_batch)
  with pytest.raises(gg.GraphGradError,
                     match=r"transform_upstream\('l2'\) on l2/Tanh:0: the "
                     r"transform .*_halve_batch.* changed the gradient "
                     r"from shape \(4, 4\) float32 to shape \(2, 4\)"):
    plan.compute_gradients()


def test_builtin_transforms_add_no_run_time_check(graph):
  _, loss = _net(None)
  plan = gg.GradientPlan(loss).transform_upstream("l2",
                                                  gg.transforms.scale(0.5))
  plan.compute_gradients()
  assert not [op for op in graph.get_operations() if "check_shape" in op.name]
