"""Annealed noise and layer-wise group transforms against numpy."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad import transforms as T
from helpers import dense, evaluate

tf1 = tf.compat.v1


def _net(extra_var=False):
  x = tf.constant(np.random.default_rng(0).normal(size=(8, 5)), tf.float32)
  h = dense(x, 6, "l1", activation=tf.nn.relu)
  out = dense(h, 3, "l2")
  loss = tf.reduce_sum(out * out)
  if extra_var:  # a variable of l2 that the loss does not reach
    with tf1.variable_scope("l2"):
      tf1.get_variable("unused", initializer=1.0)
  return loss


# -- annealed noise ----------------------------------------------------------

def test_annealed_noise_variance_at_two_steps(graph):
  """Var of g + noise is eta / (1 + t)^gamma at t = 0 and t = 999.

  n = 40,000 draws: the sample variance has relative standard error
  sqrt(2 / n) = 0.7%; the 5% tolerance is 7 standard errors.
  """
  step = tf1.train.get_or_create_global_step()
  g = tf.zeros([200, 200])
  ctx = T.TransformContext(tensor=g, global_step=step)
  noisy = T.add_noise(eta=0.3, gamma=0.55, seed=3)(g, ctx)
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    for t in (0, 999):
      step.load(t, sess)
      var = sess.run(noisy).var()
      np.testing.assert_allclose(var, 0.3 / (1 + t)**0.55, rtol=0.05)


def test_annealed_noise_in_a_plan_advances_with_the_train_op(graph):
  step = tf1.train.get_or_create_global_step()
  loss = _net()
  plan = gg.GradientPlan(loss).transform_upstream(
      "l2", T.add_noise(eta=1.0, gamma=0.55, seed=1))
  train = plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.0))
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    for _ in range(3):
      sess.run(train)
    assert sess.run(step) == 3  # the plan's single op increments it


class _Decay(T.Transform):
  """A user transform on the global step: g / (1 + t), with a call count."""

  name = "decay"
  reads_global_step = True

  def apply_dense(self, grad, context):
    calls = context.resources.get_or_create(context.layer, "decay/calls",
                                            list)
    calls.append(context.tensor)
    return grad / (1 + tf.cast(context.global_step, grad.dtype))


@pytest.mark.parametrize("reads", [True, False])
def test_a_transform_that_reads_the_global_step_advances_it(graph, reads):
  step = tf1.train.get_or_create_global_step()
  loss = _net()
  decay = _Decay()
  decay.reads_global_step = reads
  plan = gg.GradientPlan(loss).transform_gradients("l2", decay)
  train = plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.0))
  assert len(plan.resources.get("l2", "decay/calls")) == 2  # kernel, bias
  grad = plan.compute_gradients()[2][0]
  true = tf1.gradients(loss, tf1.trainable_variables("l2/")[0])[0]
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    for t in range(3):
      g, ref = sess.run([grad, true])
      np.testing.assert_allclose(g, ref / (1 + (t if reads else 0)),
                                 rtol=1e-6)
      sess.run(train)
    assert sess.run(step) == (3 if reads else 0)


def test_annealed_noise_needs_a_global_step(graph):
  plan = gg.GradientPlan(_net()).transform_upstream(
      "l2", T.add_noise(eta=0.3))
  with pytest.raises(gg.GraphGradError,
                     match=r"anneals with the global step.*"
                           r"get_or_create_global_step"):
    plan.compute_gradients()


def test_constant_noise_keeps_its_positional_form(graph):
  assert repr(T.add_noise(0.1)) == "add_noise(0.1, seed=None)"
  out = T.add_noise(0.0)(tf.ones([3]))
  np.testing.assert_allclose(evaluate(out), np.ones(3))


def test_add_noise_arguments():
  with pytest.raises(gg.GraphGradError, match=r"exactly one of `stddev`"):
    T.add_noise()
  with pytest.raises(gg.GraphGradError, match=r"exactly one of `stddev`"):
    T.add_noise(0.1, eta=0.3)
  with pytest.raises(gg.GraphGradError, match=r"`gamma` must be non-negative"):
    T.add_noise(eta=0.3, gamma=-1)


# -- group transforms --------------------------------------------------------

def _plain_and_planned(transform):
  loss = _net(extra_var=True)
  plain = tf1.gradients(loss, tf1.trainable_variables("l2"))
  plan = gg.GradientPlan(loss).transform_gradients("l2", transform)
  gv = plan.compute_gradients()
  ws = tf1.trainable_variables("l2")
  planned = [g for g, v in gv if v in ws]
  l1 = [(g, v) for g, v in gv if v.op.name.startswith("l1/")]
  ref_l1 = tf1.gradients(loss, [v for _, v in l1])
  vals = evaluate([[g for g in plain if g is not None],
                   [g for g in planned if g is not None],
                   [g for g, _ in l1], ref_l1,
                   [v for v in ws]])
  assert plain[2] is None and planned[2] is None  # kept in place
  return vals


@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_clip_by_global_norm_per_layer_against_numpy(graph, clip):
  plain, planned, l1, ref_l1, _ = _plain_and_planned(
      T.clip_by_global_norm(clip))
  norm = np.sqrt(sum((g**2).sum() for g in plain))
  assert norm > 0.5  # the small bound really clips
  for p, q in zip(plain, planned):
    np.testing.assert_allclose(q, p * clip / max(norm, clip), rtol=1e-5)
  for a, b in zip(l1, ref_l1):  # the other layer is untouched
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_trust_ratio_against_numpy(graph):
  plain, planned, l1, ref_l1, ws = _plain_and_planned(
      T.trust_ratio(0.01, epsilon=1e-3))
  g_norm = np.sqrt(sum((g**2).sum() for g in plain))
  # The unused variable has no gradient and does not count.
  w_norm = np.sqrt(sum((w**2).sum() for w in ws[:2]))
  ratio = 0.01 * w_norm / (g_norm + 1e-3)
  for p, q in zip(plain, planned):
    np.testing.assert_allclose(q, p * ratio, rtol=1e-5)
  for a, b in zip(l1, ref_l1):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_trust_ratio_is_one_for_zero_weights(graph):
  with tf1.variable_scope("l"):
    w = tf1.get_variable("w", initializer=tf.zeros([3]))
  loss = tf.reduce_sum(w * tf.constant([1.0, 2.0, 3.0]))
  gv = gg.GradientPlan(loss).transform_gradients(
      "l", T.trust_ratio(0.001)).compute_gradients()
  np.testing.assert_allclose(evaluate(gv[0][0]), [1.0, 2.0, 3.0])


def test_group_transforms_chain_with_plain_ones_in_order(graph):
  loss = _net()
  ws = tf1.trainable_variables("l2")
  plain = tf1.gradients(loss, ws)
  plan = gg.GradientPlan(loss).transform_gradients("l2", T.scale(3.0))
  plan.transform_gradients("l2", T.clip_by_global_norm(1.0))
  gv = [g for g, v in plan.compute_gradients() if v in ws]
  p, q = evaluate([plain, gv])
  norm = 3.0 * np.sqrt(sum((g**2).sum() for g in p))
  for a, b in zip(p, q):
    np.testing.assert_allclose(b, 3.0 * a / max(norm, 1.0), rtol=1e-5)


def test_group_transform_keeps_sparse_gradients_sparse(graph):
  with tf1.variable_scope("emb"):
    table = tf1.get_variable("table", initializer=tf.ones([5, 2]))
  loss = tf.reduce_sum(tf.gather(table, [0, 3]) * 4.0)
  gv = gg.GradientPlan(loss).transform_gradients(
      "emb", T.clip_by_global_norm(1.0)).compute_gradients()
  assert isinstance(gv[0][0], tf.IndexedSlices)
  np.testing.assert_allclose(evaluate(gv[0][0].values), np.full((2, 2), 0.5))


def test_group_transforms_are_refused_for_boundaries(graph):
  loss = _net()
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError,
                     match=r"transform_upstream: clip_by_global_norm\(1.0\) "
                           r"is a group transform"):
    plan.transform_upstream("l2", T.clip_by_global_norm(1.0))
  with pytest.raises(gg.GraphGradError,
                     match=r"transform_edge: trust_ratio.* is a group"):
    plan.transform_edge("l1", "l2", T.trust_ratio(0.1))


def test_group_transform_must_keep_shapes(graph):
  class Bad(T.GroupTransform):
    def apply_group(self, grads_and_vars, context):
      return [tf.zeros([1]) for _ in grads_and_vars]
  plan = gg.GradientPlan(_net()).transform_gradients("l2", Bad())
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"transform_gradients\('l2', group_transform\(\)\)"
                           r".*changed the gradient"):
    plan.compute_gradients()


def test_group_transform_arguments():
  with pytest.raises(gg.GraphGradError, match=r"`clip_norm` must be positive"):
    T.clip_by_global_norm(0)
  with pytest.raises(gg.GraphGradError, match=r"`eta` must be positive"):
    T.trust_ratio(0.0)
  with pytest.raises(gg.GraphGradError, match=r"`epsilon` must be non-neg"):
    T.trust_ratio(0.1, epsilon=-1.0)
