"""gg.transforms.per_example against numpy, alone and on both plans.

On a plan it rewrites the upstream gradient of ``l2`` in
``x -> l1 -> h1 -> l2 -> h2 -> l3``: the reference clips each row of the
plain upstream gradient at ``h2`` in numpy and backpropagates it below
``l2`` with ``grad_ys`` (TF1) or ``output_gradients`` (a GradientTape).
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad import transforms as T
from helpers import dense, evaluate
from keras_cases import FLAVOURS, tanh_chain

tf1 = tf.compat.v1

CLIP = 0.2
X = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)


@pytest.fixture(params=sorted(FLAVOURS))
def K(request):
  """Each Keras flavour in turn, as in tests/keras."""
  return FLAVOURS[request.param]


def _rows_clipped(g, c):
  """Each example's slice of ``g`` scaled to L2 norm at most ``c``."""
  flat = g.reshape(len(g), -1).astype(np.float64)
  norms = np.linalg.norm(flat, axis=1)
  factor = np.minimum(1.0, c / np.maximum(norms, 1e-30))
  return (flat * factor[:, None]).reshape(g.shape), norms


def test_clips_each_example_of_a_rank_3_gradient():
  g = np.random.default_rng(0).normal(size=(4, 3, 2)).astype(np.float32)
  g *= 2.0
  g[1] *= 0.01  # one example under the bound: unchanged
  with tf.Graph().as_default():
    got = evaluate(T.per_example(T.clip_by_norm(1.0))(tf.constant(g)))
  want, norms = _rows_clipped(g, 1.0)
  assert norms[1] < 1.0 < min(norms[0], norms[2], norms[3])
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_callable_keeps_dtype_and_sees_one_slice():
  g = np.arange(6, dtype=np.float64).reshape(3, 2)
  shapes = []

  def fn(x):
    shapes.append(x.shape.as_list())
    return x - tf.reduce_mean(x)
  out = T.per_example(fn)(tf.constant(g))
  assert out.dtype == tf.float64 and shapes == [[2]]
  np.testing.assert_allclose(out.numpy(), g - g.mean(axis=1, keepdims=True))


def test_linear_only_when_fn_is():
  assert T.per_example(T.scale(-0.5)).linear_factor == -0.5
  assert T.per_example(T.clip_by_norm(1.0)).linear_factor is None
  assert T.per_example(lambda g: 2.0 * g).linear_factor is None
  assert repr(T.per_example(T.clip_by_norm(1.0))) == (
      "per_example(clip_by_norm(1.0))")
  assert T.per_example(T.scale(2.0))(None) is None


def test_refuses_a_scalar_a_sparse_gradient_and_a_group_transform():
  clip = T.per_example(T.clip_by_norm(1.0))
  with pytest.raises(gg.GraphGradError,
                     match=r"per_example\(clip_by_norm\(1\.0\)\): the "
                           r"gradient is a scalar \(shape \[\]\), which has "
                           r"no example axis"):
    clip(tf.constant(3.0))
  with pytest.raises(gg.GraphGradError,
                     match=r"per_example\(clip_by_norm\(1\.0\)\): the "
                           r"gradient is a tf\.IndexedSlices .* not "
                           r"examples"):
    clip(tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 4])))
  with pytest.raises(gg.GraphGradError,
                     match=r"per_example: `fn` is the group transform"):
    T.per_example(T.clip_by_global_norm(1.0))
  with pytest.raises(gg.GraphGradError,
                     match=r"per_example: `fn` must be a callable"):
    T.per_example(3.0)


def test_refuses_a_scalar_of_unknown_rank_at_run_time():
  with tf.Graph().as_default():
    g = tf1.placeholder(tf.float32, shape=None)
    out = T.per_example(T.clip_by_norm(1.0))(g)
    with tf1.Session() as sess:
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r"the gradient is a scalar"):
        sess.run(out, {g: 3.0})
      np.testing.assert_allclose(sess.run(out, {g: [[3.0, 4.0]]}),
                                 [[0.6, 0.8]], rtol=1e-6)


def test_gradient_plan_clips_each_example_of_the_upstream():
  with tf.Graph().as_default():
    h1 = dense(tf.constant(X), 5, "l1", tf.tanh)
    h2 = dense(h1, 5, "l2", tf.tanh)
    loss = tf.reduce_sum(tf.square(dense(h2, 3, "l3")))
    plan = gg.GradientPlan(loss).transform_upstream(
        "l2", T.per_example(T.clip_by_norm(CLIP)))
    got = [g for g, _ in plan.compute_gradients()]
    g_h2 = evaluate(tf.gradients(loss, h2)[0])
    clipped, norms = _rows_clipped(g_h2, CLIP)
    l1 = tf1.trainable_variables("l1/")
    rest = [v for v in tf1.trainable_variables() if v not in l1]
    want = (tf.gradients(h2, l1, grad_ys=tf.constant(clipped, tf.float32))
            + tf.gradients(loss, rest))
    got, want = evaluate([got, want])
  assert max(norms) > 2 * CLIP  # the clip acts
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_keras_plan_clips_each_example_of_the_upstream(K):
  x = tf.constant(X)
  model = tanh_chain(K, x)
  plan = gg.KerasPlan(model).transform_upstream(
      "l2", T.per_example(T.clip_by_norm(CLIP)))
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(x)))
  got = [g.numpy() for g in tape.gradient(loss)]
  l1, l2, l3 = model.layers
  with tf.GradientTape(persistent=True) as ref:
    h2 = l2(l1(x))
    loss = tf.reduce_sum(tf.square(l3(h2)))
  clipped, norms = _rows_clipped(ref.gradient(loss, h2).numpy(), CLIP)
  want = (ref.gradient(h2, l1.trainable_variables,
                       output_gradients=tf.constant(clipped, tf.float32))
          + ref.gradient(loss, l2.trainable_variables
                         + l3.trainable_variables))
  assert max(norms) > 2 * CLIP  # the clip acts
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-6)


def test_a_callable_inside_is_checked_at_run_time_by_a_plan():
  from graphgrad.transforms._checks import _keeps_shape
  assert _keeps_shape(T.per_example(T.clip_by_norm(1.0)))
  assert not _keeps_shape(T.per_example(lambda g: g))


def test_reads_the_global_step_when_fn_does():
  annealed = T.add_noise(eta=0.1, seed=0)
  assert annealed.reads_global_step
  assert T.per_example(annealed).reads_global_step
  assert not T.per_example(T.clip_by_norm(1.0)).reads_global_step
