"""Every error GradientPlan raises, with its message."""

import logging

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import assert_grads_close, dense, evaluate, trainable

tf1 = tf.compat.v1


@pytest.fixture
def loss(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  return tf.reduce_sum(tf.square(dense(dense(x, 3, "l1"), 2, "l2")))


def test_shape_changing_transform_names_layer_and_shapes(loss):
  plan = gg.GradientPlan(loss).transform_upstream(
      "l2", lambda g: tf.reduce_sum(g, 0))
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"transform_upstream\('l2'\) on l2/BiasAdd:0: .* "
                           r"from shape \(None, 2\) float32 "
                           r"to shape \(2,\) float32"):
    plan.compute_gradients()


def test_dtype_changing_transform(loss):
  plan = gg.GradientPlan(loss).transform_gradients(
      "l1", lambda g: tf.cast(g, tf.float64))
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"transform_gradients\('l1'\) on l1/kernel:0.*"
                           r"float32 to shape \(4, 3\) float64"):
    plan.compute_gradients()


def test_transform_returning_none_or_garbage(loss):
  with pytest.raises(gg.IncompatibleGradientError, match=r"returned None"):
    gg.GradientPlan(loss).transform_gradients("l1", lambda g: None
                                              ).compute_gradients()
  with pytest.raises(gg.IncompatibleGradientError, match=r"not a tensor"):
    gg.GradientPlan(loss).transform_gradients("l1", lambda g: object()
                                              ).compute_gradients()


def test_transform_turning_sparse_into_dense(graph):
  ids = tf1.placeholder(tf.int32, [None])
  with tf1.variable_scope("embed"):
    table = tf1.get_variable("table", [10, 3])
  loss = tf.reduce_sum(dense(tf.nn.embedding_lookup(table, ids), 2, "top"))
  plan = gg.GradientPlan(loss).transform_gradients(
      "embed", gg.transforms.as_transform(lambda g: g))
  plan.compute_gradients()  # a plain callable acts on .values: fine

  class Densify(gg.transforms.Transform):
    def __call__(self, grad, context=None):
      return tf.convert_to_tensor(grad)

  plan = gg.GradientPlan(loss).transform_gradients("embed", Densify())
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"turned a IndexedSlices gradient into a .*Tensor"):
    plan.compute_gradients()


def test_constructor_arguments(loss):
  with pytest.raises(gg.GraphGradError, match=r"`net` must be a gg.LayerGraph"):
    gg.GradientPlan(loss, net="l1")
  other = tf.identity(loss)
  with pytest.raises(
      gg.GraphGradError, match=r"`net` was analysed for the loss"):
    gg.GradientPlan(other, net=gg.analyze(loss))
  with pytest.raises(gg.GraphGradError, match=r"`gate_gradients` must be"):
    gg.GradientPlan(loss, gate_gradients=5)
  with pytest.raises(
      gg.GraphGradError, match=r"`var_list` must hold tf.Variable"):
    gg.GradientPlan(loss, var_list=[loss])
  with pytest.raises(gg.GraphGradError, match=r"`var_list` is empty"):
    gg.GradientPlan(loss, var_list=[])
  with tf.Graph().as_default():
    foreign = tf1.get_variable("foreign", [1])
  with pytest.raises(gg.GraphGradError, match=r"from another tf.Graph"):
    gg.GradientPlan(loss, var_list=[foreign])


def test_declaring_after_build_and_bad_fns(loss):
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError, match=r"`fn` must be a callable"):
    plan.transform_upstream("l2", 0.5)
  with pytest.raises(gg.LayerNotFoundError, match=r"no layer named 'l9'"):
    plan.transform_gradients("l9", gg.transforms.scale(0.5))
  plan.compute_gradients()
  with pytest.raises(gg.GraphGradError, match=r"already built"):
    plan.transform_upstream("l2", gg.transforms.scale(0.5))


def test_optimizer_must_apply_gradients(loss):
  with pytest.raises(
      gg.GraphGradError, match=r"`optimizer` must have an apply_gradients"):
    gg.GradientPlan(loss).apply_gradients(object())


def test_cut_op_with_a_variant_output_is_refused(graph):
  x = tf1.placeholder(tf.float32, [None, 3])
  with tf1.variable_scope("loop"):
    w = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
    ta = tf.TensorArray(tf.float32, size=3)

    def body(i, h, ta):
      h = tf.tanh(tf.matmul(h, w))
      return i + 1, h, ta.write(i, h)

    _, h, ta = tf.while_loop(lambda i, h, ta: i < 3, body,
                             (tf.constant(0), x, ta))
  stacked = ta.stack()  # glue: reads the loop's TensorList output
  loss = tf.reduce_sum(dense(h, 2, "top")) + tf.reduce_sum(stacked)
  plan = gg.GradientPlan(loss).transform_upstream(
      "loop", gg.transforms.scale(2.0))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"into layer 'loop' through its variant output"):
    plan.compute_gradients()


def test_variant_input_of_a_rewritten_layer_is_refused(graph):
  x = tf1.placeholder(tf.float32, [3, 4])
  lower = dense(x, 4, "lower", tf.tanh)
  ta = tf.TensorArray(tf.float32, size=3).unstack(lower)  # glue TensorList
  with tf1.variable_scope("reader"):
    w = tf1.get_variable("w", initializer=np.ones((4, 2), np.float32))
    out = tf.matmul(ta.stack(), w)  # reads the TensorList inside the layer
  loss = tf.reduce_sum(out)
  plan = gg.GradientPlan(loss).transform_upstream(
      "reader", gg.transforms.scale(2.0))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"layer 'reader' takes the variant input"):
    plan.compute_gradients()


# -- variables the loss depends on that get no gradient ------------------------

def _rounded_layers():
  x = tf.constant(np.random.default_rng(4).normal(size=(5, 3)), tf.float32)
  h = tf.round(dense(x, 4, "l1") * 3.0)
  return tf.reduce_sum(tf.square(dense(h, 2, "l2")))


def test_an_op_without_gradient_between_layers_warns_once(graph, caplog):
  loss = _rounded_layers()
  plan = gg.GradientPlan(loss).transform_gradients(
      "l2", gg.transforms.scale(0.5))
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    gv = plan.compute_gradients()
    plan.compute_gradients()
    plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1))
  messages = [r.getMessage() for r in caplog.records
              if r.name == "graphgrad"]
  assert messages == [
      "layer(s) 'l1' get no gradient from the loss Sum:0 (2 variable(s): "
      "l1/kernel, l1/bias): the op(s) Round (Round) between them and the loss "
      "have no gradient, so nothing reaches below them. To train through "
      "'Round', declare plan.straight_through('Round') (an identity backward "
      "pass) or plan.override_gradient('Round', fn); otherwise "
      "apply_gradients skips these variables."]
  assert [g is None for g, _ in gv] == [True, True, False, False]


def test_the_suggested_straight_through_trains_the_layer(graph, caplog):
  loss = _rounded_layers()
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    gv = gg.GradientPlan(loss).straight_through("Round").compute_gradients()
  assert not [r for r in caplog.records if r.name == "graphgrad"]
  # By hand: the identity backward pass of Round.
  graph = tf1.get_default_graph()
  with graph.gradient_override_map({"Round": "Identity"}):
    x = tf.constant(np.random.default_rng(4).normal(size=(5, 3)), tf.float32)
    with tf1.variable_scope("ref"):
      h = tf.round(dense(x, 4, "l1") * 3.0)
      ref_loss = tf.reduce_sum(tf.square(dense(h, 2, "l2")))
  ref = tf.gradients(ref_loss, trainable("ref"))
  assert_grads_close(*evaluate([[g for g, _ in gv], ref]))
