"""KerasPlan.privatize layer by layer: each Keras layer that holds variables
is exact against a per-example reference.

The reference takes one ``tf.GradientTape`` per example (the model called on
that example's rows of every input), clips over all variables in numpy,
sums and divides by the batch size. Recurrent layers, wrappers and custom
layers with several inputs or nested outputs go through the exact
per-example fallback; the others through their norm rules.
"""

import itertools
import logging

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from tests.helpers import clipped_mean_reference

B = 5


@pytest.fixture(autouse=True)
def seeded(K):
  """The same initial weights whatever ran before on the worker."""
  K.utils.set_random_seed(0)


def normal(*shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def square_sum(y):
  return tf.reduce_sum(tf.square(tf.reshape(y, [tf.shape(y)[0], -1])), axis=1)


def _one(xs):
  """A model's inputs: one tensor, or a list of several."""
  return xs[0] if len(xs) == 1 else list(xs)


def reference(model, xs, clip):
  """The clipped mean of per-example gradients, and the per-example norms."""
  return clipped_mean_reference(
      lambda i: square_sum(model(_one([x[i:i + 1] for x in xs])))[0],
      model.trainable_variables, B, clip)


def check(model, xs, function=False):
  """privatize's gradient of ``model`` on inputs ``xs`` equals the
  reference, with a clip norm that clips some examples and not others."""
  _, norms = reference(model, xs, 1.0)
  clip = float(np.median(norms))
  expected, norms = reference(model, xs, clip)
  assert (norms > clip).any() and (norms < clip).any()
  plan = gg.KerasPlan(model).privatize(clip, 0.0)

  def step(*xs):
    with plan.tape() as tape:
      loss = square_sum(model(_one(xs)))
    return tape.gradient(loss)

  if function:
    step = tf.function(step)
  got = step(*[tf.constant(x) for x in xs])
  assert len(got) == len(expected)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), e,
                               rtol=1e-5,
                               atol=max(1e-6, 1e-6 * np.abs(e).max()))


def _attention(K, x):
  return K.layers.MultiHeadAttention(2, 3)(x, x)


# name: (input shape, layers of Keras module K on a Keras input x).
LAYERS = {
    "Dense": ((3,), lambda K, x: K.layers.Dense(3, "tanh")(x)),
    "EinsumDense": ((4, 3), lambda K, x: K.layers.EinsumDense(
        "btc,cd->btd", (4, 2), bias_axes="d")(x)),
    # Projections onto heads and back, as MultiHeadAttention's, with an
    # activation after the kernel's product: the dense rule.
    "EinsumDense-heads": ((4, 3), lambda K, x: K.layers.EinsumDense(
        "abcd,cde->abe", (4, 2), bias_axes="e", activation="tanh")(
            K.layers.EinsumDense("abc,cde->abde", (4, 2, 3),
                                 bias_axes="de")(x))),
    "EinsumDense-ellipsis": ((4, 3), lambda K, x: K.layers.EinsumDense(
        "...c,cd->...d", 2, bias_axes="d")(x)),
    "Embedding": None,  # integer inputs: test_embedding
    "LayerNormalization": ((4, 3), lambda K, x: K.layers.LayerNormalization(
        beta_initializer="ones")(K.layers.Dense(3)(x))),
    # On centred inputs: Keras 3's variance E[x^2] - E[x]^2 of a batch and
    # of one example differ by its float32 rounding, scaled by E[x]^2.
    "GroupNormalization": ((4, 4), lambda K, x: K.layers.Dense(2)(
        K.layers.GroupNormalization(2, beta_initializer="ones")(x))),
    "MultiHeadAttention": ((3, 4), _attention),
    "Conv1D": ((6, 2), lambda K, x: K.layers.Conv1D(3, 2)(x)),
    "Conv2D": ((5, 5, 2), lambda K, x: K.layers.Conv2D(3, 2)(x)),
    "Conv3D": ((3, 3, 3, 1), lambda K, x: K.layers.Conv3D(2, 2)(x)),
    "Conv1DTranspose": ((3, 2), lambda K, x: K.layers.Conv1DTranspose(
        2, 2, strides=2)(x)),
    "Conv2DTranspose": ((3, 3, 2), lambda K, x: K.layers.Conv2DTranspose(
        2, 2, strides=2)(x)),
    "Conv3DTranspose": ((2, 2, 2, 1), lambda K, x: K.layers.Conv3DTranspose(
        2, 2, strides=2)(x)),
    "DepthwiseConv2D": ((4, 4, 2), lambda K, x: K.layers.DepthwiseConv2D(
        2)(x)),
    "SeparableConv2D": ((4, 4, 2), lambda K, x: K.layers.SeparableConv2D(
        3, 2)(x)),
    "SimpleRNN": ((4, 3), lambda K, x: K.layers.SimpleRNN(3)(x)),
    "GRU": ((4, 3), lambda K, x: K.layers.GRU(3)(x)),
    "LSTM": ((4, 3), lambda K, x: K.layers.LSTM(
        3, return_sequences=True)(x)),
    "LSTM-unroll": ((3, 2), lambda K, x: K.layers.LSTM(3, unroll=True)(x)),
    "Bidirectional-GRU": ((3, 2), lambda K, x: K.layers.Bidirectional(
        K.layers.GRU(2))(x)),
    "RNN-stacked-cells": ((3, 2), lambda K, x: K.layers.RNN(
        [K.layers.GRUCell(2), K.layers.SimpleRNNCell(2)])(x)),
    "TimeDistributed-Dense": ((4, 3), lambda K, x: K.layers.TimeDistributed(
        K.layers.Dense(5))(x)),
    "TimeDistributed-Conv2D": ((2, 4, 4, 1), lambda K, x:
                               K.layers.TimeDistributed(K.layers.Conv2D(
                                   2, 2))(x)),
    "TimeDistributed-LSTM": ((2, 3, 2), lambda K, x: K.layers.TimeDistributed(
        K.layers.LSTM(2))(x)),
    # the last output is the last state: each one's gradient counted once
    "LSTM-return_state": ((3, 2), lambda K, x: K.layers.Concatenate()(
        K.layers.LSTM(2, return_state=True)(x))),
}


@pytest.mark.parametrize("name", sorted(k for k, v in LAYERS.items() if v))
def test_each_layer_is_exact(K, name):
  shape, build = LAYERS[name]
  x = K.Input(shape)
  model = K.Model(x, build(K, x))
  check(model, [normal(B, *shape, seed=1)])


def test_attention_projections_take_the_dense_rule(K, monkeypatch):
  from graphgrad.keras import _privatize_tape

  def no_fallback(call, dys, batch):
    raise AssertionError(f"fallback for {call['layer'].name}")

  monkeypatch.setattr(_privatize_tape, "_fallback", no_fallback)
  shape, build = LAYERS["MultiHeadAttention"]
  x = K.Input(shape)
  check(K.Model(x, build(K, x)), [normal(B, *shape, seed=1)])


@pytest.mark.parametrize("name", ["LSTM", "Bidirectional-GRU"])
def test_recurrent_layers_are_exact_in_a_function(K, name):
  shape, build = LAYERS[name]
  x = K.Input(shape)
  model = K.Model(x, build(K, x))
  check(model, [normal(B, *shape, seed=1)], function=True)


def test_embedding(K):
  ids = K.Input((3,), dtype="int32")
  y = K.layers.Dense(2, "tanh")(K.layers.Flatten()(
      K.layers.Embedding(4, 2)(ids)))
  check(K.Model(ids, y),
        [np.random.default_rng(1).integers(0, 4, [B, 3]).astype(np.int32)])


@pytest.mark.parametrize("function", [False, True])
def test_a_masked_lstm(K, function):
  ids = K.Input((4,), dtype="int32")
  # The mask [B, T] reaches the LSTM's call as an argument of examples.
  y = K.layers.LSTM(2)(K.layers.Embedding(5, 3, mask_zero=True)(ids))
  x = np.random.default_rng(1).integers(1, 5, [B, 4]).astype(np.int32)
  x[0, 2:] = 0
  x[1, 1:] = 0
  check(K.Model(ids, y), [x], function)


@pytest.mark.parametrize("function", [False, True])
def test_a_layer_of_two_example_tensors(K, function):
  class Gate(K.layers.Layer):
    def build(self, shape):
      self.w = self.add_weight(name="w", shape=(3,), initializer="ones")

    def call(self, a, b):
      return tf.sin(a * self.w) * b

  a, b = K.Input((3,)), K.Input((3,))
  model = K.Model([a, b], Gate()(K.layers.Dense(3)(a), b))
  check(model, [normal(B, 3, seed=1), normal(B, 3, seed=2)], function)


@pytest.mark.parametrize("function", [False, True])
def test_a_layer_returning_a_dict_and_a_tuple(K, function):
  class Split(K.layers.Layer):
    def build(self, shape):
      self.w = self.add_weight(name="w", shape=(3,), initializer="ones")

    def call(self, a):
      return {"sin": tf.sin(a * self.w),
              "more": (tf.cos(a * self.w), a * self.w)}

  a = K.Input((3,))
  out = Split()(K.layers.Dense(3)(a))
  y = K.layers.Concatenate()([out["sin"], out["more"][0], out["more"][1]])
  check(K.Model(a, y), [normal(B, 3, seed=1)], function)


def test_lstm_in_fit_is_exact(K):
  clip, lr = 0.05, 0.5
  x, y = normal(B, 3, 2, seed=1), normal(B, 2, seed=2)
  model = K.Sequential([K.Input((3, 2)), K.layers.LSTM(2)])
  start = [v.numpy() for v in model.trainable_variables]
  total = None
  for i in range(B):
    with tf.GradientTape() as t:
      loss = tf.reduce_mean(tf.square(model(x[i:i + 1]) - y[i:i + 1]))
    g = [v.numpy().astype(np.float64)
         for v in t.gradient(loss, model.trainable_variables)]
    c = min(1.0, clip / np.sqrt(sum(np.sum(v * v) for v in g)))
    total = [c * v for v in g] if total is None else [
        a + c * v for a, v in zip(total, g)]
  model.compile(optimizer=K.optimizers.SGD(lr), loss="mse")
  gg.KerasPlan(model).privatize(clip, 0.0).attach()
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  for v, s, a in zip(model.trainable_variables, start, total):
    np.testing.assert_allclose(v.numpy(), s - lr * a / B, rtol=1e-5,
                               atol=1e-6)


def test_a_layer_without_examples_along_the_first_axis_is_refused(K):
  class Transposed(K.layers.Layer):
    def build(self, shape):
      self.w = self.add_weight(name="w", shape=(3,), initializer="ones")

    def call(self, a):
      return tf.transpose(tf.sin(a * self.w))  # [3, B]

  a = K.Input((3,), batch_size=B)
  y = K.layers.Lambda(tf.transpose)(Transposed(name="flip")(a))
  model = K.Model(a, y)
  plan = gg.KerasPlan(model).privatize(1.0, 0.0)
  with plan.tape() as tape:
    loss = square_sum(model(tf.constant(normal(B, 3))))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"the output of layer 'flip' \(Transposed\) has "
                     r"shape \(3, 5\), not the 5 examples of the batch "
                     r"along its first axis.* \[batch, \.\.\.\]"):
    tape.gradient(loss)


class _TimeMajorDense:
  """A custom layer of Keras module ``K`` that calls its Dense sublayer
  ``inner`` on time-major rows ``[T, B, d]``."""

  def __new__(cls, K, **kwargs):
    class TimeMajorDense(K.layers.Layer):
      def __init__(self, **kw):
        super().__init__(**kw)
        self.inner = K.layers.Dense(2, name="inner")

      def call(self, x):
        return tf.transpose(self.inner(tf.transpose(x, [1, 0, 2])),
                            [1, 0, 2])

    return TimeMajorDense(**kwargs)


def test_a_dense_sublayer_on_time_major_rows_is_refused(K):
  # Its rule would read rows [B, T*d] of a [T, B, d] input: each "example"
  # a mix of several.
  x = K.Input((4, 3))
  model = K.Model(x, _TimeMajorDense(K)(x))
  plan = gg.KerasPlan(model).privatize(1.0, 0.0)
  with plan.tape() as tape:
    loss = square_sum(model(tf.constant(normal(B, 4, 3))))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"the input of layer 'inner' \(Dense\) has "
                     r"shape \(4, 5, 3\), not the 5 examples .*transpose "
                     r"time-major data to \[batch, time, \.\.\.\]"):
    tape.gradient(loss)


def test_a_dense_sublayer_on_time_major_rows_fails_its_check_in_a_function(
    K):
  # A traced batch of unknown size: the check runs with the step.
  x = K.Input((4, 3))
  model = K.Model(x, _TimeMajorDense(K)(x))
  plan = gg.KerasPlan(model).privatize(1.0, 0.0)

  @tf.function(input_signature=[tf.TensorSpec([None, 4, 3])])
  def step(x):
    with plan.tape() as tape:
      loss = square_sum(model(x))
    return tape.gradient(loss)

  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"the leading axis of the input of layer "
                     r"\W*inner\W* is not the batch"):
    step(tf.constant(normal(B, 4, 3)))


def test_a_layer_called_on_time_major_rows_is_refused(K):
  class Scale(K.layers.Layer):
    def build(self, shape):
      self.w = self.add_weight(name="w", shape=(3,), initializer="ones")

    def call(self, a):
      return tf.sin(a * self.w)

  x = K.Input((4, 3))
  y = K.layers.Lambda(lambda t: tf.transpose(t, [1, 0, 2]))(x)
  model = K.Model(x, Scale(name="scale")(y))  # [T, B, d] in and out
  plan = gg.KerasPlan(model).privatize(1.0, 0.0)
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(tf.constant(normal(B, 4, 3)))),
                         axis=[0, 2])
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"layer 'scale' \(Scale\) has no norm rule, and no "
                     r"tensor argument of its call has the examples along "
                     r"its first axis"):
    tape.gradient(loss)


_names = itertools.count()


def test_a_layer_vectorized_map_cannot_convert_is_exact(K, caplog):
  # tf.py_function has no pfor converter: the per-example gradients run in
  # tf.map_fn instead (in a tf.function too: the conversion fails while
  # tracing).
  class Sine(K.layers.Layer):
    def build(self, shape):
      self.w = self.add_weight(name="w", shape=(3,), initializer="ones")

    def call(self, a):
      y = tf.py_function(tf.sin, [a * self.w], tf.float32)
      return tf.ensure_shape(y, a.shape)

  name = f"sine{next(_names)}"
  a = K.Input((3,))
  model = K.Model(a, Sine(name=name)(K.layers.Dense(3)(a)))
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    check(model, [normal(B, 3, seed=1)])
  assert [r.getMessage() for r in caplog.records if name in r.getMessage()
          and "No pfor vectorization defined for EagerPyFunc" in
          r.getMessage() and "tf.map_fn" in r.getMessage()]


@pytest.mark.parametrize("function", [False, True])
def test_a_layer_with_a_tensor_array_is_exact(K, function):
  # vectorized_map converts a TensorList into ops that fail when run: an
  # eager call runs again in tf.map_fn, a traced one runs there at once
  # (inside a tf.function the failure could not be caught).
  class Stacked(K.layers.Layer):
    def build(self, shape):
      self.w = self.add_weight(name="w", shape=(3,), initializer="ones")

    def call(self, a):
      ta = tf.TensorArray(tf.float32, size=0, dynamic_size=True)
      return tf.sin(ta.write(0, a * self.w).stack()[0])

  a = K.Input((3,))
  model = K.Model(a, Stacked()(K.layers.Dense(3)(a)))
  check(model, [normal(B, 3, seed=1)], function)


def test_a_call_that_cannot_run_one_example_at_a_time_is_refused(K):
  class Rows(K.layers.Layer):
    def build(self, shape):
      self.w = self.add_weight(name="w", shape=(3,), initializer="ones")

    def call(self, a):
      return tf.reshape(a * self.w, [B, 3])  # a batch of exactly B

  a = K.Input((3,))
  model = K.Model(a, Rows(name="rows")(a))
  plan = gg.KerasPlan(model).privatize(1.0, 0.0)
  with plan.tape() as tape:
    loss = square_sum(model(tf.constant(normal(B, 3))))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"layer 'rows' \(Rows\) has no norm rule, and its "
                     r"call fails on one example at a time \(\w+Error: "
                     r"Input to reshape is a tensor with 3 values, .*\), so "
                     r"its per-example gradients cannot be computed"):
    tape.gradient(loss)


def test_a_mixed_float16_lstm_computes_in_its_autocast_scope(K, policy):
  # The per-example call runs through the layer, whose autocast scope reads
  # tf-keras' float32 variables as float16 (its bare call mixed the two).
  x = normal(B, 3, 2, seed=1)
  exact = K.Sequential([K.Input((3, 2)), K.layers.LSTM(4)])
  _, norms = reference(exact, [x], 1.0)
  clip = float(np.median(norms))
  expected, _ = reference(exact, [x], clip)
  policy("mixed_float16")
  model = K.Sequential([K.Input((3, 2)), K.layers.LSTM(4)])
  model.set_weights(exact.get_weights())
  plan = gg.KerasPlan(model).privatize(clip, 0.0)
  with plan.tape() as tape:
    loss = square_sum(tf.cast(model(tf.constant(x)), tf.float32))
  got = tape.gradient(loss)
  for g, e in zip(got, expected):
    # float16 forward values: a few roundings of 4.9e-4 each
    np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), e,
                               atol=4e-3 * np.abs(e).max())
