"""Loops and conds inside layers; boundaries inside loops are refused."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import assert_grads_close, dense, evaluate, feed, trainable

tf1 = tf.compat.v1


def _check_upstream_scale(loss, top_out, lower_scope, top, feed, c=0.5):
  plan = gg.GradientPlan(loss).transform_upstream(top, gg.transforms.scale(c))
  got = dict((v.name, g) for g, v in plan.compute_gradients())
  lower = trainable(lower_scope)
  g_top = tf.gradients(loss, top_out)[0]
  want = tf.gradients(top_out, lower, grad_ys=c * g_top)
  actual, expected = evaluate([[got[v.name] for v in lower], want], feed)
  assert_grads_close(actual, expected)
  assert any(np.abs(a).sum() > 0 for a in actual)


def test_while_loop_inside_a_layer_below_the_boundary(graph):
  x = tf1.placeholder(tf.float32, [None, 3])
  with tf1.variable_scope("rnn"):
    w = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32) * 0.5)
    _, h = tf.while_loop(lambda i, h: i < 4,
                         lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w) + x)),
                         (tf.constant(0), x))
  top = dense(h, 2, "top")
  _check_upstream_scale(tf.reduce_sum(tf.square(top)), top, "rnn", "top",
                        feed(x, rows=4))


def test_dynamic_rnn_below_the_boundary(graph):
  x = tf1.placeholder(tf.float32, [None, 5, 3])
  cell = tf1.nn.rnn_cell.BasicRNNCell(4)
  outputs, _ = tf1.nn.dynamic_rnn(cell, x, dtype=tf.float32)
  top = dense(outputs[:, -1], 2, "top")
  loss = tf.reduce_sum(tf.square(top))
  net = gg.analyze(loss)
  assert "top" in net
  rnn_scope = [n for n in net.names if n != "top"][0]
  _check_upstream_scale(loss, top, rnn_scope, "top", feed(x, rows=4), c=-2.0)


def test_cond_inside_a_layer(graph):
  x = tf1.placeholder(tf.float32, [None, 3])
  flag = tf1.placeholder_with_default(True, [])
  with tf1.variable_scope("gate"):
    w = tf1.get_variable("w", initializer=np.ones((3, 3), np.float32))
    h = tf.cond(flag, lambda: tf.tanh(tf.matmul(x, w)),
                lambda: tf.matmul(x, 2.0 * w))
  top = dense(h, 2, "top")
  _check_upstream_scale(tf.reduce_sum(tf.square(top)), top, "gate", "top",
                        feed(x, rows=4), c=3.0)


def test_layer_inside_a_v2_loop_body_has_nothing_to_rewrite(graph):
  x = tf1.placeholder(tf.float32, [None, 3])
  with tf1.variable_scope("cell"):
    w = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
  _, h = tf.while_loop(lambda i, h: i < 3,
                       lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))),
                       (tf.constant(0), x))
  loss = tf.reduce_sum(dense(h, 2, "top"))
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError, match=r"layer 'cell' has no floating-point output"):
    plan.transform_upstream("cell", gg.transforms.scale(2.0))


def test_boundary_inside_a_v1_while_loop_is_refused():
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  was_enabled = control_flow_util.ENABLE_CONTROL_FLOW_V2
  tf1.disable_control_flow_v2()
  try:
    with tf.Graph().as_default():
      x = tf1.placeholder(tf.float32, [None, 3])
      with tf1.variable_scope("inner"):
        w = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))

      def body(i, h):
        with tf1.variable_scope("inner", reuse=True):
          w_in = tf1.get_variable("w")
          return i + 1, tf.tanh(tf.matmul(h, w_in))

      _, h = tf1.while_loop(lambda i, h: i < 3, body, (tf.constant(0), x))
      loss = tf.reduce_sum(dense(h, 2, "top"))
      net = gg.analyze(loss)
      assert "inner" in net
      plan = gg.GradientPlan(loss, net).transform_upstream(
          "inner", gg.transforms.scale(2.0))
      with pytest.raises(gg.UnsupportedGraphError,
                         match=r"inside a tf.compat.v1 while loop or cond"):
        plan.compute_gradients()
      # A boundary outside the loop is fine: the loop is backpropagated whole.
      plan = gg.GradientPlan(loss, net).transform_upstream(
          "top", gg.transforms.scale(2.0))
      top_out = loss.op.inputs[0]
      got = dict((v.name, g) for g, v in plan.compute_gradients())
      want = tf.gradients(loss, w)[0] * 2.0
      actual, expected = evaluate([got[w.name], want], feed(x, rows=4))
      np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
      del top_out
  finally:
    if was_enabled:
      tf1.enable_control_flow_v2()
