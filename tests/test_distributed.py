"""Wrappers: AfterAggregation, and a plan's reduce_fn for compute-side ones."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense, evaluate

tf1 = tf.compat.v1


def _two_layers():
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(x, 5, "l1", tf.tanh)
  loss = tf.reduce_sum(tf.square(dense(h, 3, "l2")))
  feed = {x: np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)}
  return loss, feed


def test_after_aggregation_transforms_what_it_is_given(graph):
  loss, feed = _two_layers()
  net = gg.analyze(loss)
  variables = tf1.trainable_variables()
  given = [tf.constant(np.full(v.shape, 3.0, np.float32)) for v in variables]
  opt = gg.AfterAggregation(tf1.train.GradientDescentOptimizer(1.0), net)
  opt.transform_gradients("l2", gg.transforms.clip_by_norm(1.0))
  step = opt.apply_gradients(list(zip(given, variables)))
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    before = sess.run(variables)
    sess.run(step, feed)
    moved = [b - a for b, a in zip(before, sess.run(variables))]
  for m in moved[:2]:  # l1: applied as given
    np.testing.assert_allclose(m, 3.0, rtol=1e-6)
  for m, v in zip(moved[2:], variables[2:]):  # l2: each clipped to norm 1
    np.testing.assert_allclose(np.linalg.norm(m), 1.0, rtol=1e-5)
    np.testing.assert_allclose(m, 1.0 / np.sqrt(v.shape.num_elements()),
                               rtol=1e-5)


def test_after_aggregation_under_sync_replicas_builds(graph):
  loss, _ = _two_layers()
  plan = gg.GradientPlan(loss)
  gs = tf1.train.get_or_create_global_step()
  inner = gg.AfterAggregation(tf1.train.AdamOptimizer(0.1), plan.net)
  sync = tf1.train.SyncReplicasOptimizer(inner, replicas_to_aggregate=2)
  plan.apply_gradients(sync, global_step=gs)
  # The aggregated update goes through AfterAggregation to Adam.
  assert sync.get_chief_queue_runner() is not None
  # Slots are the inner optimizer's, reachable through both wrappers.
  assert sync.get_slot_names() == ["m", "v"]
  assert sync.get_slot(tf1.trainable_variables()[0], "m") is not None


def test_after_aggregation_errors(graph):
  loss, _ = _two_layers()
  net = gg.analyze(loss)
  with pytest.raises(gg.GraphGradError, match="must have an apply_gradients"):
    gg.AfterAggregation(object(), net)
  with pytest.raises(gg.GraphGradError, match="`net` must be a gg.LayerGraph"):
    gg.AfterAggregation(tf1.train.GradientDescentOptimizer(1.0), loss)
  opt = gg.AfterAggregation(tf1.train.GradientDescentOptimizer(1.0), net)
  with pytest.raises(gg.LayerNotFoundError, match="no layer named 'l3'"):
    opt.transform_gradients("l3", gg.transforms.scale(2.0))
  opt.transform_gradients("l1", lambda g: tf.reduce_sum(g))
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"AfterAggregation.transform_gradients\('l1'\)"):
    opt.apply_gradients(opt.compute_gradients(loss))
