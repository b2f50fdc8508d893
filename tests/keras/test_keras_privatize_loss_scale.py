"""KerasPlan.privatize under ``mixed_float16`` with a LossScaleOptimizer.

The model computes in float16 with float32 variables. Its per-example losses
are small, so that float16 gradients underflow without a loss scale.
Reference: the same weights in a float32 model, one ``tf.GradientTape`` per
example, each example's gradient clipped over all variables together in
numpy, summed and divided by the batch size. Each step is read from the
variables' change, so the optimizer's own unscaling is part of what is
tested.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg

B = 8
SMALL = 1e-7  # the losses' factor: float16 boundary gradients of ~1e-7
WIDTH = 64    # the middle kernel has WIDTH**2 entries, for the noise's spread
LR = 1e6      # a step of about 1, read from float32 variables of about 1
# float16 keeps 11 significant bits (a rounding of 4.9e-4 relative): the
# forward values and the scaled boundary gradients each carry a few such
# roundings, and the clip factors inherit them. Measured: 6e-4 of the
# largest entry of a variable's gradient; 4e-3 (eight roundings) leaves room
# and is far below the error of the underflow without a loss scale (0.18).
TOL = 4e-3


def _model(K):
  def init(fan_in):
    return K.initializers.RandomNormal(stddev=fan_in ** -0.5, seed=fan_in)
  return K.Sequential([
      K.Input((4,)),
      K.layers.Dense(WIDTH, activation="tanh", kernel_initializer=init(4)),
      K.layers.Dense(WIDTH, activation="tanh",
                     kernel_initializer=init(WIDTH)),
      K.layers.Dense(3, kernel_initializer=init(WIDTH)),
      K.layers.Activation("linear", dtype="float32")])


def _loss(out, y):
  return SMALL * tf.reduce_sum(tf.square(out - y), axis=1)


def _data():
  rng = np.random.default_rng(7)
  return (rng.normal(size=(B, 4)).astype(np.float32),
          (3.0 * rng.normal(size=(B, 3))).astype(np.float32))


def _reference(K, weights, clip, loss_fn=_loss):
  """``(1/B) sum_i clip_C(grad l_i)`` of a float32 model, and the norms."""
  model = _model(K)
  model.set_weights(weights)
  x, y = _data()
  per = []
  for i in range(B):
    with tf.GradientTape() as tape:
      loss = loss_fn(model(x[i:i + 1]), y[i:i + 1])[0]
    per.append([g.numpy().astype(np.float64) for g in
                tape.gradient(loss, model.trainable_variables)])
  norms = np.array([np.sqrt(sum(np.sum(g * g) for g in grads))
                    for grads in per])
  c = np.minimum(1.0, clip / norms)
  return [sum(ci * g[j] for ci, g in zip(c, per)) / B
          for j in range(len(per[0]))], norms


def _loss_scale_optimizer(K, initial_scale=2.0 ** 15):
  return K.mixed_precision.LossScaleOptimizer(
      K.optimizers.SGD(LR), initial_scale=initial_scale)


def _scale_of(opt):
  return float(np.asarray(getattr(opt, "dynamic_scale", None)
                          if hasattr(opt, "scale_loss") else opt.loss_scale))


def _step(K, weights, clip, sigma, opt, function=False):
  """One custom-loop step of a privatized plan on a float16 model: the
  variables' change divided by the learning rate."""
  model = _model(K)
  model.set_weights(weights)
  plan = gg.KerasPlan(model).privatize(clip, sigma, seed=3)
  keras3 = hasattr(opt, "scale_loss")
  scaling = hasattr(opt, "scale_loss") or hasattr(opt, "get_scaled_loss")

  def grads(x, y):
    with plan.tape(loss_scale=opt if scaling else None) as tape:
      loss = _loss(model(x), y)
      if scaling:
        loss = opt.scale_loss(loss) if keras3 else opt.get_scaled_loss(loss)
    got = [g for g, _ in tape.grads_and_vars(loss)]
    if scaling and not keras3:  # tf-keras: the caller unscales
      got = opt.get_unscaled_gradients(got)
    return got

  if function:
    grads = tf.function(grads)
  x, y = _data()
  opt.apply_gradients(zip(grads(tf.constant(x), tf.constant(y)),
                          model.trainable_variables))
  return [(b - a) / LR for b, a in zip(weights, model.get_weights())]


def _err(got, want):
  """The largest error of each variable, relative to its largest entry."""
  return max(float(np.max(np.abs(g - w)) / np.max(np.abs(w)))
             for g, w in zip(got, want))


def _clip(K, weights, loss_fn=_loss):
  """The median norm: half the examples are clipped."""
  return float(np.median(_reference(K, weights, 1.0, loss_fn)[1]))


@pytest.mark.parametrize("function", [False, True])
def test_the_step_is_dp_sgd_of_the_float32_model(K, policy, function):
  weights = _model(K).get_weights()
  clip = _clip(K, weights)
  want, norms = _reference(K, weights, clip)
  assert (norms > clip).any() and (norms < clip).any()
  policy("mixed_float16")
  got = _step(K, weights, clip, 0.0, _loss_scale_optimizer(K), function)
  assert _err(got, want) < TOL
  # The control: without the loss scale the float16 gradients underflow
  # (and the norms with them), far beyond the tolerance.
  unscaled = _step(K, weights, clip, 0.0, K.optimizers.SGD(LR), function)
  assert _err(unscaled, want) > 5 * TOL


def test_the_noise_is_sigma_c_over_b_not_divided_by_the_scale(K, policy):
  weights = _model(K).get_weights()
  clip, sigma = _clip(K, weights), 2.0
  policy("mixed_float16")
  noisy = _step(K, weights, clip, sigma, _loss_scale_optimizer(K))
  clean = _step(K, weights, clip, 0.0, _loss_scale_optimizer(K))
  noise = np.concatenate([(n - c).ravel() for n, c in zip(noisy, clean)])
  assert noise.size > WIDTH ** 2
  np.testing.assert_allclose(noise.std(), sigma * clip / B, rtol=0.05)
  assert abs(noise.mean()) < 0.05 * sigma * clip / B


@pytest.mark.parametrize("sigma", [0.0, 1.0])
def test_an_overflow_skips_the_step_and_lowers_the_scale(K, policy, sigma):
  weights = _model(K).get_weights()
  clip = _clip(K, weights)
  policy("mixed_float16")
  opt = _loss_scale_optimizer(K, initial_scale=2.0 ** 40)
  change = _step(K, weights, clip, sigma, opt)
  for d in change:
    np.testing.assert_array_equal(d, 0.0)
  assert _scale_of(opt) == 2.0 ** 39


def test_fit_under_mixed_float16(K, policy):
  """An attached fit: Keras wraps the optimizer in its LossScaleOptimizer."""
  def mse(out, y):  # the compiled loss of each example
    return SMALL * tf.reduce_mean(tf.square(out - y), axis=1)

  weights = _model(K).get_weights()
  clip = _clip(K, weights, mse)
  want, _ = _reference(K, weights, clip, mse)
  policy("mixed_float16")
  model = _model(K)
  model.set_weights(weights)
  model.compile(optimizer=K.optimizers.SGD(LR), loss="mse",
                loss_weights=[SMALL])
  gg.KerasPlan(model).privatize(clip, 0.0).attach()
  x, y = _data()
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  assert "LossScaleOptimizer" in type(model.optimizer).__name__
  assert _scale_of(model.optimizer) == 2.0 ** 15  # not an overflow
  got = [(b - a) / LR for b, a in zip(weights, model.get_weights())]
  assert _err(got, want) < TOL
