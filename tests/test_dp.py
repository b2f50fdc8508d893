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
  # in batches of 256 are 60 * ceil(60000 / 256) = 14100 steps, as fit
  # takes them (the last batch of each epoch partial).
  got = gg.dp.epsilon(1.1, 256, 60000, 60, 1e-5, accountant=accountant)
  assert got == pytest.approx(direct(1.1, 256 / 60000, 14100, 1e-5,
                                     accountant), rel=1e-9)
  assert 2.0 < got < 3.1


def test_pld_is_tighter_than_rdp_and_more_noise_is_more_private():
  rdp = gg.dp.epsilon(1.0, 100, 10000, 5, 1e-5)
  pld = gg.dp.epsilon(1.0, 100, 10000, 5, 1e-5, accountant="pld")
  assert pld < rdp
  assert gg.dp.epsilon(2.0, 100, 10000, 5, 1e-5) < rdp


def test_epochs_count_the_steps_fit_takes_with_a_partial_batch():
  # 35 examples in batches of 16: 3 batches an epoch (16, 16, 3), 2 when
  # the remainder is dropped; not ceil(4 * 35 / 16) = 9 steps, which would
  # report 8.89 instead of 10.23.
  assert gg.dp.epsilon(1.1, 16, 35, epochs=4) == pytest.approx(
      direct(1.1, 16 / 35, 12, 1e-5, "rdp"), rel=1e-9)
  assert gg.dp.epsilon(1.1, 16, 35, epochs=4) > direct(
      1.1, 16 / 35, 9, 1e-5, "rdp") + 1.0
  assert gg.dp.epsilon(1.1, 16, 35, epochs=4, drop_remainder=True) == (
      pytest.approx(direct(1.1, 16 / 35, 8, 1e-5, "rdp"), rel=1e-9))
  # half an epoch of 3 batches is 2 steps, rounded up
  assert gg.dp.epsilon(1.1, 16, 35, epochs=0.5) == pytest.approx(
      direct(1.1, 16 / 35, 2, 1e-5, "rdp"), rel=1e-9)
  sigma = gg.dp.noise_multiplier(3.0, 16, 35, epochs=4)
  assert gg.dp.epsilon(sigma, 16, 35, steps=12) <= 3.0


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("drop", [False, True])
def test_callback_and_epsilon_count_the_same_steps_of_fit(flavour, drop):
  K = FLAVOURS[flavour]
  model = K.Sequential([K.Input((3,)), K.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  x = np.random.default_rng(0).normal(size=(35, 3)).astype(np.float32)
  ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(
      16, drop_remainder=drop)
  callback = gg.dp.epsilon_callback(1.1, 16, 35, keras=K)
  model.fit(ds, epochs=4, verbose=0, callbacks=[callback])
  steps = 8 if drop else 12
  assert callback.steps == steps
  expected = direct(1.1, 16 / 35, steps, 1e-5, "rdp")
  assert callback.epsilon == pytest.approx(expected, rel=1e-9)
  assert gg.dp.epsilon(1.1, 16, 35, epochs=4, drop_remainder=drop) == (
      pytest.approx(expected, rel=1e-9))


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
    (lambda: gg.dp.epsilon(1.0, 100, 10000, 1, drop_remainder=1),
     "`drop_remainder` must be a bool"),
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


# -- Poisson sampling ----------------------------------------------------------


def test_poisson_batches_sample_each_example_independently_with_rate_q():
  n, b, steps = 400, 40, 600
  sampling = gg.dp.PoissonSampling(n, b, seed=11)
  assert sampling.sampling_rate == 0.1 and sampling.steps_per_epoch == 10
  x = np.arange(n, dtype=np.int64)
  y = x * 3  # labels stay with their examples
  counts = np.zeros(n)
  sizes = []
  for bx, by in sampling.batches((x, y), epochs=steps / 10):
    bx, by = bx.numpy(), by.numpy()
    np.testing.assert_array_equal(by, bx * 3)
    assert len(set(bx)) == len(bx)  # without replacement within a batch
    counts[bx] += 1
    sizes.append(len(bx))
  q = b / n
  assert len(sizes) == steps
  # A batch's size is Binomial(n, q): mean n q, variance n q (1 - q).
  assert abs(np.mean(sizes) - n * q) < 4 * np.sqrt(n * q * (1 - q) / steps)
  assert abs(np.var(sizes) / (n * q * (1 - q)) - 1) < 0.2
  # Each example joins Binomial(steps, q) batches, independently of the rest.
  assert abs(counts.mean() - steps * q) < 4 * np.sqrt(steps * q / n)
  assert abs(counts.var() / (steps * q * (1 - q)) - 1) < 0.25


def test_poisson_batches_differ_by_key_and_repeat_by_seed():
  x = np.arange(100, dtype=np.float32)

  def first(sampling):
    return [b.numpy().tolist() for b in sampling.batches(x).take(3)]

  assert first(gg.dp.PoissonSampling(100, 10, seed=1)) == first(
      gg.dp.PoissonSampling(100, 10, seed=1))
  assert first(gg.dp.PoissonSampling(100, 10)) != first(
      gg.dp.PoissonSampling(100, 10))
  assert len(first(gg.dp.PoissonSampling(100, 10, seed=1))) == 3  # endless


def test_poisson_sampling_epsilon_is_dp_accounting_of_its_rate():
  sampling = gg.dp.PoissonSampling(60000, 256)
  acc = dpa.rdp.RdpAccountant()
  acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(
      256 / 60000, dpa.GaussianDpEvent(1.1)), 470))  # 2 * ceil(60000 / 256)
  assert sampling.epsilon(1.1, epochs=2) == pytest.approx(
      acc.get_epsilon(1e-5), rel=1e-9)
  assert len(list(gg.dp.PoissonSampling(100, 30, seed=0).batches(
      np.zeros(100, np.float32), epochs=2))) == 8  # the steps counted


@pytest.mark.parametrize("kwargs, match", [
    # the argument by the name it was passed under, not epsilon's batch_size
    (dict(dataset_size=10, expected_batch_size=20),
     r"PoissonSampling: `expected_batch_size` must be an int from 1 to "
     r"dataset_size \(10\), .*got 20\."),
    (dict(dataset_size=10, expected_batch_size=2.5),
     r"`expected_batch_size` must be an int .*got 2\.5\."),
    (dict(dataset_size=0, expected_batch_size=1), "`dataset_size` must be"),
    (dict(dataset_size=10, expected_batch_size=2, seed="1"),
     "`seed` must be an int"),
])
def test_poisson_sampling_refuses_bad_arguments(kwargs, match):
  with pytest.raises(gg.GraphGradError, match=match):
    gg.dp.PoissonSampling(**kwargs)
  with pytest.raises(gg.GraphGradError, match="must have dataset_size"):
    gg.dp.PoissonSampling(10, 2).batches(np.zeros([9, 2]))


def test_private_training_on_poisson_batches_divides_by_the_expected_size():
  # Clipped sums over a Poisson batch, the empty one included, divided by
  # the expected batch size: numpy per-example reference.
  rng = np.random.default_rng(0)
  n, b, clip = 50, 5, 0.5
  x = rng.normal(size=(n, 3)).astype(np.float32)
  w0 = rng.normal(size=(3, 1)).astype(np.float32)
  K = tf.keras
  model = K.Sequential([K.Input((3,)), K.layers.Dense(
      1, use_bias=False, kernel_initializer=K.initializers.Constant(w0))])
  sampling = gg.dp.PoissonSampling(n, b, seed=2)
  plan = gg.KerasPlan(model).privatize(
      clip, 0.0, expected_batch_size=sampling.expected_batch_size)
  for batch in sampling.batches(x, epochs=3):
    with plan.tape() as tape:
      loss = tf.reduce_sum(tf.square(model(batch)), axis=1)
    (g,) = tape.gradient(loss)
    xb = batch.numpy()
    per = [2 * (r @ w0) * r for r in xb]  # d (r w)^2 / dw
    ref = sum((p * min(1.0, clip / np.linalg.norm(p)) for p in per),
              np.zeros(3)) / b
    np.testing.assert_allclose(tf.convert_to_tensor(g).numpy().ravel(), ref,
                               rtol=1e-5, atol=1e-7)
  assert len(list(sampling.batches(x, epochs=3))) == 30
  # An empty batch (probability 0.9^50 here) gives the noise alone: zero.
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(tf.zeros([0, 3]))), axis=1)
  (g,) = tape.gradient(loss)
  np.testing.assert_array_equal(tf.convert_to_tensor(g).numpy(),
                                np.zeros((3, 1)))
