"""Keras mixed precision: transforms see the unscaled gradient in float32.

Reference: the same plan on the same weights and batches in float32.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from keras_cases import normal_rows

ROWS, BATCH = 32, 8


def _model(K):
  init = K.initializers.RandomNormal(stddev=0.5, seed=1)
  return K.Sequential([
      K.Input((3,)),
      K.layers.Dense(4, activation="tanh", name="l1", kernel_initializer=init),
      K.layers.Dense(2, name="l2", kernel_initializer=init),
      K.layers.Activation("linear", dtype="float32", name="out")])


def _declare(model):
  return (gg.KerasPlan(model)
          .transform_upstream("l2", gg.transforms.clip_by_norm(0.05))
          .transform_gradients("l1", gg.transforms.clip_by_norm(0.1)))


def _data():
  return (normal_rows(0, (ROWS, 3)).numpy(), normal_rows(1, (ROWS, 2)).numpy())


def _custom_loop(K, weights, mixed, loss_scale):
  """Four SGD steps; ``loss_scale``: "optimizer", a number, or None."""
  model = _model(K)
  model.set_weights(weights)
  opt = K.optimizers.SGD(0.1)
  if mixed:
    opt = K.mixed_precision.LossScaleOptimizer(opt)
  keras3 = hasattr(opt, "scale_loss")
  plan = _declare(model)
  x, y = _data()
  for i in range(0, ROWS, BATCH):
    arg = opt if loss_scale == "optimizer" else loss_scale
    with plan.tape(loss_scale=arg if mixed else None) as tape:
      loss = tf.reduce_mean(tf.square(model(x[i:i + BATCH]) - y[i:i + BATCH]))
      if mixed and loss_scale == 1024.0:
        target = loss * 1024.0  # scaled by hand
      elif mixed:
        target = opt.scale_loss(loss) if keras3 else opt.get_scaled_loss(loss)
      else:
        target = loss
    pairs = tape.grads_and_vars(target)
    grads = [g for g, _ in pairs]
    if mixed and loss_scale == 1024.0:
      grads = [g / 1024.0 for g in grads]
      opt = opt.inner_optimizer if hasattr(opt, "inner_optimizer") else opt
    elif mixed and not keras3:
      grads = opt.get_unscaled_gradients(grads)
    opt.apply_gradients(zip(grads, [v for _, v in pairs]))
  return model.get_weights()


def _err(a, b):
  return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def test_custom_loop_with_the_loss_scale_optimizer_matches_float32(K, policy,
                                                                  caplog):
  weights = _model(K).get_weights()
  ref = _custom_loop(K, weights, False, None)
  moved = _err(ref, weights)
  policy("mixed_float16")
  scaled = _custom_loop(K, weights, True, "optimizer")
  by_hand = _custom_loop(K, weights, True, 1024.0)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    unscaled = _custom_loop(K, weights, True, None)
  # float16 compute: a few 1e-5 (measured 3.6e-5) against a step of 0.2.
  assert _err(scaled, ref) < 2e-4 < 0.1 * moved
  assert _err(by_hand, ref) < 2e-4
  # Without the scale the clip acts on the scaled gradient: far off, warned.
  assert _err(unscaled, ref) > 1e-3
  ours = [r.message for r in caplog.records if r.name == "graphgrad"]
  assert len(ours) == 1 and "no loss scale" in ours[0]  # once per plan


def test_fit_under_mixed_float16_matches_float32(K, policy):
  x, y = _data()
  weights = _model(K).get_weights()

  def fit():
    model = _model(K)
    model.set_weights(weights)
    _declare(model).attach()
    model.compile(K.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model

  ref = fit().get_weights()
  policy("mixed_float16")
  model = fit()
  assert "LossScaleOptimizer" in type(model.optimizer).__name__
  assert _err(model.get_weights(), ref) < 2e-4


def test_non_finite_step_is_skipped_by_the_optimizer(K, policy):
  policy("mixed_float16")
  model = _model(K)
  plan = _declare(model)
  opt = K.mixed_precision.LossScaleOptimizer(K.optimizers.SGD(0.1))
  keras3 = hasattr(opt, "scale_loss")
  before = model.get_weights()
  x, y = _data()
  with plan.tape(loss_scale=opt) as tape:
    loss = tf.reduce_mean(tf.square(model(x[:BATCH]) - y[:BATCH])) * 1e30
    target = opt.scale_loss(loss) if keras3 else opt.get_scaled_loss(loss)
  pairs = tape.grads_and_vars(target)
  grads = [g for g, _ in pairs]
  if not keras3:
    grads = opt.get_unscaled_gradients(grads)
  opt.apply_gradients(zip(grads, [v for _, v in pairs]))
  assert _err(model.get_weights(), before) == 0.0
  scale = opt.dynamic_scale if keras3 else opt.loss_scale
  assert float(np.asarray(scale)) == 2.0 ** 14  # halved from 2 ** 15


def test_loss_scale_errors(K):
  model = _model(K)
  plan = _declare(model)
  with pytest.raises(gg.GraphGradError, match="`loss_scale` must be a "
                     "loss-scale optimizer"):
    plan.tape(loss_scale="2**15")
  with pytest.raises(gg.GraphGradError, match="must be a scalar"):
    plan.tape(loss_scale=tf.ones([2]))
  syn = gg.KerasPlan(_model(K)).replace_backward("l2", gg.backward.synthetic())
  with pytest.raises(gg.GraphGradError, match=r"loss_scale: .*"
                     r"replace_backward\('l2', synthetic\(.*\(not "
                     r"homogeneous\)"):
    syn.tape(loss_scale=128.0)
  # One policy with GradientPlan's: a task combination that does not scale
  # with its input is refused, not warned about.
  drop = gg.KerasPlan(_model(K)).combine_tasks(
      "l1", gg.mtl.nash_mtl())
  with pytest.raises(gg.GraphGradError, match=r"loss_scale: .*"
                     r"combine_tasks\('l1', nash_mtl"):
    drop.tape(loss_scale=128.0)
