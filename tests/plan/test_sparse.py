"""Sparse embedding gradients stay IndexedSlices through a plan."""

import warnings

import numpy as np
import tensorflow as tf

import graphgrad as gg
from helpers import assert_grads_close, dense, densify, evaluate

tf1 = tf.compat.v1


def _model(bypass=False):
  ids = tf1.placeholder(tf.int32, [None, 3])
  with tf1.variable_scope("embed"):
    table = tf1.get_variable(
        "table", initializer=np.random.default_rng(0).normal(
            size=(50, 4)).astype(np.float32))
    emb = tf.reshape(tf.nn.embedding_lookup(table, ids), [-1, 12])
  h = dense(emb, 6, "l1", tf.tanh)
  loss = tf.reduce_sum(tf.square(dense(h, 2, "l2")))
  if bypass:  # a second lookup reaches the table without passing l1
    loss += tf.reduce_sum(tf.nn.embedding_lookup(table, ids[:, :1]))
  feed = {ids: np.random.default_rng(1).integers(0, 50, size=(5, 3))}
  return table, emb, h, loss, feed


def _check_no_dense_warning(record):
  assert not [w for w in record if "dense" in str(w.message).lower()]


def test_embedding_below_a_transformed_boundary_stays_sparse(graph):
  table, emb, h, loss, feed = _model()
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    plan = gg.GradientPlan(loss).transform_upstream(
        "l1", gg.transforms.scale(2.0))
    grad = dict((v.name, g) for g, v in plan.compute_gradients())[table.name]
  _check_no_dense_warning(record)
  assert isinstance(grad, tf.IndexedSlices)
  g_h = tf.gradients(loss, h)[0]
  expected = tf.gradients(h, table, grad_ys=2.0 * g_h)[0]
  assert isinstance(expected, tf.IndexedSlices)
  actual, want = evaluate([grad, expected], feed)
  assert_grads_close([actual], [want])
  assert densify(actual).any()


def test_sparse_contributions_from_two_paths_are_summed_sparse(graph):
  table, emb, h, loss, feed = _model(bypass=True)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    plan = gg.GradientPlan(loss).transform_upstream(
        "l1", gg.transforms.scale(-3.0))
    grad = dict((v.name, g) for g, v in plan.compute_gradients())[table.name]
  _check_no_dense_warning(record)
  assert isinstance(grad, tf.IndexedSlices)
  g_h = tf.gradients(loss, h)[0]
  through = tf.gradients(h, table, grad_ys=-3.0 * g_h)[0]
  bypass = tf.gradients(loss, table, stop_gradients=[h])[0]
  actual, a, b = evaluate([grad, through, bypass], feed)
  np.testing.assert_allclose(densify(actual), densify(a) + densify(b),
                             rtol=1e-5, atol=1e-6)


def test_parameter_transform_on_a_sparse_gradient(graph):
  table, emb, h, loss, feed = _model()
  plan = gg.GradientPlan(loss).transform_gradients(
      "embed", gg.transforms.clip_by_value(-0.01, 0.01))
  grad = dict((v.name, g) for g, v in plan.compute_gradients())[table.name]
  assert isinstance(grad, tf.IndexedSlices)
  plain = tf.gradients(loss, table)[0]
  actual, ref = evaluate([grad, plain], feed)
  np.testing.assert_allclose(actual.values, np.clip(ref.values, -0.01, 0.01))
  np.testing.assert_array_equal(actual.indices, ref.indices)
