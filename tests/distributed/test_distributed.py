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


class FakeAllreduce:
  """A recording stand-in for Horovod's allreduce over two replicas.

  Both replicas live in one graph. The second replica's plan is built first
  with ``record``, which keeps each segment's gradients; the first replica's
  plan is built with ``average``, which pairs its n-th call with the second
  replica's n-th call (as a collective pairs tensors) and averages.
  """

  def __init__(self):
    self.calls, self.other = [], []

  def record(self, grads_and_vars):
    self.other.append([g for g, _ in grads_and_vars])
    return [g for g, _ in grads_and_vars]

  def average(self, grads_and_vars):
    theirs = self.other[len(self.calls)]
    self.calls.append([v.op.name for _, v in grads_and_vars])
    return [(g + h) / 2 for (g, _), h in zip(grads_and_vars, theirs)]


def _replica(x):
  with tf1.variable_scope("", reuse=tf1.AUTO_REUSE):
    h1 = dense(x, 6, "l1", tf.tanh)
    h2 = dense(h1, 5, "l2", tf.tanh)
    out = dense(h2, 3, "l3")
    kernel = tf1.get_variable("l1/kernel")
  loss = tf.reduce_mean(tf.square(out)) + 0.1 * tf.reduce_sum(tf.square(kernel))
  return h2, loss


def _by_hand(h2, loss, up_clip):
  """One replica's plan gradients before transform_gradients, by hand."""
  l1 = tf1.trainable_variables("l1/")
  rest = tf1.trainable_variables("l2/") + tf1.trainable_variables("l3/")
  g_h2 = tf.gradients(loss, h2)[0]
  through = tf.gradients(h2, l1, grad_ys=tf.clip_by_norm(g_h2, up_clip))
  bypass = tf.gradients(loss, l1, stop_gradients=[h2])  # the regularizer
  return ([a if b is None else a + b for a, b in zip(through, bypass)]
          + tf.gradients(loss, rest))


def test_reduce_fn_routes_each_segment_before_gradient_transforms(graph):
  rng = np.random.default_rng(3)
  xa, xb = (tf1.placeholder(tf.float32, [None, 4]) for _ in range(2))
  feed = {xa: rng.normal(size=(8, 4)).astype(np.float32),
          xb: rng.normal(size=(8, 4)).astype(np.float32)}
  (h2a, loss_a), (h2b, loss_b) = _replica(xa), _replica(xb)
  fake = FakeAllreduce()

  def plan(loss, reduce_fn):
    return (gg.GradientPlan(loss, reduce_fn=reduce_fn, name="replica")
            .transform_upstream("l2", gg.transforms.clip_by_norm(0.05))
            .transform_gradients("l1", gg.transforms.clip_by_norm(0.1)))

  plan(loss_b, fake.record).compute_gradients()
  got = [g for g, _ in plan(loss_a, fake.average).compute_gradients()]
  local = [(a + b) / 2 for a, b in zip(_by_hand(h2a, loss_a, 0.05),
                                       _by_hand(h2b, loss_b, 0.05))]
  expected = [tf.clip_by_norm(g, 0.1) for g in local[:2]] + local[2:]
  clipped_first = [(tf.clip_by_norm(a, 0.1) + tf.clip_by_norm(b, 0.1)) / 2
                   for a, b in zip(_by_hand(h2a, loss_a, 0.05)[:2],
                                   _by_hand(h2b, loss_b, 0.05)[:2])]
  actual, want, other = evaluate([got, expected, clipped_first], feed)
  for a, e in zip(actual, want):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)
  # Reducing after the clip would have given something else (100 times the
  # tolerance above, at least).
  assert max(np.max(np.abs(a - o)) for a, o in zip(actual, other)) > 1e-5
  # One call per segment that reached a variable: l1's kernel is reached
  # by two (the regularizer's, from the loss, and the one below l2).
  assert len(fake.calls) == len(fake.other) >= 2
  assert sum(c.count("l1/kernel") for c in fake.calls) == 2
  assert sorted(n for c in fake.calls for n in c) == sorted(
      ["l1/kernel", "l1/kernel", "l1/bias", "l2/kernel", "l2/bias",
       "l3/kernel", "l3/bias"])


def test_reduce_fn_without_cuts_is_one_call_like_horovod(graph):
  rng = np.random.default_rng(4)
  xa, xb = (tf1.placeholder(tf.float32, [None, 4]) for _ in range(2))
  feed = {xa: rng.normal(size=(8, 4)).astype(np.float32),
          xb: rng.normal(size=(8, 4)).astype(np.float32)}
  (_, loss_a), (_, loss_b) = _replica(xa), _replica(xb)
  fake = FakeAllreduce()
  gg.GradientPlan(loss_b, reduce_fn=fake.record).compute_gradients()
  plan = gg.GradientPlan(loss_a, reduce_fn=fake.average)
  plan.transform_gradients("l3", gg.transforms.scale(2.0))
  got = [g for g, _ in plan.compute_gradients()]
  variables = tf1.trainable_variables()
  mean = [(a + b) / 2 for a, b in zip(tf.gradients(loss_a, variables),
                                      tf.gradients(loss_b, variables))]
  actual, want = evaluate([got, mean[:4] + [2.0 * g for g in mean[4:]]], feed)
  for a, e in zip(actual, want):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)
  assert fake.calls == [[v.op.name for v in variables]]


def test_reduce_fn_errors(graph):
  loss, _ = _two_layers()
  with pytest.raises(gg.GraphGradError, match="`reduce_fn` must be a callable"):
    gg.GradientPlan(loss, reduce_fn="allreduce")
  with pytest.raises(gg.GraphGradError,
                     match=r"received 4 pairs \(l1/kernel, .*\) and returned "
                           r"3 gradients"):
    gg.GradientPlan(loss, reduce_fn=lambda gv: [g for g, _ in gv][:3]
                    ).compute_gradients()
  with pytest.raises(gg.GraphGradError, match="received 2 pairs .* returned "
                                              ".*Tensor"):
    (gg.GradientPlan(loss, reduce_fn=lambda gv: tf.constant(0.0))
     .transform_upstream("l2", gg.transforms.scale(2.0)).compute_gradients())
  with pytest.raises(gg.IncompatibleGradientError,
                     match="reduce_fn on l1/kernel:0: .*changed the gradient"):
    gg.GradientPlan(loss, reduce_fn=lambda gv: [tf.reduce_sum(g) for g, _ in gv]
                    ).compute_gradients()
