"""KerasPlan.privatize: DP-SGD against per-example references, and parity.

Each reference takes one ``tf.GradientTape`` per example (the model called
on that example alone), clips over all variables together in numpy, sums
and divides by the batch size.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from keras_cases import is_keras3
from tests.helpers import clipped_mean_reference

tf1 = tf.compat.v1
B = 6


def normal(*shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def reference(model, loss_fn, x, clip):
  return clipped_mean_reference(lambda i: loss_fn(model(x[i:i + 1]))[0],
                                model.trainable_variables, B, clip)


def private(model, loss_fn, x, clip, function=False, **kw):
  plan = gg.KerasPlan(model).privatize(clip, 0.0, **kw)

  def step(x):
    with plan.tape() as tape:
      loss = loss_fn(model(x))
    return tape.gradient(loss)

  if function:
    step = tf.function(step)
  return [tf.convert_to_tensor(g).numpy() for g in step(tf.constant(x))]


def check(model, loss_fn, x, function=False):
  _, norms = reference(model, loss_fn, x, 1.0)
  clip = float(np.median(norms))
  expected, norms = reference(model, loss_fn, x, clip)
  assert (norms > clip).any() and (norms < clip).any()
  got = private(model, loss_fn, x, clip, function)
  for g, e in zip(got, expected):
    # float32 sums: an entry far below the largest one (|e| up to ~40 for a
    # layer norm's scale) carries that one's rounding, 1e-7 of it per term.
    np.testing.assert_allclose(g, e, rtol=1e-5,
                               atol=max(1e-6, 1e-6 * np.abs(e).max()))
  return got


def square_sum(y):
  return tf.reduce_sum(tf.square(tf.reshape(y, [tf.shape(y)[0], -1])), axis=1)


@pytest.mark.parametrize("function", [False, True])
def test_dense_mlp(K, function):
  model = K.Sequential([K.Input((5,)), K.layers.Dense(8, activation="relu"),
                        K.layers.Dense(8, activation="tanh"),
                        K.layers.Dense(3)])
  check(model, square_sum, normal(B, 5), function)


def test_dense_on_sequences_and_layer_norm(K):
  model = K.Sequential([K.Input((4, 3)), K.layers.Dense(5, activation="tanh"),
                        K.layers.LayerNormalization(),
                        K.layers.Dense(2)])
  model.layers[1].gamma.assign(normal(5, seed=3) + 1)
  model.layers[1].beta.assign(normal(5, seed=4))
  check(model, square_sum, normal(B, 4, 3))


def test_conv_net(K):
  model = K.Sequential([
      K.Input((8, 8, 2)), K.layers.Conv2D(4, 3, padding="same",
                                         activation="relu"),
      K.layers.Conv2D(3, 2, strides=2), K.layers.Flatten(),
      K.layers.Dense(2)])
  check(model, square_sum, normal(B, 8, 8, 2))


def test_embedding_with_repeated_ids(K):
  model = K.Sequential([K.Input((3,), dtype="int32"),
                        K.layers.Embedding(5, 4), K.layers.Flatten(),
                        K.layers.Dense(2, activation="tanh")])
  ids = np.array([[1, 1, 2], [0, 3, 3], [4, 4, 4], [2, 0, 1], [3, 3, 1],
                  [0, 0, 0]], np.int32)
  check(model, lambda y: tf.reduce_sum(y, axis=1), ids)


def test_layer_without_rule_is_exact_through_its_own_call(caplog):
  K = tf.keras

  class Scale(K.layers.Layer):
    def build(self, shape):
      self.w = self.add_weight(name="w", shape=(shape[-1],),
                               initializer="ones")

    def call(self, x):
      return tf.sin(x * self.w)

  model = K.Sequential([K.Input((4,)), K.layers.Dense(4), Scale(),
                        K.layers.Dense(1)])
  model.layers[1].w.assign(normal(4, seed=5))
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    check(model, square_sum, normal(B, 4))
  assert any("no norm rule for Scale layers" in r.getMessage()
             for r in caplog.records)


def test_scalar_loss_and_batch_norm_are_refused(K):
  model = K.Sequential([K.Input((3,)), K.layers.Dense(2)])
  plan = gg.KerasPlan(model).privatize(1.0, 1.0)
  with plan.tape() as tape:
    loss = tf.reduce_sum(model(tf.ones([2, 3])))
  with pytest.raises(gg.GraphGradError, match=r"shape \[batch\]"):
    tape.gradient(loss)
  bn = K.Sequential([K.Input((3,)), K.layers.Dense(2),
                     K.layers.BatchNormalization()])
  plan = gg.KerasPlan(bn).privatize(1.0, 1.0)
  with pytest.raises(gg.UnsupportedGraphError,
                     match="BatchNormalization layer .* whole batch"):
    with plan.tape():
      pass


def test_declarations_before_the_clip_are_refused(K):
  model = K.Sequential([K.Input((3,)), K.layers.Dense(2, name="a"),
                        K.layers.Dense(2, name="b")])
  plan = (gg.KerasPlan(model).privatize(1.0, 1.0)
          .transform_upstream("b", gg.transforms.clip_by_norm(1.0)))
  with pytest.raises(gg.GraphGradError,
                     match="cannot be combined with upstream declarations"):
    plan.tape()
  with pytest.raises(gg.GraphGradError, match="already private"):
    plan.privatize(1.0, 1.0)
  used = gg.KerasPlan(model)
  used.tape()
  with pytest.raises(gg.GraphGradError, match="already in use"):
    used.privatize(1.0, 1.0)


def test_noise_std_and_steps_differ():
  K = tf.keras
  model = K.Sequential([K.Input((256,)), K.layers.Dense(
      256, use_bias=False, kernel_initializer="zeros")])
  clip, sigma = 2.0, 1.5
  plan = gg.KerasPlan(model).privatize(clip, sigma)
  x = tf.constant(normal(B, 256))
  draws = []
  for _ in range(2):
    with plan.tape() as tape:
      loss = tf.reduce_sum(model(x), axis=1)
    draws.append(tape.gradient(loss)[0].numpy())
  expected, _ = reference(model, lambda y: tf.reduce_sum(y, axis=1),
                          x.numpy(), clip)
  for d in draws:
    noise = d - expected[0]
    np.testing.assert_allclose(noise.std(), sigma * clip / B, rtol=0.05)
  assert not np.allclose(draws[0], draws[1])


def test_parity_with_gradient_plan():
  K = tf.keras
  model = K.Sequential([K.Input((5,)), K.layers.Dense(6, activation="tanh"),
                        K.layers.Dense(2)])
  x = normal(B, 5)
  clip = 0.3
  with plan_tape(model, clip) as (plan, tape):
    loss = square_sum(model(tf.constant(x)))
  keras_grads = [g.numpy() for g in tape.gradient(loss)]
  weights = [w.numpy() for w in model.trainable_variables]
  with tf.Graph().as_default():
    xs = tf.constant(x)
    w = [tf1.get_variable(f"w{i}", initializer=v)
         for i, v in enumerate(weights)]
    out = tf.matmul(tf.tanh(tf.matmul(xs, w[0]) + w[1]), w[2]) + w[3]
    gv = gg.GradientPlan(square_sum(out)).privatize(
        clip, 0.0).compute_gradients()
    with tf1.Session() as s:
      s.run(tf1.global_variables_initializer())
      tf1_grads = s.run([g for g, _ in gv])
  for a, b in zip(keras_grads, tf1_grads):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class plan_tape:
  def __init__(self, model, clip):
    self.plan = gg.KerasPlan(model).privatize(clip, 0.0)

  def __enter__(self):
    self.tape = self.plan.tape().__enter__()
    return self.plan, self.tape

  def __exit__(self, *exc):
    return self.tape.__exit__(*exc)


def test_the_clip_is_over_the_sources_asked_for(K):
  """The released gradient is clipped over the given sources alone, as a
  GradientPlan's over its var_list: the reference clips over the first
  layer's variables only."""
  model = K.Sequential([K.Input((5,)), K.layers.Dense(4, activation="tanh"),
                        K.layers.Dense(2)])
  x = normal(B, 5, seed=3)
  sources = list(model.layers[0].trainable_variables)
  per = []
  for i in range(B):
    with tf.GradientTape() as t:
      loss = square_sum(model(x[i:i + 1]))[0]
    per.append([g.numpy().astype(np.float64)
                for g in t.gradient(loss, sources)])
  norms = np.array([np.sqrt(sum(np.sum(g * g) for g in p)) for p in per])
  clip = float(np.median(norms))
  expected = [sum(min(1.0, clip / n) * p[j] for n, p in zip(norms, per)) / B
              for j in range(len(sources))]
  plan = gg.KerasPlan(model).privatize(clip, 0.0)
  with plan.tape() as tape:
    loss = square_sum(model(tf.constant(x)))
  got = tape.gradient(loss, sources)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g.numpy(), e, rtol=1e-5, atol=1e-6)


def test_a_variable_outside_every_layer_is_refused_and_unreached_is_none(K):
  model = K.Sequential([K.Input((3,)), K.layers.Dense(2)])
  outside = tf.Variable(np.ones([2], np.float32))
  unused = tf.Variable(np.ones([2], np.float32))
  plan = gg.KerasPlan(model).privatize(1.0, 0.0)
  x = tf.constant(normal(B, 3))
  with plan.tape() as tape:
    loss = square_sum(model(x) * outside)
  with pytest.raises(gg.UnsupportedGraphError,
                     match="other than through the call of a layer"):
    tape.gradient(loss, model.trainable_variables + [outside])
  with plan.tape() as tape:
    loss = square_sum(model(x))
  grads = tape.gradient(loss, model.trainable_variables + [unused])
  assert grads[-1] is None and all(g is not None for g in grads[:-1])
  with plan.tape() as tape:
    loss = square_sum(model(x))
  zero = tape.gradient(loss, [unused],
                       unconnected_gradients=tf.UnconnectedGradients.ZERO)
  np.testing.assert_array_equal(zero[0].numpy(), np.zeros(2))


def test_expected_batch_size_divides_the_sum(K):
  model = K.Sequential([K.Input((5,)), K.layers.Dense(3, activation="tanh"),
                        K.layers.Dense(2)])
  x = normal(B, 5, seed=4)
  expected, _ = reference(model, square_sum, x, 0.3)
  got = private(model, square_sum, x, 0.3, expected_batch_size=10.0)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e * B / 10.0, rtol=1e-5, atol=1e-6)


# -- model.fit -----------------------------------------------------------------


def _fit_reference(weights, x, y, w, clip, lr, batch):
  """SGD on (1/B) sum_i clip_C(grad l_i), one GradientTape per example:
  l_i = w_i * mean over outputs of (pred - y)^2, a tanh layer then a
  linear one."""
  weights = [v.astype(np.float64) for v in weights]
  for start in range(0, len(x), batch):
    total = [np.zeros_like(v) for v in weights]
    for i in range(start, start + batch):
      vs = [tf.Variable(v) for v in weights]
      with tf.GradientTape() as t:
        h = tf.tanh(x[i:i + 1].astype(np.float64) @ vs[0] + vs[1])
        pred = h @ vs[2] + vs[3]
        loss = w[i] * tf.reduce_mean(tf.square(pred - y[i:i + 1]))
      grads = [g.numpy() for g in t.gradient(loss, vs)]
      norm = np.sqrt(sum(np.sum(g * g) for g in grads))
      c = min(1.0, clip / norm)
      total = [a + c * g for a, g in zip(total, grads)]
    weights = [v - lr * a / batch for v, a in zip(weights, total)]
  return weights


@pytest.mark.parametrize("steps_per_execution, jit_compile",
                         [(1, False), (2, False), (1, True)])
def test_fit_equals_the_per_example_clipping_reference(
    K, steps_per_execution, jit_compile, caplog):
  n, batch, clip, lr = 12, 4, 0.4, 0.5
  x, y = normal(n, 3, seed=1), normal(n, 2, seed=2)
  w = np.linspace(0.5, 1.5, n).astype(np.float32)  # sample weights
  model = K.Sequential([K.Input((3,)), K.layers.Dense(5, activation="tanh"),
                        K.layers.Dense(2)])
  start = [v.numpy() for v in model.trainable_variables]
  model.compile(optimizer=K.optimizers.SGD(lr), loss="mse",
                metrics=["mae"], steps_per_execution=steps_per_execution,
                jit_compile=jit_compile)
  gg.KerasPlan(model).privatize(clip, 0.0).attach()
  callback = gg.dp.epsilon_callback(1.0, batch, n, keras=_keras_of(K))
  with caplog.at_level(logging.INFO, logger="graphgrad"):
    history = model.fit(x, y, sample_weight=w, batch_size=batch, epochs=1,
                        shuffle=False, verbose=0, callbacks=[callback])
  expected = _fit_reference(start, x, y, w, clip, lr, batch)
  for v, e in zip(model.trainable_variables, expected):
    np.testing.assert_allclose(v.numpy(), e, rtol=1e-5, atol=1e-6)
  assert {"loss", "mae", "epsilon"} <= set(history.history)
  assert history.history["epsilon"][0] == pytest.approx(
      gg.dp.epsilon(1.0, batch, n, steps=n // batch))


def test_fit_refuses_losses_that_are_not_per_example(K):
  model = K.Sequential([K.Input((3,)), K.layers.Dense(
      2, kernel_regularizer=K.regularizers.l2(0.1))])
  model.compile(optimizer=K.optimizers.SGD(0.1), loss="mse")
  gg.KerasPlan(model).privatize(1.0, 0.0).attach()
  with pytest.raises(gg.GraphGradError, match="adds losses .* not per "
                     "example"):
    model.fit(normal(4, 3), normal(4, 2), batch_size=4, verbose=0)


def _keras_of(K):
  """The module whose callbacks a flavour's fit takes."""
  if K.__name__.startswith("keras"):
    import keras  # pylint: disable=g-import-not-at-top
    return keras
  return K


@pytest.mark.parametrize("function", [False, True])
def test_a_layer_that_centers_over_the_batch_is_refused(K, function):
  class Center(K.layers.Layer):
    def call(self, x):
      return x - tf.reduce_mean(x, axis=0)

  model = K.Sequential([K.Input((3,)), K.layers.Dense(4), Center(),
                        K.layers.Dense(1)])
  plan = gg.KerasPlan(model).privatize(1.0, 0.0)

  def step(x):
    with plan.tape() as tape:
      loss = square_sum(model(x))
    return tape.gradient(loss)

  if function:
    step = tf.function(step)
  for _ in range(2):  # refused at every step, not only the first
    with pytest.raises(gg.UnsupportedGraphError,
                       match=r"privatize: the Mean op .*reads values of "
                             r"several examples"):
      step(tf.constant(normal(B, 3)))


def _mean_over_batch(y_true, y_pred):
  return tf.reduce_mean(tf.square(y_true - y_pred))


def _mean_per_example(y_true, y_pred):
  return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1)


def test_fit_refuses_a_compiled_loss_reduced_over_the_batch(K):
  n, clip, lr = 4, 0.4, 0.5
  x, y = normal(n, 3, seed=1), normal(n, 2, seed=2)
  model = K.Sequential([K.Input((3,)), K.layers.Dense(5, activation="tanh"),
                        K.layers.Dense(2)])
  start = [v.numpy() for v in model.trainable_variables]
  model.compile(optimizer=K.optimizers.SGD(lr), loss=_mean_over_batch)
  gg.KerasPlan(model).privatize(clip, 0.0).attach()
  with pytest.raises(gg.GraphGradError,
                     match=r"model.fit with privatize on .*: privatize clips "
                           r"each example's gradient.*compile\(loss=<function "
                           r"_mean_over_batch.*\); a compiled loss gave shape "
                           r"\(\), not one value per example\. Compile a loss "
                           r"that keeps the batch axis"):
    model.fit(x, y, batch_size=n, verbose=0)
  # The fix the message gives: the same loss, reduced over axis -1 only.
  model.compile(optimizer=K.optimizers.SGD(lr), loss=_mean_per_example)
  model.fit(x, y, batch_size=n, shuffle=False, verbose=0)
  expected = _fit_reference(start, x, y, np.ones(n), clip, lr, n)
  for v, e in zip(model.trainable_variables, expected):
    np.testing.assert_allclose(v.numpy(), e, rtol=1e-5, atol=1e-6)


def test_fit_refuses_when_no_output_has_a_loss_and_targets(K):
  x, y = normal(4, 3), normal(4, 2, seed=1)
  inputs = K.Input((3,))
  model = K.Model(inputs, {"a": K.layers.Dense(2, name="a")(inputs),
                           "b": K.layers.Dense(2, name="b")(inputs)})
  model.compile(optimizer=K.optimizers.SGD(0.1), loss={"a": "mse"})
  gg.KerasPlan(model).privatize(1.0, 0.0).attach()
  with pytest.raises(gg.GraphGradError,
                     match=r"model.fit with privatize on .*; no output has "
                           r"both a compiled loss and targets \(fit got "
                           r"targets for \['b'\]\)\. Pass fit\(\) the "
                           r"targets"):
    model.fit(x, {"b": y}, batch_size=4, verbose=0)


def test_fit_without_targets_is_refused_by_privatize_or_keras(K):
  model = K.Sequential([K.Input((3,)), K.layers.Dense(2)])
  model.compile(optimizer=K.optimizers.SGD(0.1), loss="mse")
  gg.KerasPlan(model).privatize(1.0, 0.0).attach()
  if not is_keras3(K):  # Keras 2's compiled loss skips no y
    with pytest.raises(gg.GraphGradError,
                       match=r"no output has both a compiled loss and "
                             r"targets \(fit got no targets\)"):
      model.fit(normal(4, 3), batch_size=4, verbose=0)
  else:  # Keras 3's compute_loss refuses y=None before the plan's loss
    with pytest.raises(ValueError, match="None values not supported"):
      model.fit(normal(4, 3), batch_size=4, verbose=0)


def test_fit_names_privatize_when_the_loss_structure_is_refused(K):
  inputs = K.Input((3,))
  model = K.Model(inputs, [K.layers.Dense(2)(inputs),
                           K.layers.Dense(2)(inputs)])
  model.compile(optimizer=K.optimizers.SGD(0.1), loss=[["mse"], "mse"])
  gg.KerasPlan(model).privatize(1.0, 0.0).attach()
  with pytest.raises(gg.GraphGradError,
                     match=r"model.fit with privatize: compile\(loss=\.\.\.\) "
                           r"of .* must give one loss per model output.*a "
                           r"nested structure"):
    model.fit(normal(4, 3), [normal(4, 2), normal(4, 2)], batch_size=4,
              verbose=0)


# -- the divisor of the noised sum: fit's batch size, not the realized one ----

def _kernel_steps(K, fit, width=100):
  """The kernel's change at each step of ``fit(model)``, from a model whose
  kernel gets no gradient (zero inputs): the change is the noise over B
  times the learning rate 1."""
  model = K.Sequential([K.Input((width,)), K.layers.Dense(width)])
  model.compile(optimizer=K.optimizers.SGD(1.0), loss="mse")
  kernels = [model.layers[-1].kernel.numpy().copy()]

  class Record(_keras_of(K).callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      kernels.append(model.layers[-1].kernel.numpy().copy())

  fit(model, Record())
  return [a - b for a, b in zip(kernels[:-1], kernels[1:])]


@pytest.mark.parametrize("declared", [None, 64])
def test_fit_divides_a_partial_batch_by_the_batch_size(K, declared):
  # 67 examples in batches of 64: the second batch holds 3. Its noise
  # must be sigma C / 64 as the first one's, not sigma C / 3 (21x).
  sigma, clip, n, batch = 1.5, 2.0, 67, 64
  x, y = np.zeros((n, 100), np.float32), normal(n, 100)

  def fit(model, record):
    gg.KerasPlan(model).privatize(clip, sigma,
                                  expected_batch_size=declared).attach()
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[record])

  steps = _kernel_steps(K, fit)
  assert len(steps) == 2
  for step in steps:  # 10,000 draws: the std within 3%
    assert np.std(step) == pytest.approx(sigma * clip / batch, rel=0.03)


def test_fit_on_a_dataset_divides_by_its_batch_size_or_refuses(K):
  sigma, clip = 1.0, 1.0
  x, y = np.zeros((35, 100), np.float32), normal(35, 100)
  data = tf.data.Dataset.from_tensor_slices((x, y))

  def fit(model, record, drop=True):
    gg.KerasPlan(model).privatize(clip, sigma).attach()
    model.fit(data.batch(16, drop_remainder=drop), epochs=1, verbose=0,
              callbacks=[record])

  steps = _kernel_steps(K, fit)
  assert len(steps) == 2
  assert np.std(steps[1]) == pytest.approx(sigma * clip / 16, rel=0.03)
  with pytest.raises(gg.GraphGradError, match=r"batch size B, the same for "
                     r"every batch .* given a tf.data.Dataset whose batch "
                     r"size .* expected_batch_size=B"):
    _kernel_steps(K, lambda model, record: fit(model, record, False))


def test_tape_batch_size_is_the_divisor_of_a_smaller_batch():
  sigma, clip, batch = 1.0, 1.0, 64
  model = tf.keras.Sequential([tf.keras.Input((100,)),
                               tf.keras.layers.Dense(100)])
  plan = gg.KerasPlan(model).privatize(clip, sigma)
  with plan.tape(batch_size=batch) as tape:
    loss = tf.reduce_sum(tf.square(model(tf.zeros([3, 100]))), axis=1)
  kernel = tape.gradient(loss)[0].numpy()
  assert np.std(kernel) == pytest.approx(sigma * clip / batch, rel=0.03)
  with plan.tape() as tape:  # without it: the realized size, 3
    loss = tf.reduce_sum(tf.square(model(tf.zeros([3, 100]))), axis=1)
  kernel = tape.gradient(loss)[0].numpy()
  assert np.std(kernel) == pytest.approx(sigma * clip / 3, rel=0.03)
  for bad in (0, -1.0, float("inf"), True, "64"):
    with pytest.raises(gg.GraphGradError, match=r"KerasPlan.tape: "
                       r"`batch_size` must be a positive finite number"):
      plan.tape(batch_size=bad)


# -- norms that cannot overflow ------------------------------------------------

def _scaled_batch():
  """Inputs and output weights of four examples: one of scale 1e11 (its
  kernel gradient's entries near 1e22, whose squares overflow float32),
  one of scale 1e-15 (entries near 1e-30, whose squares underflow)."""
  x, t = normal(4, 3, seed=3), normal(4, 2, seed=4)
  x[1] *= 1e11
  t[1] *= 1e11
  x[2] *= 1e-15
  t[2] *= 1e-15
  return x, t


def _dense_reference(x, t, clip):
  """(1/B) sum_i clip_C(grad l_i) of ``l_i = (x_i W + b) . t_i`` in float64:
  the kernel's gradient is ``x_i t_i^T``, the bias' ``t_i``."""
  x, t = x.astype(np.float64), t.astype(np.float64)
  kernel, bias = np.zeros((x.shape[1], t.shape[1])), np.zeros(t.shape[1])
  for xi, ti in zip(x, t):
    gk, gb = np.outer(xi, ti), ti
    c = min(1.0, clip / np.sqrt(np.sum(gk * gk) + np.sum(gb * gb)))
    kernel, bias = kernel + c * gk, bias + c * gb
  return kernel / len(x), bias / len(x)


@pytest.mark.parametrize("function", [False, True])
def test_an_example_of_any_finite_scale_is_clipped_to_c(K, function):
  x, t = _scaled_batch()
  model = K.Sequential([K.Input((3,)), K.layers.Dense(2)])
  plan = gg.KerasPlan(model).privatize(0.5, 0.0)

  def step(x, t):
    with plan.tape() as tape:
      loss = tf.reduce_sum(model(x) * t, axis=1)
    return tape.gradient(loss)

  if function:
    step = tf.function(step)
  for rows in ([0, 1, 2, 3], [1], [2]):
    got = [g.numpy() for g in step(tf.constant(x[rows]), tf.constant(t[rows]))]
    for g, e in zip(got, _dense_reference(x[rows], t[rows], 0.5)):
      np.testing.assert_allclose(g, e, rtol=1e-5, atol=0)
    if rows == [1]:  # the 1e22 example alone: a gradient of norm C exactly
      norm = np.sqrt(sum(np.sum(np.square(g.astype(np.float64)))
                         for g in got))
      assert norm == pytest.approx(0.5, rel=1e-5)
  x[3, 0] = np.nan  # one NaN example: every gradient NaN, nothing dropped
  for g in step(tf.constant(x), tf.constant(t)):
    assert np.isnan(g.numpy()).all()


def test_a_run_resumed_from_a_checkpoint_draws_new_noise(tmp_path):
  """With a seed, three steps in one run give the weights of two steps, a
  checkpoint of the model, optimizer and plan, and one step of new objects
  restored from it: the restored plan counts on from step 2 instead of
  drawing step 1's noise again (which it did before the plan tracked its
  noise counter)."""
  K = tf.keras
  x, t = normal(B, 4), normal(B, 2, seed=1)

  def run(steps, restore=None, save=None):
    model = K.Sequential([K.Input((4,)), K.layers.Dense(
        2, kernel_initializer=K.initializers.Constant(0.1))])
    opt = K.optimizers.SGD(0.1)
    plan = gg.KerasPlan(model).privatize(1.0, 1.0, seed=3)
    ckpt = tf.train.Checkpoint(model=model, opt=opt, plan=plan)
    if restore is not None:
      ckpt.restore(restore)
    for _ in range(steps):
      with plan.tape() as tape:
        loss = tf.reduce_sum(tf.square(model(x) - t), axis=1)
      opt.apply_gradients(zip(tape.gradient(loss), model.trainable_variables))
    if save is not None:
      return ckpt.write(save)
    return [v.numpy() for v in model.trainable_variables]

  straight = run(3)
  path = run(2, save=str(tmp_path / "ckpt"))
  resumed = run(1, restore=path)
  for a, b in zip(resumed, straight):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class _Stop(Exception):
  pass


def test_fit_resumed_by_backup_and_restore_draws_new_noise(K, tmp_path):
  """As the checkpoint test, through fit: an interrupted private fit with
  ``BackupAndRestore``, run again, ends where the uninterrupted one does."""
  x, y = normal(12, 3, seed=1), normal(12, 2, seed=2)
  start = None

  def fit(callbacks):
    nonlocal start
    model = K.Sequential([K.Input((3,)), K.layers.Dense(5, activation="tanh"),
                          K.layers.Dense(2)])
    if start is None:
      start = model.get_weights()
    model.set_weights(start)
    model.compile(optimizer=K.optimizers.SGD(0.5), loss="mse")
    plan = gg.KerasPlan(model).privatize(0.4, 1.0, seed=5).attach()
    model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0,
              callbacks=callbacks)
    return model, plan

  whole, plan = fit([])
  assert int(plan.noise_step.numpy()) == 9

  class Stop(K.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
      if epoch == 1:
        raise _Stop()

  backup = str(tmp_path / "backup")
  with pytest.raises(_Stop):
    fit([K.callbacks.BackupAndRestore(backup), Stop()])
  resumed, plan = fit([K.callbacks.BackupAndRestore(backup)])
  assert int(plan.noise_step.numpy()) == 9
  for a, b in zip(resumed.get_weights(), whole.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
