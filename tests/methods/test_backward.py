"""Backward replacements against hand-built references.

Feedback alignment (input gradient = delta @ B^T), direct feedback alignment
(input gradient = e @ B_i) and synthetic gradients (prediction used below,
module trained on ||pred - stop_gradient(true)||^2), each with the layer's
own parameter gradients checked against the true ones.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad import backward as B
from helpers import HalfThroughKernel, dense, evaluate, grads_of, trainable

tf1 = tf.compat.v1

X = np.random.default_rng(0).normal(size=(6, 5)).astype(np.float32)
Y = np.eye(3, dtype=np.float32)[[0, 1, 2, 0, 1, 2]]


def _mlp(depth=2, top_activation=None):
  """x -> l1 -> relu -> ... -> l{depth} -> softmax cross-entropy."""
  x = tf.constant(X)
  h, hs = x, []
  for i in range(1, depth):
    h = tf.nn.relu(dense(h, 4, f"l{i}"))
    hs.append(h)
  logits = dense(h, 3, f"l{depth}", activation=top_activation)
  loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
      labels=tf.constant(Y), logits=logits))
  return loss, logits, hs


def _feedback(layer):
  found = [v for v in tf1.global_variables()
           if f"replace_backward_{layer}/" in v.name and v.name.endswith("B:0")]
  assert len(found) == 1, found
  return found[0]


# -- feedback alignment --------------------------------------------------------

@pytest.mark.parametrize("top_activation", [None, tf.tanh])
def test_feedback_alignment_input_gradient_is_delta_times_b_transposed(
    graph, top_activation):
  loss, logits, (h,) = _mlp(2, top_activation)
  plan = gg.GradientPlan(loss).replace_backward(
      "l2", B.feedback_alignment(seed=3))
  gv = plan.compute_gradients()
  b = _feedback("l2")
  assert not b.trainable and b in tf1.global_variables()  # saved, not trained
  g_out = tf1.gradients(loss, logits)[0]
  # delta at the MatMul output: through tanh inside the layer, if any.
  delta = g_out * (1 - logits**2) if top_activation else g_out
  fa = tf.matmul(delta, b, transpose_b=True)
  ref_l1 = tf1.gradients(h, trainable("l1"), grad_ys=fa)
  true_l1 = tf1.gradients(loss, trainable("l1"))
  true_l2 = tf1.gradients(loss, trainable("l2"))
  got_l1, got_l2, ref_l1, true_l1, true_l2, bv, w = evaluate(
      [grads_of(gv, "l1"), grads_of(gv, "l2"), ref_l1, true_l1, true_l2, b,
       trainable("l2")[0]])
  for a, e in zip(got_l1, ref_l1):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)
  for a, e in zip(got_l2, true_l2):  # own parameters: the true gradient
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)
  assert not np.allclose(got_l1[0], true_l1[0], atol=1e-4)  # not W^T
  assert bv.shape == w.shape
  np.testing.assert_allclose(bv.std(), 1 / np.sqrt(3), rtol=0.6)


def test_feedback_alignment_keeps_exact_paths_around_the_matmul(graph):
  """Inside the layer: 2 * h before the MatMul, and a skip h -> output."""
  x = tf.constant(X)
  h = tf.nn.relu(dense(x, 4, "l1"))
  with tf1.variable_scope("l2"):
    w = tf1.get_variable("w", initializer=tf.ones([4, 4]) * 0.3)
    out = tf.matmul(2.0 * h, w) + h
  loss = tf.reduce_sum(tf.sin(out))
  gv = gg.GradientPlan(loss).replace_backward(
      "l2", B.feedback_alignment(seed=0)).compute_gradients()
  b = _feedback("l2")
  g = tf1.gradients(loss, out)[0]
  d_h = 2.0 * tf.matmul(g, b, transpose_b=True) + g
  ref = tf1.gradients(h, trainable("l1"), grad_ys=d_h)
  got, ref = evaluate([grads_of(gv, "l1"), ref])
  for a, r in zip(got, ref):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-7)


def test_replacing_a_layer_without_differentiable_inputs(graph):
  loss, _, _ = _mlp(2)
  gv = gg.GradientPlan(loss).replace_backward(
      "l1", B.feedback_alignment(seed=0)).compute_gradients()
  got, ref = evaluate([[g for g, _ in gv],
                       tf1.gradients(loss, tf1.trainable_variables())])
  for a, r in zip(got, ref):  # nothing below l1: every gradient is true
    np.testing.assert_allclose(a, r, rtol=1e-6)


def test_feedback_matrix_is_fixed_by_the_seed(graph):
  loss, _, _ = _mlp(2)
  gg.GradientPlan(loss).replace_backward(
      "l2", B.feedback_alignment(seed=3)).compute_gradients()
  b = _feedback("l2")
  first = evaluate(b)
  np.testing.assert_array_equal(first, evaluate(b))  # new session, same B


def test_feedback_alignment_composes_with_an_upstream_transform(graph):
  loss, _, _ = _mlp(2)
  fa = gg.GradientPlan(loss).replace_backward(
      "l2", B.feedback_alignment(seed=3)).compute_gradients()
  # A second plan in the same graph: its B is its own, drawn from the same
  # stateless seed, so it has the same value.
  both = (gg.GradientPlan(loss, name="second")
          .transform_upstream("l2", gg.transforms.scale(2.0))
          .replace_backward("l2", B.feedback_alignment(seed=3))
          .compute_gradients())
  a, b, true_l2 = evaluate([[g for g, _ in fa], [g for g, _ in both],
                            tf1.gradients(loss, trainable("l2"))])
  np.testing.assert_allclose(b[0], 2 * a[0], rtol=1e-5)  # l1 kernel
  np.testing.assert_allclose(b[2], true_l2[0], rtol=1e-5)  # l2 kernel


def test_feedback_matrix_is_placed_by_the_device_function(graph):
  with graph.device(tf1.train.replica_device_setter(ps_tasks=1)):
    loss, _, _ = _mlp(2)
    gg.GradientPlan(loss).replace_backward(
        "l2", B.feedback_alignment(seed=0)).compute_gradients()
  assert _feedback("l2").device == "/job:ps/task:0"


def test_feedback_alignment_refuses_a_convolution(graph):
  x = tf.constant(np.ones((2, 5, 5, 1), np.float32))
  with tf1.variable_scope("conv"):
    k = tf1.get_variable("kernel", initializer=tf.ones([3, 3, 1, 2]))
    h = tf.nn.conv2d(x, k, 1, "SAME")
  with tf1.variable_scope("top"):
    w = tf1.get_variable("w", initializer=tf.ones([50, 1]))
    out = tf.matmul(tf.reshape(h, [2, 50]), w)
  plan = gg.GradientPlan(tf.reduce_sum(out))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"feedback_alignment: layer 'conv' must be a dense "
                           r"layer.*Conv2D"):
    plan.replace_backward("conv", B.feedback_alignment())


# -- direct feedback alignment -------------------------------------------------

def test_dfa_sends_the_projected_top_error_to_every_hidden_layer(graph):
  loss, logits, (h1, h2) = _mlp(3)
  plan = gg.GradientPlan(loss)
  for name in ("l2", "l3"):
    plan.replace_backward(name, B.direct_feedback_alignment(seed=1))
  gv = plan.compute_gradients()
  b2, b3 = _feedback("l2"), _feedback("l3")
  assert b2.shape == (3, 4) and b3.shape == (3, 4)
  e = tf1.gradients(loss, logits)[0]
  ref_l1 = tf1.gradients(h1, trainable("l1"), grad_ys=e @ b2)
  ref_l2 = tf1.gradients(h2, trainable("l2"), grad_ys=e @ b3)
  true_l3 = tf1.gradients(loss, trainable("l3"))
  got, ref, b2v, b3v = evaluate([[grads_of(gv, s) for s in ("l1", "l2", "l3")],
                                 [ref_l1, ref_l2, true_l3], b2, b3])
  for got_layer, ref_layer in zip(got, ref):
    for a, r in zip(got_layer, ref_layer):
      np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-7)
  assert not np.allclose(b2v, b3v)  # each layer its own projection


def test_dfa_projects_into_a_non_flat_input(graph):
  x = tf.constant(np.ones((2, 3, 4), np.float32))
  with tf1.variable_scope("l1"):
    h = x * tf1.get_variable("s", initializer=2.0)
  with tf1.variable_scope("l2"):
    w = tf1.get_variable("w", initializer=tf.ones([12, 2]))
    logits = tf.matmul(tf.reshape(h, [-1, 12]), w)
  loss = tf.reduce_sum(logits**2)
  gv = gg.GradientPlan(loss).replace_backward(
      "l2", B.direct_feedback_alignment(seed=0)).compute_gradients()
  b = _feedback("l2")
  e = tf1.gradients(loss, logits)[0]
  ref = tf1.gradients(h, trainable("l1"), grad_ys=tf.reshape(e @ b, [2, 3, 4]))
  got, ref = evaluate([gv[0][0], ref[0]])
  np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_dfa_needs_a_single_error_layer(graph):
  x = tf.constant(X)
  h = tf.nn.relu(dense(x, 4, "trunk"))
  loss = tf.reduce_sum(dense(h, 2, "head_a")) + tf.reduce_sum(
      dense(h, 2, "head_b"))
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError,
                     match=r"`error_layer` is needed, because 2 layers reach "
                           r"the loss directly \(head_a, head_b\)"):
    plan.replace_backward("head_a", B.direct_feedback_alignment())
  plan.replace_backward("head_a",
                        B.direct_feedback_alignment(error_layer="head_a"))


def test_dfa_error_layer_must_have_one_output(graph):
  x = tf.constant(X)
  h = tf.nn.relu(dense(x, 4, "l1"))
  with tf1.variable_scope("top"):
    a = h @ tf1.get_variable("w", initializer=tf.ones([4, 2]))
    b = a * 2.0
  loss = tf.reduce_sum(a) + tf.reduce_sum(b * b)
  with pytest.raises(gg.GraphGradError,
                     match=r"error layer 'top' must have one floating-point "
                           r"output"):
    gg.GradientPlan(loss).replace_backward(
        "top", B.direct_feedback_alignment())


def test_dfa_needs_static_feature_sizes(graph):
  x = tf.constant(X)
  h = tf.nn.relu(dense(x, 4, "l1"))
  # The static shape is lost: [?, ?].
  h = tf.reshape(h, tf1.placeholder_with_default(tf.shape(h), [2]))
  with tf1.variable_scope("l2"):
    logits = tf.matmul(h, tf1.get_variable("w", initializer=tf.ones([4, 3])))
  plan = gg.GradientPlan(tf.reduce_sum(logits)).replace_backward(
      "l2", B.direct_feedback_alignment())
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"needs a batch dimension followed by known"):
    plan.compute_gradients()


# -- synthetic gradients -------------------------------------------------------

def test_synthetic_gradient_is_used_below_and_its_module_regresses(graph):
  loss, logits, (h,) = _mlp(2)
  y = tf.constant(Y)
  sg = B.synthetic(labels=y)
  plan = gg.GradientPlan(loss).replace_backward("l2", sg)
  gv = plan.compute_gradients()
  module = sg.modules(plan)[h.name]
  kernel, bias = module.variables
  assert kernel.shape == (4 + 3, 4) and bias.shape == (4,)
  assert [v for _, v in gv[-2:]] == [kernel, bias]  # appended to the plan
  rng = np.random.default_rng(5)
  k0 = rng.normal(size=(7, 4)).astype(np.float32)
  b0 = rng.normal(size=4).astype(np.float32)
  true_h = tf1.gradients(loss, h)[0]
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    assert not sess.run(kernel).any()  # zero-initialised output layer
    kernel.load(k0, sess)
    bias.load(b0, sess)
    hv, th = sess.run([h, true_h])
    pred = np.concatenate([hv, Y], 1) @ k0 + b0
    ref_l1 = sess.run(tf1.gradients(h, trainable("l1"), grad_ys=pred))
    got = sess.run([g for g, _ in gv])
    true_l2 = sess.run(tf1.gradients(loss, trainable("l2")))
    np.testing.assert_allclose(sess.run(module.prediction), pred, rtol=1e-5)
    np.testing.assert_allclose(sess.run(module.loss),
                               ((pred - th)**2).sum(), rtol=1e-5)
  for a, r in zip(got[:2], ref_l1):  # lower layer: the prediction
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6)
  for a, r in zip(got[2:4], true_l2):  # own parameters: the truth
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-7)
  z = np.concatenate([hv, Y], 1)
  np.testing.assert_allclose(got[4], 2 * z.T @ (pred - th), rtol=1e-4)
  np.testing.assert_allclose(got[5], 2 * (pred - th).sum(0), rtol=1e-4)


def test_synthetic_module_trains_in_the_plan_train_op(graph):
  loss, _, (h,) = _mlp(2)
  sg = B.synthetic(hidden=(8,), seed=0)
  plan = gg.GradientPlan(loss).replace_backward("l2", sg)
  train = plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.5))
  module = sg.modules(plan)[h.name]
  assert len(module.variables) == 4  # hidden layer and output layer
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    before = sess.run(module.variables[2])
    grad = sess.run(plan.compute_gradients()[-2][0])
    sess.run(train)
    after = sess.run(module.variables[2])
  np.testing.assert_allclose(after, before - 0.5 * grad, rtol=1e-5, atol=1e-7)
  assert np.abs(grad).max() > 0


def test_synthetic_arguments():
  with pytest.raises(gg.GraphGradError, match=r"`hidden` must hold positive"):
    B.synthetic(hidden=(0,))
  with pytest.raises(gg.GraphGradError, match=r"`labels` must be a tensor"):
    B.synthetic(labels=[1, 2])


# -- replace_backward ----------------------------------------------------------

def test_replace_backward_with_a_callable_and_upstream_of(graph):
  loss, logits, (h1, h2) = _mlp(3)
  seen = {}

  def half_of_top_error(ctx):
    seen["upstream"] = ctx.upstream
    seen["top"] = ctx.upstream_of("l3")
    return [0.5 * g for g in ctx.chain_rule()]

  plan = gg.GradientPlan(loss).transform_upstream(
      "l3", gg.transforms.identity())  # no cut: l3 is read through `cuts`
  plan.replace_backward("l2", half_of_top_error)
  plan.replace_backward("l3", B.direct_feedback_alignment(seed=0))
  gv = plan.compute_gradients()
  got, ref = evaluate([grads_of(gv, "l1"), tf1.gradients(
      loss, logits)[0]])
  assert len(seen["top"]) == 1
  np.testing.assert_allclose(evaluate(seen["top"][0]), ref, rtol=1e-6)
  assert all(g is not None for g in got)


def test_replace_backward_errors(graph):
  loss, _, _ = _mlp(3)
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError, match=r"`fn` must be a gg.backward"):
    plan.replace_backward("l2", gg.transforms.scale(2.0))
  plan.replace_backward("l2", B.feedback_alignment())
  with pytest.raises(gg.GraphGradError,
                     match=r"layer 'l2' already has the replacement"):
    plan.replace_backward("l2", B.feedback_alignment())
  bad = gg.GradientPlan(loss).replace_backward("l2", lambda ctx: [])
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"returned 0 gradients for 1 input tensors"):
    bad.compute_gradients()
  bad = gg.GradientPlan(loss).replace_backward(
      "l2", lambda ctx: [tf.zeros([6, 9])])
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"returned a gradient of shape \(6, 9\)"):
    bad.compute_gradients()
  early = gg.GradientPlan(loss).replace_backward(
      "l3", lambda ctx: ctx.upstream_of("l2"))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"layer 'l2'.*needed before it is complete"):
    early.compute_gradients()


def test_plan_state_is_saved_and_restored_by_a_saver(graph, tmp_path):
  loss, _, (h,) = _mlp(2)
  sg = B.synthetic(hidden=(3,), seed=0)
  plan = (gg.GradientPlan(loss).replace_backward("l2", sg))
  train = plan.apply_gradients(tf1.train.AdamOptimizer(0.1))
  state = list(sg.modules(plan)[h.name].variables)
  saver = tf1.train.Saver()
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    for _ in range(3):
      sess.run(train)
    saved = sess.run(state)
    assert np.abs(saved[2]).max() > 0  # the zero output layer has trained
    path = saver.save(sess, str(tmp_path / "ckpt"))
  with tf1.Session() as sess:
    saver.restore(sess, path)
    for a, b in zip(sess.run(state), saved):
      np.testing.assert_array_equal(a, b)


def test_feedback_alignment_on_tf_layers_dense(graph):
  x = tf.constant(X)
  h = tf1.layers.dense(x, 4, activation=tf.nn.relu, name="d1")
  out = tf1.layers.dense(h, 3, activation=tf.nn.relu, name="d2")
  loss = tf.reduce_sum(out * tf.constant(Y))
  gv = gg.GradientPlan(loss).replace_backward(
      "d2", B.feedback_alignment(seed=0)).compute_gradients()
  b = _feedback("d2")
  g = tf1.gradients(loss, out)[0] * tf.cast(out > 0, tf.float32)  # relu'
  ref = tf1.gradients(h, trainable("d1"),
                      grad_ys=tf.matmul(g, b, transpose_b=True))
  got, ref = evaluate([grads_of(gv, "d1"), ref])
  for a, r in zip(got, ref):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-7)


# -- per-plan resources --------------------------------------------------------

def test_one_synthetic_value_gives_each_plan_and_layer_its_own_module():
  sg = B.synthetic(hidden=(3,), seed=0)
  eager = sg.initial_values("l3", 0, [4, 3, 4])  # as a TF2 executor makes them
  with tf.Graph().as_default():
    loss, _, (h1, h2) = _mlp(3)
    one = gg.GradientPlan(loss).replace_backward("l3", sg).replace_backward(
        "l2", sg)
    other = gg.GradientPlan(loss).replace_backward("l3", sg)
    gv_one, gv_other = one.compute_gradients(), other.compute_gradients()
    mine, theirs = sg.modules(one), sg.modules(other)
    assert sorted(mine) == sorted([h1.name, h2.name])
    assert list(theirs) == [h2.name]
    variables = [set(m.variables) for m in (*mine.values(), *theirs.values())]
    assert sum(len(v) for v in variables) == len(set().union(*variables)) == 12
    # Each plan trains its own modules, and only those.
    assert [v for _, v in gv_other[-4:]] == list(theirs[h2.name].variables)
    assert set(v for _, v in gv_one[6:]) == variables[0] | variables[1]
    a, b = evaluate([mine[h2.name].variables, theirs[h2.name].variables])
  # Equal seeds give equal initial values on both plans, and eagerly.
  assert np.abs(a[0]).max() > 0 and not a[2].any()  # zero output layer
  for x, y, z in zip(a, b, eager):
    np.testing.assert_array_equal(x, y)
    np.testing.assert_allclose(x, z.numpy(), rtol=1e-6)


def test_feedback_matrices_are_made_once_per_plan_and_equal_for_one_seed():
  fa = B.feedback_alignment(seed=4)
  dfa = B.direct_feedback_alignment(seed=5)
  # Eagerly, as a TF2 executor makes them.
  expected = [fa.matrix_value("l2", [4, 4], fan_out=4).numpy(),
              dfa.matrix_value("l3", 0, n_err=3, n_in=4).numpy()]
  np.testing.assert_array_equal(expected[0], B.feedback_matrix_value(
      4, "feedback_alignment", "l2", [4, 4], 1 / np.sqrt(4)).numpy())
  with tf.Graph().as_default():
    loss, _, _ = _mlp(3)
    one = gg.GradientPlan(loss).replace_backward("l2", fa).replace_backward(
        "l3", dfa)
    other = gg.GradientPlan(loss).replace_backward("l2", fa)
    one.compute_gradients()
    other.compute_gradients()
    b1, b2 = (p.resources.get("l2", "feedback_alignment")
              for p in (one, other))
    b3 = one.resources.get("l3", "dfa_0")
    assert b1 is not b2 and one.resources.variables() == (b3, b1)
    v1, v2, v3 = evaluate([b1, b2, b3])
  np.testing.assert_array_equal(v1, v2)
  np.testing.assert_allclose(v1, expected[0], rtol=1e-6)
  np.testing.assert_allclose(v3, expected[1], rtol=1e-6)


def test_a_replacement_differentiates_through_the_context_vjp(graph):
  loss, logits, (h,) = _mlp(2, tf.tanh)
  gv = gg.GradientPlan(loss).replace_backward(
      "l2", HalfThroughKernel()).compute_gradients()
  w = trainable("l2")[0]
  delta = tf1.gradients(loss, logits)[0] * (1 - logits**2)  # through tanh
  ref_l1 = tf1.gradients(h, trainable("l1"),
                         grad_ys=0.5 * tf.matmul(delta, w, transpose_b=True))
  got_l1, got_l2, ref_l1, true_l2 = evaluate(
      [grads_of(gv, "l1"), grads_of(gv, "l2"), ref_l1,
       tf1.gradients(loss, trainable("l2"))])
  for a, e in zip(got_l1 + got_l2, ref_l1 + true_l2):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)


def test_the_context_vjp_takes_the_plans_overrides(graph):
  x = tf.constant(X)
  h = tf.nn.relu(dense(x, 4, "l1"))
  with tf1.variable_scope("q"):
    w = tf1.get_variable("w", initializer=tf.constant(
        np.linspace(-1.0, 1.0, 12).reshape(4, 3), tf.float32))
    m = 4.0 * tf.matmul(h, w)
    q = tf.round(m) / 4.0
  loss = tf.reduce_sum(tf.square(q - 0.3))
  gv = (gg.GradientPlan(loss).straight_through("Round")
        .replace_backward("q", lambda ctx: ctx.vjp(ctx.outputs, ctx.inputs,
                                                   ctx.upstream))
        .compute_gradients())
  # The straight-through estimator by hand: round's gradient is identity.
  ste = (m + tf.stop_gradient(tf.round(m) - m)) / 4.0
  ref = tf1.gradients(tf.reduce_sum(tf.square(ste - 0.3)), trainable("l1"))
  got, ref = evaluate([grads_of(gv, "l1"), ref])
  assert np.any(got[0] != 0)
  for a, e in zip(got, ref):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)


def test_a_replacement_returns_extra_grads_andtrainable(graph):
  loss, _, (h,) = _mlp(2)
  def scaled(ctx):
    c = ctx.resources.get_or_create(
        ctx.layer.name, "scaled/c", lambda: tf1.Variable(2.0, name="c"))
    grads = [c * g for g in ctx.chain_rule()]
    extra = tf.reduce_sum(grads[0])  # a gradient for c, as a stand-in
    return B.BackwardResult(grads, [(extra, c)])
  plan = gg.GradientPlan(loss).replace_backward("l2", scaled)
  gv = plan.compute_gradients()
  c = plan.resources.get("l2", "scaled/c")
  assert gv[-1][1] is c and len(gv) == 5
  true_h = tf1.gradients(loss, h)[0]
  ref = tf1.gradients(h, trainable("l1"), grad_ys=2.0 * true_h)
  got, ref, sum_h = evaluate([[g for g, _ in gv], ref, tf.reduce_sum(true_h)])
  for a, r in zip(got[:2], ref):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got[-1], 2.0 * sum_h, rtol=1e-5)
