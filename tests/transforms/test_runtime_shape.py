"""A transform that changes a gradient's shape fails, naming what it was."""

import re

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense

tf1 = tf.compat.v1


def _halve_batch(g):
  """A transform of the wrong run-time shape: drops half the batch."""
  return g[: tf.shape(g)[0] // 2]


def _net(batch):
  x = tf1.placeholder(tf.float32, [batch, 3], name="x")
  h = dense(dense(x, 4, "l1", tf.tanh), 4, "l2", tf.tanh)
  return x, tf.reduce_sum(dense(h, 2, "l3"))


def test_a_wrong_run_time_shape_names_the_transform_layer_and_shapes(graph):
  x, loss = _net(None)
  plan = gg.GradientPlan(loss).transform_upstream("l2", _halve_batch)
  grads = [g for g, _ in plan.compute_gradients()]
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
      sess.run(grads, {x: np.ones((4, 3), np.float32)})
  message = info.value.message
  # TF escapes the quotes of the assertion's message.
  assert re.search(r"transform_upstream\(\\?'l2\\?'\) on l2/Tanh:0: the "
                   r"transform .*_halve_batch", message), message
  assert "static (None, 4) for (None, 4)" in message
  assert "[4 4]" in message and "[2 4]" in message  # both run-time shapes


def test_a_right_run_time_shape_gives_the_reference_gradients(graph):
  x, loss = _net(None)
  plan = gg.GradientPlan(loss).transform_upstream("l2", lambda g: 0.5 * g)
  gv = plan.compute_gradients()
  ref = tf.gradients(loss, [v for _, v in gv])
  weights = [0.5 if v.op.name.startswith("l1/") else 1.0 for _, v in gv]
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    feed = {x: np.arange(12.0).reshape(4, 3) / 12}
    got, want = sess.run([[g for g, _ in gv], ref], feed)
  for a, b, w in zip(got, want, weights):
    np.testing.assert_allclose(a, w * b, rtol=1e-6)


def test_a_static_shape_mismatch_fails_at_build_time(graph):
  _, loss = _net(4)
  plan = gg.GradientPlan(loss).transform_upstream("l2", _halve_batch)
  with pytest.raises(gg.GraphGradError,
                     match=r"transform_upstream\('l2'\) on l2/Tanh:0: the "
                     r"transform .*_halve_batch.* changed the gradient "
                     r"from shape \(4, 4\) float32 to shape \(2, 4\)"):
    plan.compute_gradients()


def test_builtin_transforms_add_no_run_time_check(graph):
  _, loss = _net(None)
  plan = gg.GradientPlan(loss).transform_upstream("l2",
                                                  gg.transforms.scale(0.5))
  plan.compute_gradients()
  assert not [op for op in graph.get_operations() if "check_shape" in op.name]


# -- the check gates its consumer: Grappler, XLA auto-jit, jit_compile --------
#
# Layer l2 is linear, so the transformed gradient goes straight into MatMuls;
# transposing a (2, 4) gradient gives one of (4, 2), which a MatMul below
# rejects unless the check runs first.

BAD_FEED = np.ones((2, 3), np.float32)


def _flip(g):
  """A transform that keeps the shape but not the order of the rows."""
  return tf.reverse(g, [0])


def _linear_net():
  x = tf1.placeholder(tf.float32, [None, 3], name="x")
  h = dense(dense(x, 4, "l1", tf.tanh), 4, "l2")
  return x, h, tf.reduce_sum(tf.tanh(dense(h, 2, "l3")))


def _session_config(xla):
  config = tf1.ConfigProto()
  if xla:
    config.graph_options.optimizer_options.global_jit_level = (
        tf1.OptimizerOptions.ON_1)
  return config


def _plan_gradients(fn, xla):
  """The plan's gradients of the linear net; under ``xla`` its ops are
  compiled by XLA (jit_scope, which clusters on CPU as well)."""
  x, h, loss = _linear_net()
  with tf.xla.experimental.jit_scope(compile_ops=xla):
    gv = gg.GradientPlan(loss).transform_upstream("l2", fn).compute_gradients()
  return x, h, loss, gv


@pytest.mark.parametrize("xla", [False, True], ids=["grappler", "xla"])
def test_a_wrong_shape_fails_in_the_check_before_the_matmul(graph, xla):
  x, _, _, gv = _plan_gradients(tf.transpose, xla)
  with tf1.Session(config=_session_config(xla)) as sess:
    sess.run(tf1.global_variables_initializer())
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
      sess.run([g for g, _ in gv], {x: BAD_FEED})
  message = info.value.message
  assert "/check_shape_transform_upstream_l2_on_l2_BiasAdd_0/" in (
      info.value.op.name), message
  assert re.search(r"transform_upstream\(\\?'l2\\?'\) on l2/BiasAdd:0: the "
                   r"transform .*transpose.* returned a gradient of another "
                   r"shape", message), message
  assert "[2 4]" in message and "[4 2]" in message, message


@pytest.mark.parametrize("xla", [False, True], ids=["grappler", "xla"])
def test_a_checked_transform_gives_the_exact_gradient(graph, xla):
  x, h, loss, gv = _plan_gradients(_flip, xla)
  assert [op for op in graph.get_operations() if "check_shape" in op.name]
  # l2's own parameters get the gradient as it came; l1 the transformed.
  below = [v for _, v in gv if v.op.name.startswith("l1/")]
  dh = tf.gradients(loss, h)[0]
  want = dict(zip(below, tf.gradients(h, below, grad_ys=_flip(dh))))
  want.update((v, tf.gradients(loss, v)[0]) for _, v in gv if v not in want)
  with tf1.Session(config=_session_config(xla)) as sess:
    sess.run(tf1.global_variables_initializer())
    feed = {x: np.arange(6.0).reshape(2, 3) / 6}
    got, ref = sess.run([[g for g, _ in gv], [want[v] for _, v in gv]], feed)
  for a, b in zip(got, ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _keras_step(fn, jit_compile=True):
  """A step of a KerasPlan, with a batch of unknown size."""
  keras = tf.keras
  inp = keras.Input((3,))
  h = keras.layers.Dense(4, activation="tanh", name="l1")(inp)
  h = keras.layers.Dense(4, name="l2")(h)
  model = keras.Model(inp, keras.layers.Dense(2, name="l3")(h))
  plan = gg.KerasPlan(model).transform_upstream("l2", fn)

  @tf.function(jit_compile=jit_compile,
               input_signature=[tf.TensorSpec([None, 3], tf.float32)])
  def step(x):
    with plan.tape() as tape:
      loss = tf.reduce_sum(tf.tanh(model(x)))
    return [g for g, _ in tape.grads_and_vars(loss)]
  return model, step


def test_a_wrong_shape_in_a_keras_step_fails_in_the_check():
  _, step = _keras_step(tf.transpose, jit_compile=False)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"transform_upstream\(\\?'l2\\?'\) on \S*l2\S*: the "
                     r"transform .*transpose.* returned a gradient of "
                     r"another shape"):
    step(tf.constant(BAD_FEED))


def test_a_wrong_shape_under_jit_compile_fails_in_the_check():
  _, step = _keras_step(tf.transpose)
  with pytest.raises(tf.errors.InvalidArgumentError) as info:
    step(tf.constant(BAD_FEED))
  # XLA drops Assert: the failing node is the check's, named after the
  # declaration and the layer.
  assert re.search(r"\{\{node graphgrad/check_shape_transform_upstream_l2_on_"
                   r"\w*l2\w*_BiasAdd_0/the_transform_changed_the_shape\}\}",
                   info.value.message), info.value.message


def test_a_checked_transform_under_jit_compile_gives_the_exact_gradient():
  model, step = _keras_step(_flip)
  x = tf.constant(np.arange(6.0).reshape(2, 3) / 6, tf.float32)
  got = step(x)
  l1, l2, l3 = (model.get_layer(n) for n in ("l1", "l2", "l3"))
  with tf.GradientTape(persistent=True) as tape:
    h = l2(l1(x))
    loss = tf.reduce_sum(tf.tanh(l3(h)))
  dh = tape.gradient(loss, h)
  want = tape.gradient(h, l1.trainable_weights, output_gradients=_flip(dh))
  want += tape.gradient(loss, l2.trainable_weights + l3.trainable_weights)
  assert len(got) == len(want) == 6
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
