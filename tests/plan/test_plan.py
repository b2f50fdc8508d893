"""GradientPlan semantics against references built by hand."""

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


def test_identity_plan_equals_tf_gradients(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(x, 5, "a", tf.tanh)
  h = dense(h, 3, "b", tf.nn.relu)
  loss = tf.reduce_sum(tf.square(dense(h, 2, "c")))
  variables = tf1.trainable_variables()
  actual, expected = evaluate(
      [grads_of(gg.GradientPlan(loss)), tf.gradients(loss, variables)], feed(x))
  assert_grads_close(actual, expected, rtol=0, atol=0)


def test_nonscalar_loss_is_summed(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  out = dense(dense(x, 3, "a"), 2, "b")  # a [batch, 2] "loss"
  plan = gg.GradientPlan(out).transform_upstream("b", gg.transforms.scale(2.0))
  # tf.gradients sums a non-scalar y: its grad_ys default to ones.
  expected = tf.gradients(out, trainable("a"), grad_ys=2.0 * tf.ones_like(out))
  actual, want = evaluate([grads_of(plan)[:2], expected], feed(x))
  assert_grads_close(actual, want)


def test_upstream_transforms_compose_top_down(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 6, "l1", tf.tanh)
  h2 = dense(h1, 5, "l2", tf.tanh)
  loss = tf.reduce_sum(tf.square(dense(h2, 3, "l3")))
  plan = (gg.GradientPlan(loss)
          .transform_upstream("l3", gg.transforms.scale(2.0))
          .transform_upstream("l2", gg.transforms.scale(3.0)))
  l1, l2, l3 = trainable("l1"), trainable("l2"), trainable("l3")
  got = grads_of(plan)
  plain = tf.gradients(loss, l1 + l2 + l3)
  actual, ref = evaluate([got, plain], feed(x))
  assert_grads_close(actual[:2], [6.0 * g for g in ref[:2]])
  assert_grads_close(actual[2:4], [2.0 * g for g in ref[2:4]])
  assert_grads_close(actual[4:], ref[4:])


def test_nonlinear_upstream_is_applied_to_the_total_gradient(graph):
  # l2's output feeds two consumers; fn must see their sum, not each part.
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 6, "l1", tf.tanh)
  h2 = dense(h1, 5, "l2")
  loss = tf.reduce_sum(tf.square(dense(h2, 3, "l3"))) + tf.reduce_sum(
      tf.sin(h2))
  clip = gg.transforms.clip_by_norm(0.1)
  plan = gg.GradientPlan(loss).transform_upstream("l2", clip)
  g = tf.gradients(loss, h2)[0]
  expected = tf.gradients(h2, trainable("l1"), grad_ys=tf.clip_by_norm(g, 0.1))
  own = tf.gradients(loss, trainable("l2"))
  actual, want, want_own = evaluate([grads_of(plan), expected, own], feed(x))
  assert_grads_close(actual[:2], want)
  assert_grads_close(actual[2:4], want_own)


@pytest.mark.parametrize("merge_in_scope", [False, True])
def test_skip_connection_around_a_transformed_layer(graph, merge_in_scope):
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 5, "l1", tf.tanh)
  h2 = dense(h1, 5, "l2", tf.tanh)
  if merge_in_scope:
    with tf1.variable_scope("l3"):
      merged = h2 + h1  # the merge add lives in l3's scope
  else:
    merged = h2 + h1
  loss = tf.reduce_sum(tf.square(dense(merged, 2, "l3")))
  plan = gg.GradientPlan(loss).transform_upstream(
      "l2", gg.transforms.scale(-0.5))
  l1 = trainable("l1")
  g_h2 = tf.gradients(loss, h2)[0]
  through_l2 = tf.gradients(h2, l1, grad_ys=-0.5 * g_h2)
  bypass = tf.gradients(loss, l1, stop_gradients=[h2])
  expected = add(through_l2, bypass)
  actual, want, plain = evaluate(
      [grads_of(plan)[:2], expected, tf.gradients(loss, l1)], feed(x))
  assert_grads_close(actual, want)
  assert not np.allclose(actual[0], plain[0])


def test_regularizer_on_a_lower_layer_is_a_bypass(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 5, "l1", tf.tanh)
  h2 = dense(h1, 3, "l2")
  l1 = trainable("l1")
  loss = tf.reduce_sum(tf.square(h2)) + 0.3 * tf.nn.l2_loss(l1[0])
  plan = gg.GradientPlan(loss).transform_upstream(
      "l2", gg.transforms.scale(4.0))
  g_h2 = tf.gradients(loss, h2)[0]
  expected = add(tf.gradients(h2, l1, grad_ys=4.0 * g_h2),
                 tf.gradients(loss, l1, stop_gradients=[h2]))
  actual, want = evaluate([grads_of(plan)[:2], expected], feed(x))
  assert_grads_close(actual, want)


def test_second_head_on_a_lower_layer_is_a_bypass(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 5, "l1", tf.tanh)
  h2 = dense(h1, 3, "l2")
  loss = tf.reduce_sum(tf.square(h2)) + tf.reduce_sum(dense(h1, 1, "aux"))
  plan = gg.GradientPlan(loss).transform_upstream("l2", gg.transforms.zero())
  l1 = trainable("l1")
  expected = tf.gradients(loss, l1, stop_gradients=[h2])
  actual, want = evaluate([grads_of(plan)[:2], expected], feed(x))
  assert_grads_close(actual, want)


def test_transform_gradients_applies_to_the_summed_parameter_gradient(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 5, "l1", tf.tanh)
  l1 = trainable("l1")
  loss = tf.reduce_sum(tf.square(dense(h1, 3, "l2"))) + tf.nn.l2_loss(l1[0])
  clip = gg.transforms.clip_by_norm(0.05)
  plan = gg.GradientPlan(loss).transform_gradients("l1", clip)
  expected = [tf.clip_by_norm(g, 0.05) for g in tf.gradients(loss, l1)]
  actual, want = evaluate([grads_of(plan)[:2], expected], feed(x))
  assert_grads_close(actual, want)


def test_var_list_restricts_and_unreached_variables_get_none(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  loss = tf.reduce_sum(dense(dense(x, 3, "a"), 2, "b"))
  unused = tf1.get_variable("unused", [3])
  plan = gg.GradientPlan(loss)
  gv = plan.compute_gradients()
  assert [v.name for _, v in gv] == [v.name for v in tf1.trainable_variables()]
  assert dict((v.name, g) for g, v in gv)[unused.name] is None
  only_b = gg.GradientPlan(loss, var_list=trainable("b"))
  only_b.transform_upstream("b", gg.transforms.scale(2.0))
  gv_b = only_b.compute_gradients()
  assert [v.name for _, v in gv_b] == [v.name for v in trainable("b")]
  actual, want = evaluate([[g for g, _ in gv_b],
                           tf.gradients(loss, trainable("b"))], feed(x))
  assert_grads_close(actual, want)


def test_apply_gradients_runs_update_ops_and_steps_once(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  loss = tf.reduce_sum(tf.square(dense(dense(x, 3, "a"), 2, "b")))
  counter = tf1.get_variable("counter", initializer=0.0, trainable=False)
  tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, counter.assign_add(1.0))
  step = tf1.train.get_or_create_global_step()
  plan = gg.GradientPlan(loss).transform_upstream("b", gg.transforms.scale(0.5))
  train = plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1),
                               global_step=step, name="train")
  assert train.name == "train"
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    before = sess.run(tf1.trainable_variables())
    grads = sess.run(grads_of(plan), feed(x))
    # The backward pass waits for the update ops: reading the gradients
    # runs them once, as the train op does.
    assert sess.run(counter) == 1.0
    sess.run(train, feed(x))
    after = sess.run(tf1.trainable_variables())
    assert sess.run(step) == 1
    assert sess.run(counter) == 2.0
  for b, g, a in zip(before, grads, after):
    np.testing.assert_allclose(a, b - 0.1 * g, rtol=1e-5, atol=1e-6)


def test_update_ops_argument_overrides_the_collection(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  loss = tf.reduce_sum(dense(x, 2, "a"))
  counter = tf1.get_variable("counter", initializer=0.0, trainable=False)
  tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, counter.assign_add(1.0))
  train = gg.GradientPlan(loss).apply_gradients(
      tf1.train.GradientDescentOptimizer(0.1), update_ops=[])
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    sess.run(train, feed(x))
    assert sess.run(counter) == 0.0


def _chain(depth, width=16):
  x = tf1.placeholder(tf.float32, [None, width])
  h = x
  for i in range(depth):
    h = dense(h, width, f"layer{i}", tf.nn.relu)
  return x, tf.reduce_mean(tf.square(h))


def test_identity_plan_trains_like_minimize_for_25_adam_steps():
  results = []
  for use_plan in (False, True):
    with tf.Graph().as_default():
      x, loss = _chain(4)
      opt = tf1.train.AdamOptimizer(0.01)
      if use_plan:
        train = gg.GradientPlan(loss).apply_gradients(opt)
      else:
        train = opt.minimize(loss)
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        for step in range(25):
          sess.run(train, feed(x, seed=step))
        results.append(sess.run(tf1.trainable_variables()))
  assert_grads_close(results[1], results[0], rtol=0, atol=0)


def test_identity_plan_on_48_layer_chain_adds_no_more_ops_than_minimize():
  counts = []
  for use_plan in (False, True):
    with tf.Graph().as_default() as g:
      _, loss = _chain(48)
      before = len(g.get_operations())
      opt = tf1.train.AdamOptimizer(0.01)
      if use_plan:
        plan = gg.GradientPlan(loss)
        plan.transform_upstream("layer20", gg.transforms.identity())
        plan.apply_gradients(opt)
      else:
        opt.minimize(loss)
      counts.append(len(g.get_operations()) - before)
  assert counts[1] <= counts[0], counts


def test_fully_transformed_chain_grows_linearly():
  counts = {}
  for depth in (8, 16, 32):
    with tf.Graph().as_default() as g:
      _, loss = _chain(depth)
      before = len(g.get_operations())
      plan = gg.GradientPlan(loss)
      for i in range(depth):
        plan.transform_upstream(f"layer{i}", gg.transforms.scale(0.9))
      plan.compute_gradients()
      counts[depth] = len(g.get_operations()) - before
  per_layer = [(counts[b] - counts[a]) / (b - a)
               for a, b in ((8, 16), (16, 32))]
  assert per_layer[0] == per_layer[1], counts


def test_gate_graph_and_options_pass_through(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  loss = tf.reduce_sum(tf.square(dense(dense(x, 3, "a"), 2, "b")))
  plan = gg.GradientPlan(loss, gate_gradients=gg.GATE_GRAPH,
                         aggregation_method=tf.AggregationMethod.ADD_N,
                         colocate_gradients_with_ops=True)
  plan.transform_upstream("b", gg.transforms.scale(2.0))
  ref = gg.GradientPlan(loss).transform_upstream("b", gg.transforms.scale(2.0))
  actual, want = evaluate([grads_of(plan), grads_of(ref)], feed(x))
  assert_grads_close(actual, want)


# -- a parameter transform over several layers --------------------------------

def _three_dense():
  x = tf.constant(np.random.default_rng(5).normal(size=(8, 4)), tf.float32)
  h = dense(dense(x, 6, "l1", tf.nn.tanh), 5, "l2", tf.nn.tanh)
  return tf.reduce_sum(tf.square(dense(h, 3, "l3")))


def test_group_clip_over_every_layer_follows_layer_scales(graph):
  """BERT's clip_by_global_norm(1.0) over all variables, after layer-wise
  scales, against tf.gradients and tf.clip_by_global_norm."""
  loss = _three_dense()
  plan = (gg.GradientPlan(loss)
          .transform_gradients(["l1", "l2", "l3"],
                               gg.transforms.clip_by_global_norm(1.0))
          .transform_gradients("l1", gg.transforms.scale(0.5))
          .transform_gradients("l3", gg.transforms.scale(2.0)))
  assert plan.layer_names == ("l1", "l2", "l3")
  raw = tf.gradients(loss, tf1.trainable_variables())
  scaled = [0.5 * g for g in raw[:2]] + raw[2:4] + [2.0 * g for g in raw[4:]]
  ref, norm = tf.clip_by_global_norm(scaled, 1.0)
  got, ref, norm = evaluate([grads_of(plan), ref, norm])
  assert norm > 2.0  # the clip acts
  assert_grads_close(got, ref)


def test_group_clip_over_some_layers_leaves_the_others(graph):
  loss = _three_dense()
  plan = gg.GradientPlan(loss).transform_gradients(
      ("l1", "l2"), gg.transforms.clip_by_global_norm(0.1))
  raw = tf.gradients(loss, tf1.trainable_variables())
  ref, _ = tf.clip_by_global_norm(raw[:4], 0.1)
  got, ref, raw = evaluate([grads_of(plan), ref, raw])
  assert_grads_close(got, list(ref) + raw[4:])
  assert "gradients=[['l1', 'l2']]" in repr(plan)


def test_group_of_no_layer_is_refused(graph):
  plan = gg.GradientPlan(_three_dense())
  with pytest.raises(gg.GraphGradError,
                     match=r"transform_gradients: `layer` is an empty list; "
                     r"pass a layer name, or a list of the layers"):
    plan.transform_gradients([], gg.transforms.clip_by_global_norm(1.0))
  with pytest.raises(gg.LayerNotFoundError, match="l9"):
    plan.transform_gradients(["l1", "l9"], gg.transforms.scale(2.0))
