"""Batch norm with UPDATE_OPS, shared (reused) layers, unconnected layers."""

import networkx as nx
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import assert_grads_close, dense, evaluate, feed, trainable

tf1 = tf.compat.v1


def test_batch_norm_statistics_update_and_gamma_beta_gradients(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(x, 6, "l1")
  h = tf1.layers.batch_normalization(h, training=True, name="bn")
  top = dense(tf.nn.relu(h), 2, "l2")
  loss = tf.reduce_sum(tf.square(top))
  plan = gg.GradientPlan(loss).transform_upstream(
      "l2", gg.transforms.scale(0.25))
  assert "bn" in plan.net.names
  got = dict((v.name, g) for g, v in plan.compute_gradients())
  below = trainable("l1") + trainable("bn")
  assert [v.name for v in trainable("bn")] == ["bn/gamma:0", "bn/beta:0"]
  g_top = tf.gradients(loss, top)[0]
  want = tf.gradients(top, below, grad_ys=0.25 * g_top)
  batch = feed(x)
  actual, expected = evaluate([[got[v.name] for v in below], want], batch)
  assert_grads_close(actual, expected)
  train = plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1))
  moving_mean = [v for v in tf1.global_variables()
                 if v.name == "bn/moving_mean:0"][0]
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    before = sess.run(moving_mean)
    sess.run(train, batch)
    after = sess.run(moving_mean)
  assert not np.allclose(after, before)  # the train op ran UPDATE_OPS


def test_shared_tower_is_summed_over_call_sites(graph):
  x1 = tf1.placeholder(tf.float32, [None, 4])
  x2 = tf1.placeholder(tf.float32, [None, 4])
  s1 = dense(x1, 5, "stem_a", tf.tanh)
  s2 = dense(x2, 5, "stem_b", tf.tanh)
  t1 = tf1.layers.dense(s1, 3, name="tower",
                        kernel_initializer=tf1.ones_initializer())
  t2 = tf1.layers.dense(s2, 3, name="tower", reuse=True)
  loss = tf.reduce_sum(tf.square(dense(tf.concat([t1, t2], 1), 2, "head")))
  net = gg.analyze(loss)
  assert net["tower"].call_sites == 2
  clip = gg.transforms.clip_by_norm(0.05)
  plan = (gg.GradientPlan(loss, net)
          .transform_upstream("tower", clip)
          .transform_gradients("tower", gg.transforms.scale(0.5)))
  got = dict((v.name, g) for g, v in plan.compute_gradients())
  g1, g2 = tf.gradients(loss, [t1, t2])
  # Each call site's boundary tensor gets its own upstream transform; the
  # tower's own parameters get the plain gradient summed over both sites.
  want = (tf.gradients(t1, trainable("stem_a"),
                      grad_ys=tf.clip_by_norm(g1, 0.05))
          + tf.gradients(t2, trainable("stem_b"),
                         grad_ys=tf.clip_by_norm(g2, 0.05))
          + [0.5 * g for g in tf.gradients(loss, trainable("tower"))])
  order = trainable("stem_a") + trainable("stem_b") + trainable("tower")
  batch = feed(x1, x2)
  actual, expected = evaluate([[got[v.name] for v in order], want], batch)
  assert_grads_close(actual, expected)


def test_layer_reused_in_series_around_another_layer_is_refused(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = tf1.layers.dense(x, 4, name="cell", activation=tf.tanh)
  h = dense(h, 4, "between", tf.tanh)
  h = tf1.layers.dense(h, 4, name="cell", activation=tf.tanh, reuse=True)
  loss = tf.reduce_sum(dense(h, 1, "head"))
  plan = gg.GradientPlan(loss).transform_upstream(
      "cell", gg.transforms.scale(2.0))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"feed back into themselves.*reused in series"):
    plan.compute_gradients()


def test_glue_enclosed_by_one_layer_belongs_to_it(graph):
  # A relu outside the scopes, between two sub-scopes that depth=1 groups
  # into one layer, and between two call sites of a reused scope.
  x = tf1.placeholder(tf.float32, [None, 4])
  s = dense(x, 4, "stem", tf.tanh)
  h = tf.nn.relu(dense(s, 4, "block/conv"))
  h = dense(h, 4, "block/proj")
  h = tf.nn.relu(tf1.layers.dense(h, 4, name="cell"))
  h = tf1.layers.dense(h, 4, name="cell", reuse=True)
  loss = tf.reduce_sum(tf.square(dense(h, 1, "head")))
  net = gg.analyze(loss, depth=1)
  assert net.names == ("stem", "block", "cell", "head")
  assert not list(nx.selfloop_edges(net.graph))
  assert set(net.graph.edges) == {("stem", "block"), ("block", "cell"),
                                  ("cell", "head")}
  plan = (gg.GradientPlan(loss, net)
          .transform_upstream("block", gg.transforms.scale(-3.0))
          .transform_edge("stem", "block", gg.transforms.scale(0.5)))
  got = dict((v.name, g) for g, v in plan.compute_gradients())
  g_block = tf.gradients(loss, net.boundary("block", "cell")[0])[0]
  block_out = net.boundary("block", "cell")[0]
  want = tf.gradients(block_out, trainable("stem"), grad_ys=-1.5 * g_block)
  actual, expected = evaluate([[got[v.name] for v in trainable("stem")], want],
                              feed(x))
  assert_grads_close(actual, expected)


def test_layer_reused_in_series_inside_its_scope_is_one_block(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  s = dense(x, 4, "stem", tf.tanh)
  h = tf1.layers.dense(s, 4, name="cell", activation=tf.tanh)
  h = tf1.layers.dense(h, 4, name="cell", activation=tf.tanh, reuse=True)
  loss = tf.reduce_sum(tf.square(dense(h, 1, "head")))
  plan = gg.GradientPlan(loss).transform_upstream(
      "cell", gg.transforms.scale(-2.0))
  got = dict((v.name, g) for g, v in plan.compute_gradients())
  g_h = tf.gradients(loss, h)[0]
  want = (tf.gradients(h, trainable("stem"), grad_ys=-2.0 * g_h)
          + tf.gradients(loss, trainable("cell")))
  order = trainable("stem") + trainable("cell")
  actual, expected = evaluate([[got[v.name] for v in order], want], feed(x))
  assert_grads_close(actual, expected)


def test_unconnected_variables_get_none_and_cannot_be_transformed(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  loss = tf.reduce_sum(tf.square(dense(dense(x, 3, "a"), 2, "b")))
  dense(x, 2, "orphan")  # trainable, but not on the way to the loss
  plan = gg.GradientPlan(loss)
  with pytest.raises(
      gg.NotConnectedError,
      match=r"'orphan' names variables .* does not reach the loss"):
    plan.transform_upstream("orphan", gg.transforms.scale(2.0))
  gv = plan.compute_gradients()
  assert [g is None for g, v in gv] == [False] * 4 + [True] * 2
  train = plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1))
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    orphan = sess.run(trainable("orphan"))
    sess.run(train, feed(x))
    for before, after in zip(orphan, sess.run(trainable("orphan"))):
      np.testing.assert_array_equal(before, after)


def test_no_gradient_at_all_is_a_clear_error(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  loss = tf.reduce_sum(tf.square(dense(dense(x, 3, "a"), 2, "b")))
  dense(x, 2, "orphan")
  plan = gg.GradientPlan(loss, var_list=trainable("orphan"))
  with pytest.raises(gg.NotConnectedError, match=r"no variable has a gradient"):
    plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1))


# -- where the batch-norm updates run ---------------------------------------

def _bn_net(x):
  h = dense(x, 6, "l1")
  h = tf1.layers.batch_normalization(h, training=True, name="bn",
                                     momentum=0.5)
  h = dense(tf.nn.relu(h), 6, "l2")
  h = tf1.layers.batch_normalization(h, training=True, name="bn2",
                                     momentum=0.5)
  return tf.reduce_sum(tf.square(dense(tf.nn.relu(h), 2, "l3")))


def _ancestors(tensors):
  """Every op ``tensors`` wait for, through data and control inputs."""
  seen, stack = set(), [t.op for t in tensors]
  while stack:
    op = stack.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    stack += [t.op for t in op.inputs] + list(op.control_inputs)
  return seen


def _moving_statistics_after_one_step(make_train_op):
  with tf.Graph().as_default():
    x = tf.constant(np.random.default_rng(3).normal(size=(8, 4)), tf.float32)
    loss = _bn_net(x)
    train = make_train_op(loss, tf1.train.GradientDescentOptimizer(0.1))
    moving = [v for v in tf1.global_variables() if "moving_" in v.name]
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      sess.run(train)
      return {v.name: sess.run(v) for v in moving}, sess.run(
          tf1.trainable_variables())


def test_moving_statistics_after_one_step_equal_the_idioms():
  def idiom(loss, opt):
    with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
      return opt.minimize(loss)

  want, want_vars = _moving_statistics_after_one_step(idiom)
  for declare in (lambda p: p, lambda p: p.recompute()):
    got, got_vars = _moving_statistics_after_one_step(
        lambda loss, opt, d=declare: d(gg.GradientPlan(loss)).apply_gradients(
            opt))
    assert sorted(got) == sorted(want) and len(want) == 4
    for name in want:
      assert not np.allclose(want[name], 0.0 if "mean" in name else 1.0)
      np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7)
    for a, b in zip(got_vars, want_vars):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recompute", [False, True])
def test_backward_pass_waits_for_the_update_ops(graph, recompute):
  loss = _bn_net(tf1.placeholder(tf.float32, [None, 4]))
  updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
  assert len(updates) == 4
  plan = gg.GradientPlan(loss)
  if recompute:
    plan = plan.recompute()
  plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1))
  seeds = [op for op in graph.get_operations()
           if op.name.startswith("graphgrad/seed")]
  assert seeds
  waited = _ancestors([op.outputs[0] for op in seeds])
  assert {u.name for u in updates} <= waited
  # Every parameter gradient, hence the whole backward pass, waits for them.
  for g, _ in plan.compute_gradients():
    assert {u.name for u in updates} <= _ancestors([g])


def test_update_ops_argument_chooses_what_the_backward_pass_waits_for(graph):
  loss = _bn_net(tf1.placeholder(tf.float32, [None, 4]))
  updates = {u.name for u in tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)}
  counter = tf1.get_variable("counter", initializer=0.0, trainable=False)
  mine = counter.assign_add(1.0).op
  plan = gg.GradientPlan(loss)
  plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1),
                       update_ops=[mine])
  waited = _ancestors([g for g, _ in plan.compute_gradients()])
  assert mine.name in waited and not updates & waited
  other = gg.GradientPlan(loss)
  other.apply_gradients(tf1.train.GradientDescentOptimizer(0.1),
                        update_ops=[])
  assert not (updates | {mine.name}) & _ancestors(
      [g for g, _ in other.compute_gradients()])


def test_plan_built_before_apply_gradients_logs_that_only_the_update_waits(
    graph, caplog):
  loss = _bn_net(tf1.placeholder(tf.float32, [None, 4]))
  plan = gg.GradientPlan(loss)
  gv = plan.compute_gradients()
  updates = {u.name for u in tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)}
  assert not updates & _ancestors([g for g, _ in gv])
  with caplog.at_level("INFO", logger="graphgrad"):
    plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1))
  assert "only the update waits for the 4 update ops" in caplog.text
