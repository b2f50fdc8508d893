"""Declarations on code without variable scopes, against hand-built references.

Both TF1 tutorial styles: unscoped ``tf.Variable`` (``Variable``,
``Variable_1``, ...) and flat ``tf.compat.v1.get_variable("w1")``. Layers come
from the ops that use the variables (``MatMul``, ``Conv2D``, ...); every
declaration is compared with ``tf.gradients`` (``grad_ys``,
``stop_gradients``) on the same tf.Graph, or with the same model written with
``gradient_override_map`` and run in this process.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad import backward as B
from helpers import assert_grads_close, evaluate

tf1 = tf.compat.v1
STYLES = ["tf_variable", "get_variable"]
X = np.random.default_rng(0).normal(size=(6, 2)).astype(np.float32)


class _Params:
  """Makes variables in one style from fixed numpy values."""

  def __init__(self, style, seed=0):
    self.style, self.count = style, 0
    self.rng = np.random.default_rng(seed)

  def __call__(self, *shape, kind="w"):
    value = (self.rng.normal(size=shape) / np.sqrt(shape[0])).astype(
        np.float32) if kind == "w" else (
            self.rng.normal(size=shape) * 0.1).astype(np.float32)
    self.count += 1
    if self.style == "tf_variable":
      return tf1.Variable(value)
    return tf1.get_variable(f"{kind}{self.count}", initializer=value)


def _mlp(style):
  """x -> relu(x W0 + b0) -> relu(h W1 + b1) -> h W2 + b2 -> loss."""
  p = _Params(style)
  x = tf.constant(X)
  h0 = tf.matmul(x, p(2, 15)) + p(15, kind="b")
  h1 = tf.matmul(tf.nn.relu(h0), p(15, 15)) + p(15, kind="b")
  y = tf.matmul(tf.nn.relu(h1), p(15, 4)) + p(4, kind="b")
  return tf.reduce_sum(tf.square(y)), (h0, h1, y)


def _vars(net, name):
  return list(net[name].variables)


def _grads(plan):
  return [g for g, _ in plan.compute_gradients()]


def _plain(loss, variables):
  return tf1.gradients(loss, variables)


# -- the layers ---------------------------------------------------------------

@pytest.mark.parametrize("style", STYLES)
def test_mlp_layers_and_boundaries(graph, style):
  loss, (h0, h1, y) = _mlp(style)
  net = gg.analyze(loss)
  assert net.names == ("MatMul", "MatMul_1", "MatMul_2")
  assert list(net.graph.edges) == [("MatMul", "MatMul_1"),
                                   ("MatMul_1", "MatMul_2")]
  assert net.boundary("MatMul", "MatMul_1") == (h0,)
  assert net["MatMul_2"].outputs == (y,)
  variables = tf1.trainable_variables()
  assert [v.name for l in net for v in l.variables] == [
      v.name for v in variables]
  for i, v in enumerate(variables):
    assert net.layer_of_variable(v) == net.names[i // 2]
  assert net.layer_of(h1.op) == "MatMul_1"  # the bias add
  assert net.layer_of(tf1.get_default_graph().get_operation_by_name(
      "Relu")) is None  # glue
  assert net.layer_of(y.op.inputs[0].op) == "MatMul_2"


@pytest.mark.parametrize("style", STYLES)
def test_mapped_variables_take_the_same_ops(graph, style):
  loss, (h0, _, _) = _mlp(style)
  v = tf1.trainable_variables()
  net = gg.analyze(loss, layers={"feature": v[:2], "hidden": v[2:4],
                                 "head": v[4:]})
  assert net.names == ("feature", "hidden", "head")
  assert net.boundary("feature", "hidden") == (h0,)
  auto = gg.analyze(loss)
  for a, b in zip(net.layers, auto.layers):
    assert [op.name for op in a.ops] == [op.name for op in b.ops]
  # A mapping of some variables: the rest are grouped automatically.
  part = gg.analyze(loss, layers={"head": v[4:]})
  assert part.names == ("MatMul", "MatMul_1", "head")


# -- declarations on the MLP --------------------------------------------------

@pytest.mark.parametrize("style", STYLES)
def test_mlp_upstream_edge_and_parameter_transforms(graph, style):
  loss, (h0, h1, _) = _mlp(style)
  net = gg.analyze(loss)
  v0, v1, v2 = (_vars(net, n) for n in net.names)
  f = gg.transforms.scale(-3.0)
  upstream = gg.GradientPlan(loss, net).transform_upstream("MatMul_1", f)
  g1 = tf1.gradients(loss, h1)[0]
  want_up = (tf1.gradients(h1, v0, grad_ys=-3.0 * g1)
             + _plain(loss, v1 + v2))
  edge = gg.GradientPlan(loss, net).transform_edge(
      "MatMul", "MatMul_1", gg.transforms.reverse(0.5))
  g0 = tf1.gradients(loss, h0)[0]
  want_edge = tf1.gradients(h0, v0, grad_ys=-0.5 * g0) + _plain(loss, v1 + v2)
  params = gg.GradientPlan(loss, net).transform_gradients(
      "MatMul_2", gg.transforms.scale(0.25))
  want_params = _plain(loss, v0 + v1) + [
      0.25 * g for g in _plain(loss, v2)]
  got = evaluate([_grads(upstream), want_up, _grads(edge), want_edge,
                  _grads(params), want_params, _plain(loss, v0)])
  for a, e in zip(got[0:6:2], got[1:6:2]):
    assert_grads_close(a, e)
  assert np.abs(got[0][0] - got[6][0]).max() > 1e-3  # it changed below


@pytest.mark.parametrize("style", STYLES)
def test_mlp_feedback_alignment(graph, style):
  loss, (h0, h1, _) = _mlp(style)
  net = gg.analyze(loss)
  v0, v1, v2 = (_vars(net, n) for n in net.names)
  plan = gg.GradientPlan(loss, net).replace_backward(
      "MatMul_1", B.feedback_alignment(seed=3))
  got = _grads(plan)
  fb = [v for v in tf1.global_variables()
        if "replace_backward_MatMul_1/" in v.name and v.name.endswith("B:0")]
  assert len(fb) == 1, fb
  # delta at the MatMul's output is the gradient at h1 (the bias add is
  # linear); the input gradient is delta B^T, at relu(h0).
  delta = tf1.gradients(loss, h1)[0]
  relu0 = tf1.get_default_graph().get_tensor_by_name("Relu:0")
  want = (tf1.gradients(relu0, v0, grad_ys=tf.matmul(delta, fb[0],
                                                     transpose_b=True))
          + _plain(loss, v1 + v2))
  assert_grads_close(*evaluate([got, want]))


@pytest.mark.parametrize("style", STYLES)
def test_mlp_straight_through_and_override(graph, style):
  p = _Params(style)
  x = tf.constant(X)
  h = tf.matmul(x, p(2, 5)) + p(5, kind="b")
  q = tf.round(h * 4.0) / 4.0
  y = tf.matmul(q, p(5, 3)) + p(3, kind="b")
  loss = tf.reduce_sum(tf.square(y))
  net = gg.analyze(loss)
  assert net.names == ("MatMul", "MatMul_1")
  round_op = q.op.inputs[0].op
  assert round_op.type == "Round" and net.layer_of(round_op) is None
  v = tf1.trainable_variables()
  st = gg.GradientPlan(loss, net).straight_through(round_op)
  # Reference: the same forward values, identity backward through Round.
  scaled = h * 4.0
  q_ref = (scaled + tf.stop_gradient(tf.round(scaled) - scaled)) / 4.0
  y_ref = tf.matmul(q_ref, v[2]) + v[3]
  want = tf1.gradients(tf.reduce_sum(tf.square(y_ref)), v)
  half = gg.GradientPlan(loss, net).override_gradient(
      round_op, lambda op, g: 0.5 * g)
  y_half = tf.matmul((scaled + tf.stop_gradient(tf.round(scaled) - scaled)
                      ) / 4.0, v[2]) + v[3]
  g_q = tf1.gradients(tf.reduce_sum(tf.square(y_half)), scaled)[0]
  want_half = (tf1.gradients(scaled, v[:2], grad_ys=0.5 * g_q)
               + tf1.gradients(loss, v[2:]))
  got = evaluate([_grads(st), want, _grads(half), want_half])
  assert_grads_close(got[0], got[1])
  assert_grads_close(got[2], got[3])
  assert np.abs(got[0][0]).max() > 1e-3


@pytest.mark.parametrize("style", STYLES)
def test_task_combination_on_an_unscoped_trunk(graph, style):
  p = _Params(style)
  x = tf.constant(X)
  trunk = tf.nn.relu(tf.matmul(x, p(2, 6)) + p(6, kind="b"))
  la = tf.reduce_sum(tf.square(tf.matmul(trunk, p(6, 2)) + p(2, kind="b")))
  lb = tf.reduce_sum(tf.sin(tf.matmul(trunk, p(6, 3)) + p(3, kind="b")))
  loss = la + lb
  net = gg.analyze(loss)
  assert net.names == ("MatMul", "MatMul_1", "MatMul_2")

  class Weighted:
    """Task gradients combined as 0.7 g_a + 0.2 g_b."""

    def combine(self, grads):
      return 0.7 * grads[0] + 0.2 * grads[1]

  plan = gg.GradientPlan(loss, net).combine_tasks("MatMul", [la, lb],
                                                  Weighted())
  out = net["MatMul"].outputs[0]
  ga, gb = tf1.gradients(la, out)[0], tf1.gradients(lb, out)[0]
  v = tf1.trainable_variables()
  want = (tf1.gradients(out, v[:2], grad_ys=0.7 * ga + 0.2 * gb)
          + tf1.gradients(loss, v[2:]))
  assert_grads_close(*evaluate([_grads(plan), want]))


# -- a convnet of tf.nn.conv2d over tf.Variable filters -----------------------

@pytest.mark.parametrize("style", STYLES)
def test_convnet(graph, style):
  rng = np.random.default_rng(3)
  p = _Params(style, seed=3)
  x = tf.constant(rng.normal(size=(2, 6, 6, 1)).astype(np.float32))
  c1 = tf.nn.bias_add(tf.nn.conv2d(x, p(3, 3, 1, 4), [1, 1, 1, 1], "SAME"),
                      p(4, kind="b"))
  c2 = tf.nn.bias_add(tf.nn.conv2d(tf.nn.relu(c1), p(3, 3, 4, 4),
                                   [1, 2, 2, 1], "SAME"), p(4, kind="b"))
  flat = tf.reshape(tf.nn.relu(c2), [2, 36])
  y = tf.matmul(flat, p(36, 3)) + p(3, kind="b")
  loss = tf.reduce_sum(tf.square(y))
  net = gg.analyze(loss)
  assert net.names == ("Conv2D", "Conv2D_1", "MatMul")
  assert list(net.graph.edges) == [("Conv2D", "Conv2D_1"),
                                   ("Conv2D_1", "MatMul")]
  assert net.boundary("Conv2D", "Conv2D_1") == (c1,)
  v = tf1.trainable_variables()
  plan = (gg.GradientPlan(loss, net)
          .transform_upstream("MatMul", gg.transforms.scale(2.0))
          .transform_edge("Conv2D", "Conv2D_1", gg.transforms.scale(-1.0))
          .transform_gradients("Conv2D_1", gg.transforms.scale(0.5)))
  g_c2 = 2.0 * tf1.gradients(loss, c2)[0]
  g_c1 = -1.0 * tf1.gradients(c2, c1, grad_ys=g_c2)[0]
  want = (tf1.gradients(c1, v[:2], grad_ys=g_c1)
          + [0.5 * g for g in tf1.gradients(c2, v[2:4], grad_ys=g_c2)]
          + tf1.gradients(loss, v[4:]))
  assert_grads_close(*evaluate([_grads(plan), want]), rtol=1e-5)


# -- a hand-written RNN cell over tf.Variables ---------------------------------

def _rnn(style, steps=3):
  """h_t = tanh([x_t, h_{t-1}] W + b), unrolled; head on the last h."""
  p = _Params(style, seed=5)
  xs = np.random.default_rng(5).normal(size=(steps, 4, 2)).astype(np.float32)
  w, b = p(2 + 3, 3), p(3, kind="b")
  h = tf.zeros([4, 3])
  for t in range(steps):
    h = tf.tanh(tf.matmul(tf.concat([tf.constant(xs[t]), h], 1), w) + b)
  y = tf.matmul(h, p(3, 1)) + p(1, kind="b")
  return tf.reduce_sum(tf.square(y)), h, (w, b)


@pytest.mark.parametrize("style", STYLES)
def test_rnn_cell_is_one_shared_layer(graph, style):
  loss, h, (w, b) = _rnn(style)
  net = gg.analyze(loss)
  assert net.names == ("MatMul", "MatMul_3")
  assert net["MatMul"].variables == (w, b)
  assert [op.name for op in net["MatMul"].ops
          if op.type == "MatMul"] == ["MatMul", "MatMul_1", "MatMul_2"]
  assert list(net.graph.edges) == [("MatMul", "MatMul_3")]
  # The last step's tanh is glue: it leads to the head only.
  assert net.boundary("MatMul", "MatMul_3") == (h.op.inputs[0],)
  assert net.layer_of(h.op) is None
  v = tf1.trainable_variables()
  plan = (gg.GradientPlan(loss, net)
          .transform_upstream("MatMul_3", gg.transforms.scale(-2.0))
          .transform_gradients("MatMul", gg.transforms.scale(0.5)))
  g = -2.0 * tf1.gradients(loss, h)[0]
  want = ([0.5 * x for x in tf1.gradients(h, v[:2], grad_ys=g)]
          + tf1.gradients(loss, v[2:]))
  assert_grads_close(*evaluate([_grads(plan), want]))


# -- two heads with a gradient-reversal edge ----------------------------------

# The classic flip_gradient, l = 0.3, under a name of this module's own
# (examples/gradient_reversal_migration.py registers FlipGradient0, 1, ...).
@tf.RegisterGradient("UnscopedFlipGradient0")
def _flip_gradient(op, grad):
  del op
  return [-0.3 * grad]


def _two_heads(style, flip):
  """features -> label head; features -> (flip) -> domain head."""
  p = _Params(style, seed=7)
  rng = np.random.default_rng(7)
  x = tf.constant(rng.normal(size=(8, 4)).astype(np.float32))
  labels = tf.constant(np.eye(3, dtype=np.float32)[rng.integers(0, 3, 8)])
  domains = tf.constant(np.eye(2, dtype=np.float32)[rng.integers(0, 2, 8)])
  f = tf.nn.relu(tf.matmul(x, p(4, 6)) + p(6, kind="b"))
  label_logits = tf.matmul(f, p(6, 3)) + p(3, kind="b")
  if flip:
    with tf1.get_default_graph().gradient_override_map(
        {"Identity": "UnscopedFlipGradient0"}):
      f = tf.identity(f)
  domain_logits = tf.matmul(f, p(6, 2)) + p(2, kind="b")
  return (tf.reduce_mean(tf1.nn.softmax_cross_entropy_with_logits_v2(
      labels=labels, logits=label_logits))
          + tf.reduce_mean(tf1.nn.softmax_cross_entropy_with_logits_v2(
              labels=domains, logits=domain_logits)))


def _train(loss, train_op, steps):
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    grads, losses = [], []
    for _ in range(steps):
      _, lv = sess.run([train_op, loss])
      losses.append(lv)
    grads = sess.run(tf1.trainable_variables())
  return losses, grads


@pytest.mark.parametrize("style", STYLES)
def test_gradient_reversal_edge_trains_like_gradient_override_map(style):
  steps = 5
  with tf.Graph().as_default():
    loss = _two_heads(style, flip=True)
    step_ref = tf1.gradients(loss, tf1.trainable_variables())
    ref = _train(loss, tf1.train.GradientDescentOptimizer(0.5).minimize(loss),
                 steps)
    first_ref = evaluate(step_ref)
  with tf.Graph().as_default():
    loss = _two_heads(style, flip=False)
    net = gg.analyze(loss)
    assert net.names == ("MatMul", "MatMul_1", "MatMul_2")
    assert set(net.graph.edges) == {("MatMul", "MatMul_1"),
                                    ("MatMul", "MatMul_2")}
    plan = gg.GradientPlan(loss, net).transform_edge(
        "MatMul", "MatMul_2", gg.transforms.reverse(0.3))
    step = _grads(plan)
    train = plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.5))
    got = _train(loss, train, steps)
    first = evaluate(step)
  assert_grads_close(first, first_ref, rtol=1e-6)
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
  assert_grads_close(got[1], ref[1], rtol=1e-5)
  assert ref[0][-1] != ref[0][0]
