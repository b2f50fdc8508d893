"""The bounded walk of segment calls builds exactly the unbounded graph."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad import _compat
from graphgrad.plan import _backprop, _engine
from helpers import dense, evaluate

tf1 = tf.compat.v1


def _residual_net():
  """Skips, a regularizer and a shared variable: cuts with bypass paths."""
  x = tf1.placeholder(tf.float32, [None, 6], name="x")
  h0 = dense(x, 6, "stem", tf.tanh)
  h1 = dense(h0, 6, "block1", tf.tanh) + h0
  h2 = dense(h1, 6, "block2", tf.tanh) + h1
  with tf1.variable_scope("block1", reuse=True):
    shared = tf1.get_variable("kernel")
  out = dense(h2, 3, "head")
  loss = (tf.reduce_sum(tf.square(out)) + 0.01 * tf.reduce_sum(
      tf.square(shared)) + 0.1 * tf.reduce_sum(h1))
  return x, loss


def _plan(loss):
  plan = gg.GradientPlan(loss)
  for name in ("head", "block2", "block1"):
    plan.transform_upstream(name, gg.transforms.chain(
        gg.transforms.scale(0.5), gg.transforms.clip_by_value(-0.3, 0.3)))
  plan.transform_edge("stem", "block1", gg.transforms.scale(3.0))
  plan.transform_gradients("stem", gg.transforms.scale(2.0))
  return plan


def _bound_walks(bound, monkeypatch):
  """Segment calls walk bounded (where the self-test passed) or unbounded:
  ``can_bound`` as the VJP and the engine both read it."""
  can = ((lambda ops: _compat.usable("reached_walk")) if bound
         else (lambda ops: False))
  monkeypatch.setattr(_backprop, "can_bound", can)
  monkeypatch.setattr(_engine, "can_bound", can)


def _build(bound, monkeypatch):
  _bound_walks(bound, monkeypatch)
  with tf.Graph().as_default() as g:
    x, loss = _residual_net()
    grads = [gr for gr, _ in _plan(loss).compute_gradients()]
    feed = {x: np.random.default_rng(3).normal(size=(5, 6)).astype(np.float32)}
    values = evaluate(grads, feed)
    nodes = [(n.name, n.op, tuple(n.input)) for n in g.as_graph_def().node]
  return values, nodes


def test_bounded_walk_builds_the_same_ops_and_numbers(monkeypatch):
  assert _compat.usable("reached_walk")
  values_b, nodes_b = _build(True, monkeypatch)
  values_u, nodes_u = _build(False, monkeypatch)
  assert nodes_b == nodes_u  # same ops, names, inputs and order
  for a, b in zip(values_b, values_u):
    np.testing.assert_array_equal(a, b)


def test_bounded_walk_is_used_and_is_local_to_the_call(graph):
  x, loss = _residual_net()
  seen = []
  with _compat.observed_walks(lambda bound: seen.append(bound is not None)):
    _plan(loss).compute_gradients()
    assert seen and all(seen)
    seen.clear()
    plain = tf.gradients(loss, tf1.trainable_variables())  # outside any plan
  assert seen == [False]
  assert _compat.walk_bound() is None
  evaluate(plain, {x: np.ones((2, 6), np.float32)})


def test_v1_loops_are_not_bounded(graph, monkeypatch):
  # A tf.compat.v1 while loop (control flow v1) has NextIteration back edges.
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(control_flow_util, "ENABLE_CONTROL_FLOW_V2", False)
  x = tf1.placeholder(tf.float32, [4])
  _, out = tf1.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h * 2.0),
                          [tf.constant(0), x])
  assert not _backprop.can_bound(graph.get_operations())
  with tf.Graph().as_default() as g2:
    tf.square(tf1.placeholder(tf.float32, [4]))
    assert _backprop.can_bound(g2.get_operations())


@pytest.mark.parametrize("depth", [4, 12])
def test_behind_stops_at_the_oldest_x(graph, depth):
  x = tf1.placeholder(tf.float32, [None, 3])
  hs = [x]
  for i in range(depth):
    hs.append(dense(hs[-1], 3, f"l{i}", tf.tanh))
  ops = _backprop.behind([hs[-1]], [hs[-2]])
  # Only the last layer's ops (and the tensor's producer) are behind it.
  assert {op.name.split("/")[0] for op in ops} <= {f"l{depth - 1}",
                                                   hs[-2].op.name.split("/")[0]}
  assert hs[-2].op in ops and hs[-1].op in ops and x.op not in ops


def _loop_net():
  """A dense layer, a functional while loop layer, a dense head."""
  x = tf1.placeholder(tf.float32, [3, 4, 5], name="x")
  seq = tf.transpose(tf.reshape(dense(tf.reshape(x, [-1, 5]), 6, "proj"),
                                [3, 4, 6]), [1, 0, 2])
  with tf1.variable_scope("cell"):
    wh = tf1.get_variable("wh", initializer=np.eye(6, dtype=np.float32) * 0.5)
    _, last = tf1.while_loop(
        lambda t, h: t < 4,
        lambda t, h: (t + 1, tf.tanh(tf.gather(seq, t) + tf.matmul(h, wh))),
        [tf.constant(0), tf.zeros([3, 6])])
  loss = tf.reduce_sum(tf.square(dense(last, 2, "head")))
  return x, loss


def test_bounded_walk_is_exact_through_a_functional_while_loop(monkeypatch):
  results = []
  for bound in (True, False):
    _bound_walks(bound, monkeypatch)
    with tf.Graph().as_default() as g:
      x, loss = _loop_net()
      plan = gg.GradientPlan(loss)
      for name in ("cell", "head"):
        plan.transform_upstream(name, gg.transforms.clip_by_value(-0.2, 0.2))
      grads = [gr for gr, _ in plan.compute_gradients()]
      feed = {x: np.random.default_rng(4).normal(size=(3, 4, 5)).astype(
          np.float32)}
      results.append((evaluate(grads, feed),
                      [(n.name, n.op, tuple(n.input))
                       for n in g.as_graph_def().node]))
  (values_b, nodes_b), (values_u, nodes_u) = results
  assert nodes_b == nodes_u
  for a, b in zip(values_b, values_u):
    np.testing.assert_array_equal(a, b)
