"""transform_edge: only the gradient one layer sends directly into another."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import assert_grads_close, dense, evaluate, feed, trainable

tf1 = tf.compat.v1


def _dann(shared_glue):
  x = tf1.placeholder(tf.float32, [None, 6])
  feats = dense(x, 5, "features")
  if shared_glue:  # one activation outside all scopes feeds both heads
    f = tf.nn.relu(feats)
    label_in, domain_in = f, f
  else:
    label_in, domain_in = tf.tanh(feats), tf.nn.relu(feats)
  label_loss = tf.reduce_sum(tf.square(dense(label_in, 3, "label_head")))
  domain_loss = tf.reduce_sum(tf.sin(dense(domain_in, 2, "domain_head")))
  return x, label_loss, domain_loss


@pytest.mark.parametrize("shared_glue", [False, True])
def test_gradient_reversal_on_the_domain_edge(graph, shared_glue):
  x, label_loss, domain_loss = _dann(shared_glue)
  loss = label_loss + domain_loss
  plan = gg.GradientPlan(loss).transform_edge(
      "features", "domain_head", gg.transforms.reverse())
  got = dict((v.name, g) for g, v in plan.compute_gradients())
  feats, domain, label = (trainable(s) for s in ("features", "domain_head",
                                             "label_head"))
  want_feats = [a - b for a, b in zip(tf.gradients(label_loss, feats),
                                      tf.gradients(domain_loss, feats))]
  actual, expected = evaluate(
      [[got[v.name] for v in feats + domain + label],
       want_feats + tf.gradients(domain_loss, domain)
       + tf.gradients(label_loss, label)], feed(x))
  assert_grads_close(actual, expected)


def test_edge_and_upstream_transforms_compose_in_documented_order(graph):
  # x -> a -> b -> c -> loss, and b also feeds the loss directly.
  x = tf1.placeholder(tf.float32, [None, 4])
  a_out = dense(x, 5, "a", tf.tanh)
  b_out = dense(a_out, 5, "b")
  c_out = dense(tf.tanh(b_out), 3, "c")
  loss2 = tf.reduce_sum(tf.square(b_out))
  loss = tf.reduce_sum(tf.square(c_out)) + loss2
  plan = (gg.GradientPlan(loss)
          .transform_upstream("c", gg.transforms.scale(2.0))
          .transform_edge("b", "c", gg.transforms.scale(3.0))
          .transform_upstream("b", gg.transforms.scale(5.0)))
  got = dict((v.name, g) for g, v in plan.compute_gradients())
  # By hand: c's upstream (x2), then the edge (x3), then the sum at b's
  # output, then b's upstream (x5) for what lies below b.
  g_c = tf.gradients(loss, c_out)[0]
  through_c = tf.gradients(c_out, b_out, grad_ys=2.0 * g_c)[0]
  g_b = 3.0 * through_c + tf.gradients(loss2, b_out)[0]
  want = (tf.gradients(b_out, trainable("a"), grad_ys=5.0 * g_b)
          + tf.gradients(b_out, trainable("b"), grad_ys=g_b)
          + tf.gradients(loss, trainable("c")))
  order = trainable("a") + trainable("b") + trainable("c")
  actual, expected = evaluate([[got[v.name] for v in order], want], feed(x))
  assert_grads_close(actual, expected)


def _skip_model(wrap_direct=None):
  """a -> b -> c, and a -> c directly through a concat (glue)."""
  x = tf1.placeholder(tf.float32, [None, 4])
  a_out = dense(x, 5, "a", tf.tanh)
  b_out = dense(a_out, 5, "b", tf.tanh)
  direct = wrap_direct(a_out) if wrap_direct else a_out
  c_out = dense(tf.concat([b_out, direct], 1), 3, "c")
  return x, tf.reduce_sum(tf.square(c_out))


def _run_model(build, plan_fn=None):
  with tf.Graph().as_default():
    x, loss = build()
    if plan_fn:
      plan = plan_fn(gg.GradientPlan(loss))
      grads = [g for g, _ in plan.compute_gradients()]
    else:
      grads = tf.gradients(loss, tf1.trainable_variables())
    return evaluate(grads, feed(x))


def test_edge_leaves_paths_through_other_layers_alone():
  c = -0.7
  actual = _run_model(_skip_model, lambda p: p.transform_edge(
      "a", "c", gg.transforms.scale(c)))
  # Reference graph: the direct a -> c path scaled by an identity wired by
  # hand; the path through b untouched.
  def scaled(t):
    return tf.stop_gradient(t) + c * (t - tf.stop_gradient(t))

  expected = _run_model(lambda: _skip_model(scaled))
  assert_grads_close(actual, expected)
  plain = _run_model(_skip_model)
  assert not np.allclose(actual[0], plain[0])


def test_unknown_edges_are_errors(graph):
  x, loss = _skip_model()
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError,
                     match=r"no edge 'b' -> 'a'.*'b' feeds: c; "
                           r"'a' is fed by: \(nothing\)"):
    plan.transform_edge("b", "a", gg.transforms.zero())
  with pytest.raises(gg.GraphGradError, match=r"both 'a'.*transform_upstream"):
    plan.transform_edge("a", "a", gg.transforms.zero())
  with pytest.raises(gg.LayerNotFoundError, match=r"no layer named 'z'"):
    plan.transform_edge("a", "z", gg.transforms.zero())
  del x
