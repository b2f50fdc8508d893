"""Bypass paths: skips, regularizers, several losses, outputs read twice.

Each test builds its reference by hand with ``tf.gradients``, ``grad_ys``
and ``stop_gradients`` and checks that the plan's numbers differ from the
plain gradient where they should, so that it cannot pass vacuously.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import (
  add,
  assert_grads_close,
  dense,
  evaluate,
  feed,
  grads_of,
  trainable,
)

tf1 = tf.compat.v1

def _scaled(c, grads):
  return [c * g for g in grads]


def _init(shape, seed=7):
  return (np.random.default_rng(seed).normal(size=shape) * 0.5).astype(
      np.float32)


def _residual_net(add_in):
  """x -> l1 -> l2 -> l3 with a skip from l1 around l2.

  The merge ``l2 + l1`` lives in l2's scope (a residual block), in l3's
  scope, or outside every scope (glue), as ``add_in`` says.
  """
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 5, "l1", tf.tanh)
  if add_in == "l2":
    with tf1.variable_scope("l2"):
      w = tf1.get_variable("kernel", initializer=_init((5, 5)))
      b = tf1.get_variable("bias", initializer=_init((5,)))
      a = tf.tanh(h1 @ w + b)
      merged = a + h1
  else:
    a = dense(h1, 5, "l2", tf.tanh)
    if add_in == "l3":
      with tf1.variable_scope("l3"):
        merged = a + h1
    else:
      merged = a + h1
  h3 = dense(merged, 2, "l3")
  loss = tf.reduce_sum(tf.square(h3 - 0.5))
  return x, h1, a, merged, loss


# -- skips around a transformed layer ------------------------------------------


@pytest.mark.parametrize("add_in", ["l3", "glue"])
def test_upstream_on_a_skipped_layer_leaves_the_skip_alone(graph, add_in):
  x, h1, a, _, loss = _residual_net(add_in)
  net = gg.analyze(loss)
  assert set(net.graph.edges) == {("l1", "l2"), ("l2", "l3"), ("l1", "l3")}
  plan = gg.GradientPlan(loss, net).transform_upstream(
      "l2", gg.transforms.scale(-0.5))
  l1 = trainable("l1")
  g_a = tf.gradients(loss, a)[0]
  expected = add(tf.gradients(a, l1, grad_ys=-0.5 * g_a),
                 tf.gradients(loss, l1, stop_gradients=[a]))
  actual, want, plain = evaluate(
      [grads_of(plan, l1), expected, tf.gradients(loss, l1)], feed(x, rows=6))
  assert_grads_close(actual, want)
  assert not np.allclose(actual[0], plain[0])


def test_upstream_on_a_residual_block_scales_its_skip_too(graph):
  # The merge add is in l2's own scope: the skip enters l2, so it is part of
  # what l2 sends below, and the upstream transform scales it.
  x, h1, _, merged, loss = _residual_net("l2")
  net = gg.analyze(loss)
  assert set(net.graph.edges) == {("l1", "l2"), ("l2", "l3")}
  assert [t.name for t in net["l2"].outputs] == [merged.name]
  plan = gg.GradientPlan(loss, net).transform_upstream(
      "l2", gg.transforms.scale(-0.5))
  l1, l2 = trainable("l1"), trainable("l2")
  g_merged = tf.gradients(loss, merged)[0]
  expected_l1 = tf.gradients(merged, l1, grad_ys=-0.5 * g_merged)
  actual, want, plain = evaluate(
      [grads_of(plan, l1 + l2), expected_l1, tf.gradients(loss, l1 + l2)],
      feed(x, rows=6))
  assert_grads_close(actual[:2], want)
  assert_grads_close(actual[:2], _scaled(-0.5, plain[:2]))
  assert_grads_close(actual[2:], plain[2:])  # l2's own parameters: plain


@pytest.mark.parametrize("add_in", ["l2", "l3", "glue"])
def test_upstream_on_the_merging_layer_scales_both_paths(graph, add_in):
  x, _, _, _, loss = _residual_net(add_in)
  plan = gg.GradientPlan(loss).transform_upstream(
      "l3", gg.transforms.scale(3.0))
  below = trainable("l1") + trainable("l2")
  actual, plain, own, plain_own = evaluate(
      [grads_of(plan, below), tf.gradients(loss, below),
       grads_of(plan, trainable("l3")), tf.gradients(loss, trainable("l3"))],
      feed(x, rows=6))
  assert_grads_close(actual, _scaled(3.0, plain))
  assert_grads_close(own, plain_own)


@pytest.mark.parametrize("add_in", ["l3", "glue"])
def test_edge_transform_on_a_skip_scales_only_the_skip(graph, add_in):
  x, h1, a, merged, loss = _residual_net(add_in)
  plan = gg.GradientPlan(loss).transform_edge("l1", "l3",
                                              gg.transforms.scale(0.25))
  l1, l2 = trainable("l1"), trainable("l2")
  g_merged = tf.gradients(loss, merged)[0]
  # d merged / d h1 along the skip is the identity.
  g_h1 = tf.gradients(a, h1, grad_ys=g_merged)[0] + 0.25 * g_merged
  expected_l1 = tf.gradients(h1, l1, grad_ys=g_h1)
  actual, want, plain = evaluate(
      [grads_of(plan, l1 + l2), expected_l1, tf.gradients(loss, l1 + l2)],
      feed(x, rows=6))
  assert_grads_close(actual[:2], want)
  assert_grads_close(actual[2:], plain[2:])
  assert not np.allclose(actual[0], plain[0])


# -- regularizers that read variables directly ---------------------------------


def test_regularizers_reading_variables_are_bypasses(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 5, "l1", tf.tanh)
  h2 = dense(h1, 4, "l2", tf.tanh)
  h3 = dense(h2, 2, "l3")
  l1, l2, l3 = trainable("l1"), trainable("l2"), trainable("l3")
  # L2 terms on two kernels, and a term reading variables of two layers.
  loss = (tf.reduce_sum(tf.square(h3)) + 0.3 * tf.nn.l2_loss(l1[0])
          + 0.2 * tf.nn.l2_loss(l2[0])
          + 0.1 * tf.reduce_sum(l1[1]) * tf.reduce_sum(l2[1]))
  net = gg.analyze(loss)
  assert set(net.graph.edges) == {("l1", "l2"), ("l2", "l3")}
  plan = (gg.GradientPlan(loss, net)
          .transform_upstream("l2", gg.transforms.scale(3.0))
          .transform_edge("l1", "l2", gg.transforms.scale(0.5))
          .transform_upstream("l3", gg.transforms.scale(-1.0)))
  g_h3 = tf.gradients(loss, h3)[0]
  g_h2 = tf.gradients(h3, h2, grad_ys=-1.0 * g_h3)[0]
  expected_l1 = add(tf.gradients(h2, l1, grad_ys=1.5 * g_h2),
                    tf.gradients(loss, l1, stop_gradients=[h2]))
  expected_l2 = add(tf.gradients(h2, l2, grad_ys=g_h2),
                    tf.gradients(loss, l2, stop_gradients=[h2, h3]))
  expected_l3 = tf.gradients(loss, l3)
  actual, want, plain = evaluate(
      [grads_of(plan, l1 + l2 + l3), expected_l1 + expected_l2 + expected_l3,
       tf.gradients(loss, l1 + l2 + l3)], feed(x, rows=6))
  assert_grads_close(actual, want)
  assert not np.allclose(actual[1], plain[1])  # l1/bias: partly scaled
  assert not np.allclose(actual[2], plain[2])  # l2/kernel: sees l3's -1


def test_regularizer_on_the_transformed_layer_stays_plain(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 5, "l1", tf.tanh)
  h2 = dense(h1, 3, "l2")
  l1, l2 = trainable("l1"), trainable("l2")
  loss = tf.reduce_sum(tf.square(h2)) + 0.5 * tf.nn.l2_loss(l2[0])
  plan = gg.GradientPlan(loss).transform_upstream("l2", gg.transforms.zero())
  actual, plain, plain_l2 = evaluate(
      [grads_of(plan, l1 + l2), tf.gradients(loss, l1),
       tf.gradients(loss, l2)], feed(x, rows=6))
  assert_grads_close(actual[:2], [np.zeros_like(g) for g in plain])
  assert_grads_close(actual[2:], plain_l2)


# -- several losses summed -----------------------------------------------------


def test_several_losses_summed_compose_per_path(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 5, "l1", tf.tanh)
  h2 = dense(h1, 4, "l2", tf.tanh)
  h3 = dense(h2, 2, "l3")
  main = tf.reduce_sum(tf.square(h3 - 1.0))
  aux1 = tf.reduce_mean(tf.square(h1))
  aux2 = tf.reduce_sum(tf.sin(h2))
  loss = main + 0.5 * aux1 + aux2
  plan = (gg.GradientPlan(loss)
          .transform_upstream("l3", gg.transforms.scale(2.0))
          .transform_upstream("l2", gg.transforms.scale(-1.0)))
  l1, l2, l3 = trainable("l1"), trainable("l2"), trainable("l3")
  g_h3 = tf.gradients(loss, h3)[0]
  # At h2: l3's share, scaled by l3's transform, plus aux2 unchanged.
  g_h2 = (tf.gradients(h3, h2, grad_ys=2.0 * g_h3)[0]
          + tf.gradients(loss, h2, stop_gradients=[h3])[0])
  expected = (add(tf.gradients(h2, l1, grad_ys=-1.0 * g_h2),
                  tf.gradients(loss, l1, stop_gradients=[h2]))
              + tf.gradients(h2, l2, grad_ys=g_h2)
              + tf.gradients(loss, l3))
  # Per loss, by linearity: at l1, main crosses l3 and l2 (factor 2 * -1),
  # aux2 crosses l2 (-1), aux1 arrives directly (1); at l2's parameters,
  # main crosses l3 (2) and aux2 arrives directly (1).
  by_term = (add(_scaled(-2.0, tf.gradients(main, l1)),
                 _scaled(-1.0, tf.gradients(aux2, l1)),
                 tf.gradients(0.5 * aux1, l1))
             + add(_scaled(2.0, tf.gradients(main, l2)),
                   tf.gradients(aux2, l2)))
  actual, want, want_by_term, plain = evaluate(
      [grads_of(plan, l1 + l2 + l3), expected, by_term,
       tf.gradients(loss, l1)], feed(x, rows=6))
  assert_grads_close(actual, want)
  assert_grads_close(actual[:4], want_by_term)
  assert not np.allclose(actual[0], plain[0])


# -- an output read by a higher layer and by the loss ------------------------


def _two_consumer_net():
  x = tf1.placeholder(tf.float32, [None, 4])
  h0 = dense(x, 5, "l0", tf.tanh)
  h1 = tf.tanh(dense(h0, 4, "l1"))  # activation as glue, read twice below
  h2 = dense(h1, 3, "l2")
  loss = tf.reduce_sum(tf.square(h2)) + tf.reduce_sum(tf.cos(h1))
  return x, h0, h1, h2, loss


def test_output_read_by_a_layer_and_the_loss_upstream(graph):
  x, _, h1, _, loss = _two_consumer_net()
  plan = gg.GradientPlan(loss).transform_upstream(
      "l1", gg.transforms.scale(0.5))
  l0, l1 = trainable("l0"), trainable("l1")
  # l1's upstream gradient is the sum over both readers of its output.
  actual, plain = evaluate(
      [grads_of(plan, l0 + l1), tf.gradients(loss, l0 + l1)], feed(x, rows=6))
  assert_grads_close(actual, _scaled(0.5, plain[:2]) + plain[2:])


def test_output_read_by_a_layer_and_the_loss_composes_in_order(graph):
  # upper's upstream, then the edge, then the sum with the loss's share at
  # the lower layer's output, then the lower layer's upstream.
  x, _, h1, h2, loss = _two_consumer_net()
  plan = (gg.GradientPlan(loss)
          .transform_upstream("l2", gg.transforms.scale(3.0))
          .transform_edge("l1", "l2", gg.transforms.scale(-0.5))
          .transform_upstream("l1", gg.transforms.scale(0.25)))
  l0, l1, l2 = trainable("l0"), trainable("l1"), trainable("l2")
  g_h2 = tf.gradients(loss, h2)[0]
  g_h1 = (tf.gradients(h2, h1, grad_ys=-1.5 * g_h2)[0]
          + tf.gradients(loss, h1, stop_gradients=[h2])[0])
  expected = (tf.gradients(h1, l0, grad_ys=0.25 * g_h1)
              + tf.gradients(h1, l1, grad_ys=g_h1)
              + tf.gradients(loss, l2))
  actual, want = evaluate([grads_of(plan, l0 + l1 + l2), expected],
                          feed(x, rows=6))
  assert_grads_close(actual, want)


def test_glue_merge_read_by_a_layer_and_the_loss(graph):
  # m = h0 + h1 is glue read by l2 and by the loss: an edge into l2 must
  # rewrite only l2's share of the gradient through m.
  x = tf1.placeholder(tf.float32, [None, 4])
  h0 = dense(x, 4, "l0", tf.tanh)
  h1 = dense(h0, 4, "l1", tf.tanh)
  m = h0 + h1
  h2 = dense(m, 3, "l2")
  loss = tf.reduce_sum(tf.square(h2)) + tf.reduce_sum(tf.square(m))
  plan = gg.GradientPlan(loss).transform_edge("l1", "l2",
                                              gg.transforms.scale(0.0))
  l0, l1 = trainable("l0"), trainable("l1")
  g_h1 = tf.gradients(tf.reduce_sum(tf.square(m)), h1)[0]  # the loss's share
  expected_l1 = tf.gradients(h1, l1, grad_ys=g_h1)
  expected_l0 = add(tf.gradients(h1, l0, grad_ys=g_h1),
                    tf.gradients(loss, l0, stop_gradients=[h1]))
  actual, want = evaluate([grads_of(plan, l0 + l1), expected_l0 + expected_l1],
                          feed(x, rows=6))
  assert_grads_close(actual, want)


def test_edge_share_through_glue_also_read_by_a_cut_layer(graph):
  # Minimal form of a case the property tests found: l1's glue tanh t1 is
  # read by l2 (transformed, so t1 is cut) and, through the glue add t1 + x,
  # by l3. The edge l1 -> l3 must still see l3's whole share.
  x = tf1.placeholder(tf.float32, [None, 3])
  t1 = tf.tanh(dense(x, 3, "l1"))
  h2 = dense(t1, 3, "l2")
  h3 = dense(t1 + x, 3, "l3")
  loss = tf.reduce_sum(tf.square(h2)) + tf.reduce_sum(tf.square(h3))
  plan = (gg.GradientPlan(loss)
          .transform_edge("l1", "l3", gg.transforms.scale(0.0))
          .transform_upstream("l2", lambda g: g))
  l1 = trainable("l1")
  expected = tf.gradients(tf.reduce_sum(tf.square(h2)), l1)
  actual, want, plain = evaluate(
      [grads_of(plan, l1), expected, tf.gradients(loss, l1)], feed(x, rows=6))
  assert_grads_close(actual, want)
  assert not np.allclose(actual[0], plain[0])
