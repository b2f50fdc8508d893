"""GradientPlan.privatize with TF1's MixedPrecisionLossScaleOptimizer.

The model keeps float32 variables and computes in float16 (casts inside the
tf.Graph). Its per-example losses are small, so that float16 gradients
underflow without a loss scale. Reference: the same model computed in
float32, one ``tf.gradients`` call per example, each example's gradient
clipped over all variables together in numpy, summed and divided by the
batch size.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg

tf1 = tf.compat.v1
MPLSO = tf1.mixed_precision.MixedPrecisionLossScaleOptimizer

B = 8
SMALL = 1e-7  # the losses' factor: float16 boundary gradients of ~1e-7
WIDTH = 64    # l2's kernel has WIDTH**2 entries, for the noise's spread
# float16 keeps 11 significant bits (a rounding of 4.9e-4 relative): the
# forward values and the scaled boundary gradients each carry a few such
# roundings, and the clip factors inherit them. Measured: 5.8e-4 of the
# largest entry of a variable's gradient; 4e-3 (eight roundings) leaves
# room and is far below the error of the underflow without a loss scale
# (measured 0.38).
TOL = 4e-3
LR = 1e6  # a step of about 1, read from float32 variables of about 1


def _dense(x, units, name, half, act=None):
  rng = np.random.default_rng(len(name) + units)
  fan_in = int(x.shape[-1])
  cast = (lambda t: tf.cast(t, tf.float16)) if half else tf.identity
  with tf1.variable_scope(name):
    w = tf1.get_variable("kernel", initializer=(rng.normal(
        size=(fan_in, units)) / np.sqrt(fan_in)).astype(np.float32))
    b = tf1.get_variable("bias", initializer=np.full(units, 0.1, np.float32))
    out = tf.matmul(x, cast(w)) + cast(b)
    return act(out) if act else out


def _model(half):
  """Placeholders and the per-example losses ``[B]``."""
  x = tf1.placeholder(tf.float32, [None, 4])
  y = tf1.placeholder(tf.float32, [None, 3])
  h = tf.cast(x, tf.float16) if half else x
  h = _dense(h, WIDTH, "l1", half, tf.tanh)
  h = _dense(h, WIDTH, "l2", half, tf.tanh)
  out = _dense(h, 3, "l3", half)
  loss = SMALL * tf.reduce_sum(tf.square(tf.cast(out, tf.float32) - y),
                               axis=1)
  return x, y, loss


def _feed(x, y):
  rng = np.random.default_rng(7)
  return {x: rng.normal(size=(B, 4)).astype(np.float32),
          y: (3.0 * rng.normal(size=(B, 3))).astype(np.float32)}


def _reference(clip):
  """``(1/B) sum_i clip_C(grad l_i)`` in float32, and the norms."""
  with tf.Graph().as_default():
    x, y, loss = _model(half=False)
    variables = tf1.trainable_variables()
    per = [tf1.gradients(loss[i], variables) for i in range(B)]
    with tf1.Session() as s:
      s.run(tf1.global_variables_initializer())
      values = s.run(per, _feed(x, y))
  norms = np.array([np.sqrt(sum(np.sum(np.square(g, dtype=np.float64))
                                for g in grads)) for grads in values])
  c = np.minimum(1.0, clip / norms)
  return [sum(ci * g[j] for ci, g in zip(c, values)) / B
          for j in range(len(variables))], norms


def _clip():
  """The median norm: half the examples are clipped."""
  return float(np.median(_reference(1.0)[1]))


def _step(clip, loss_scale, sigma=0.0):
  """One planned SGD step under privatize: the variables' change divided
  by the learning rate (the gradient the optimizer applied), and the
  loss-scale optimizer's variables after."""
  with tf.Graph().as_default():
    x, y, loss = _model(half=True)
    if callable(loss_scale):  # made in this tf.Graph
      loss_scale = loss_scale()
    inner = tf1.train.GradientDescentOptimizer(LR)
    opt = inner if loss_scale is None else MPLSO(inner, loss_scale)
    plan = gg.GradientPlan(
        loss, loss_scale=opt if loss_scale is not None else None)
    plan = plan.privatize(clip, sigma, seed=3)
    step = plan.apply_gradients(opt)
    variables = tf1.trainable_variables()
    scale = [v for v in opt.variables() if v not in variables]
    with tf1.Session() as s:
      s.run(tf1.global_variables_initializer())
      before = s.run(variables)
      s.run(step, _feed(x, y))
      after, scale = s.run([variables, scale])
  return [(b - a) / LR for b, a in zip(before, after)], scale


def _err(got, want):
  """The largest error of each variable, relative to its largest entry."""
  return max(float(np.max(np.abs(g - w)) / np.max(np.abs(w)))
             for g, w in zip(got, want))


@pytest.mark.parametrize("loss_scale", [2.0 ** 15, "dynamic"])
def test_the_step_is_dp_sgd_of_the_float32_model(loss_scale):
  clip = _clip()
  want, norms = _reference(clip)
  assert (norms > clip).any() and (norms < clip).any()
  got, _ = _step(clip, loss_scale)
  assert _err(got, want) < TOL
  # The control: without the loss scale the float16 gradients underflow
  # (and the norms with them), far beyond the tolerance.
  unscaled, _ = _step(clip, None)
  assert _err(unscaled, want) > 5 * TOL


def test_the_noise_is_sigma_c_over_b_not_divided_by_the_scale():
  clip, sigma = _clip(), 2.0
  with tf.Graph().as_default():
    x, y, loss = _model(half=True)
    grads = []
    for noise in (sigma, 0.0):
      opt = MPLSO(tf1.train.GradientDescentOptimizer(1.0), 2.0 ** 15)
      gv = gg.GradientPlan(loss, loss_scale=opt).privatize(
          clip, noise, seed=5).compute_gradients()
      grads.append([g for g, _ in gv])
    feed = _feed(x, y)
    with tf1.Session() as s:
      s.run(tf1.global_variables_initializer())
      draws = [s.run(grads, feed) for _ in range(4)]  # a new draw each run
  noise = np.concatenate([(n - c).ravel() for noisy, clean in draws
                          for n, c in zip(*[noisy, clean])])
  assert noise.size > 4 * WIDTH ** 2
  np.testing.assert_allclose(noise.std(), sigma * clip / B, rtol=0.05)
  assert abs(noise.mean()) < 0.05 * sigma * clip / B
  # The noise-free half is DP-SGD's gradient.
  assert _err(draws[0][1], _reference(clip)[0]) < TOL


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_an_overflow_skips_the_step_and_lowers_the_scale(sigma):
  change, after = _step(_clip(), lambda: tf1.mixed_precision.DynamicLossScale(
      initial_loss_scale=2.0 ** 40), sigma)
  for d in change:
    np.testing.assert_array_equal(d, 0.0)
  assert float(after[0]) == 2.0 ** 39
