"""gg.dp: privacy accounting against dp-accounting called directly."""

import logging
import math

import dp_accounting as dpa
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from keras_cases import FLAVOURS

tf1 = tf.compat.v1


def direct(sigma, q, steps, delta, accountant):
  acc = (dpa.rdp.RdpAccountant() if accountant == "rdp"
         else dpa.pld.PLDAccountant())
  acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)),
              steps)
  return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilon_equals_dp_accounting(accountant):
  # The MNIST setting of TF Privacy's tutorial: 60 epochs of 60000 examples
  # in batches of 256 are ceil(60 * 60000 / 256) = 14063 steps.
  got = gg.dp.epsilon(1.1, 256, 60000, 60, 1e-5, accountant=accountant)
  assert got == pytest.approx(direct(1.1, 256 / 60000, 14063, 1e-5,
                                     accountant), rel=1e-9)
  assert 2.0 < got < 3.1


def test_pld_is_tighter_than_rdp_and_more_noise_is_more_private():
  rdp = gg.dp.epsilon(1.0, 100, 10000, 5, 1e-5)
  pld = gg.dp.epsilon(1.0, 100, 10000, 5, 1e-5, accountant="pld")
  assert pld < rdp
  assert gg.dp.epsilon(2.0, 100, 10000, 5, 1e-5) < rdp


def test_steps_instead_of_epochs_and_neutral_values():
  assert gg.dp.epsilon(1.0, 100, 10000, steps=500) == pytest.approx(
      gg.dp.epsilon(1.0, 100, 10000, epochs=5))
  assert gg.dp.epsilon(1.0, 100, 10000, steps=0) == 0.0
  assert gg.dp.epsilon(0.0, 100, 10000, epochs=1) == math.inf


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_noise_multiplier_round_trips(accountant):
  sigma = gg.dp.noise_multiplier(2.0, 256, 60000, 10, 1e-5,
                                 accountant=accountant)
  eps = gg.dp.epsilon(sigma, 256, 60000, 10, 1e-5, accountant=accountant)
  assert eps <= 2.0 and eps == pytest.approx(2.0, rel=1e-2)
  assert gg.dp.epsilon(0.97 * sigma, 256, 60000, 10, 1e-5,
                       accountant=accountant) > 2.0


@pytest.mark.parametrize("call, match", [
    (lambda: gg.dp.epsilon(1.0, 100, 10000, 1, accountant="gdp"),
     "`accountant` must be 'rdp' or 'pld'"),
    (lambda: gg.dp.epsilon(1.0, 100, 10000), "exactly one of `epochs`"),
    (lambda: gg.dp.epsilon(1.0, 100, 10000, steps=-1), "`steps` must be"),
    (lambda: gg.dp.epsilon(1.0, 100, 10000, epochs=-1), "`epochs` must be"),
    (lambda: gg.dp.epsilon(1.0, 20000, 10000, 1), "`batch_size` must be"),
    (lambda: gg.dp.epsilon(1.0, 10, 0, 1), "`dataset_size` must be"),
    (lambda: gg.dp.epsilon(1.0, 10, 100, 1, delta=1.0), "`delta` must be"),
    (lambda: gg.dp.epsilon(-1.0, 10, 100, 1), "`noise_multiplier` must be"),
    (lambda: gg.dp.noise_multiplier(0.0, 10, 100, 1),
     "`target_epsilon` must be"),
    (lambda: gg.dp.EpsilonHook(1.0, 10, 100, every_n_steps=0),
     "`every_n_steps` must be"),
])
def test_bad_arguments_are_refused(call, match):
  with pytest.raises(gg.GraphGradError, match=match):
    call()


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_keras_callback_reports_epsilon_during_fit(caplog, flavour):
  K = FLAVOURS[flavour]
  model = K.Sequential([K.Input((3,)), K.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
  callback = gg.dp.epsilon_callback(1.2, 16, 64, 1e-3, keras=K)
  with caplog.at_level(logging.INFO, logger="graphgrad"):
    history = model.fit(x, x[:, :1], batch_size=16, epochs=2, verbose=0,
                        callbacks=[callback])
  assert callback.steps == 8
  expected = direct(1.2, 16 / 64, 8, 1e-3, "rdp")
  assert callback.epsilon == pytest.approx(expected)
  assert history.history["epsilon"] == pytest.approx(
      [direct(1.2, 0.25, 4, 1e-3, "rdp"), expected])
  assert any("epsilon" in r.getMessage() for r in caplog.records)


def test_session_hook_reports_epsilon(caplog):
  with tf.Graph().as_default():
    step = tf1.train.get_or_create_global_step()
    x = tf.constant(np.ones((4, 2), np.float32))
    w = tf1.get_variable("w", initializer=np.ones((2, 1), np.float32))
    loss = tf.reduce_sum(tf.matmul(x, w), axis=1)
    train = gg.GradientPlan(loss).privatize(1.0, 1.0).apply_gradients(
        tf1.train.GradientDescentOptimizer(0.1), global_step=step)
    hook = gg.dp.EpsilonHook(1.0, 4, 400, 1e-5, every_n_steps=5)
    with caplog.at_level(logging.INFO, logger="graphgrad"):
      with tf1.train.MonitoredTrainingSession(hooks=[hook]) as s:
        for _ in range(12):
          s.run(train)
  assert hook.steps == 12
  assert hook.epsilon == pytest.approx(direct(1.0, 0.01, 12, 1e-5, "rdp"))
  logged = [r.getMessage() for r in caplog.records if "epsilon" in
            r.getMessage()]
  assert len(logged) == 2 and logged[0].startswith("graphgrad dp: 5 steps")


def test_session_hook_needs_a_global_step():
  with tf.Graph().as_default():
    hook = gg.dp.EpsilonHook(1.0, 4, 400)
    with pytest.raises(gg.GraphGradError, match="no global step"):
      hook.begin()
