"""Where the engine cuts: segments that would meet are cut where they meet."""

import numpy as np
import tensorflow as tf

import graphgrad as gg
from helpers import dense, evaluate, feed

tf1 = tf.compat.v1


def _residual(units):
  """A residual chain: ``h = relu(h + out(mid(h)))`` per unit."""
  x = tf1.placeholder(tf.float32, [None, 6])
  h = dense(x, 6, "stem", tf.nn.relu)
  for k in range(units):
    r = dense(dense(h, 6, f"u{k}/mid", tf.nn.relu), 6, f"u{k}/out")
    h = tf.nn.relu(h + r, name=f"u{k}/relu")
  return tf.reduce_sum(tf.square(dense(h, 2, "head"))), feed(x, rows=4)


def _added(units, declare):
  """Ops the plan adds beyond minimize()'s, its gradients and tf.gradients'."""
  with tf.Graph().as_default() as g:
    loss, fd = _residual(units)
    n = len(g.get_operations())
    tf1.train.GradientDescentOptimizer(0.1).compute_gradients(loss)
    plain = len(g.get_operations()) - n
    plan = gg.GradientPlan(loss)
    if declare:
      for k in range(units):
        plan.transform_upstream(f"u{k}/out", gg.transforms.clip_by_norm(1e9))
    assert plan.net.names  # analysed before counting
    n = len(g.get_operations())
    gv = plan.compute_gradients()
    added = len(g.get_operations()) - n - plain
    got, want = evaluate([[gr for gr, _ in gv],
                          tf.gradients(loss, [v for _, v in gv])], fd)
  return added, got, want


def test_the_residual_path_is_backpropagated_once_per_unit():
  # Each unit's rewritten layer starts a segment; without a cut where they
  # meet, each would backpropagate the identity path below it again.
  per_unit = []
  for units in (4, 8, 16):
    added, got, want = _added(units, True)
    per_unit.append(added / units)
    for a, b in zip(got, want):  # clip_by_norm(1e9) clips nothing
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert max(per_unit) <= 1.15 * min(per_unit), per_unit
  assert _added(16, False)[0] == 0  # the identity plan: minimize()'s ops
