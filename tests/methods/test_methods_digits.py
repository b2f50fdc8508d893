"""The training methods on real data: scikit-learn's bundled 8x8 digits.

A reduced run of ``python -m benchmarks.methods`` (which trains seeds 0, 1
and 2 for 40 epochs and writes benchmarks/METHODS.md): seed 0 only, with the
same 40 epochs. Every method must reach 90% test accuracy (backprop reaches
~97%) and beat the control in which only the top layer trains on fixed
random features (~90% after 40 epochs), which shows that the lower layers
learn from the method's signal. Feedback alignment, DFA and synthetic
gradients also train the same MLP as a Keras model under a KerasPlan
(tf-keras, Adam, traced step), to the same bar (~97-98% seen).
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from benchmarks import methods

EPOCHS = 40


@pytest.fixture(scope="module")
def data():
  return methods.load_digits()


@pytest.fixture(scope="module")
def control(data):
  return methods.run("top_only", seed=0, epochs=EPOCHS, data=data)[-1]


def test_fixed_split(data):
  x_train, x_test, y_train, y_test = data
  assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
  assert set(y_test) == set(range(10))


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in methods.METHODS
                                    if m != "top_only"])
def test_method_learns_the_digits(data, control, method):
  accuracy = methods.run(method, seed=0, epochs=EPOCHS, data=data)[-1]
  assert accuracy >= 0.90, (method, accuracy)
  assert accuracy > control, (method, accuracy, control)


# -- the same methods on a KerasPlan (TF2, eager model, traced step) ----------

KERAS_METHODS = ("feedback_alignment", "dfa", "synthetic")


def _keras_plan(method, seed):
  K = tf.keras
  layers = [K.layers.Dense(
      units, name=name, activation="relu" if i < 2 else None,
      kernel_initializer=K.initializers.GlorotUniform(seed=seed * 10 + i))
      for i, (name, units) in enumerate(zip(methods.HIDDEN,
                                            methods.SIZES[1:]))]
  model = K.Sequential([K.Input((methods.SIZES[0],))] + layers)
  plan = gg.KerasPlan(model)
  for name in methods.HIDDEN[1:]:  # as the TF1 plan: l2 and l3
    plan.replace_backward(name, {
        "feedback_alignment": gg.backward.feedback_alignment(seed=seed),
        "dfa": gg.backward.direct_feedback_alignment(seed=seed),
        "synthetic": gg.backward.synthetic(seed=seed),
    }[method])
  return model, plan


def _keras_run(method, seed, epochs, data, batch_size=32):
  x_train, x_test, y_train, y_test = data
  tf.random.set_seed(seed)
  model, plan = _keras_plan(method, seed)
  optimizer = tf.keras.optimizers.Adam(1e-3)

  @tf.function
  def step(x, y):
    onehot = tf.one_hot(y, methods.SIZES[-1])
    with plan.tape(labels=onehot if method == "synthetic" else None) as tape:
      loss = tf.reduce_mean(
          tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
    optimizer.apply_gradients(tape.grads_and_vars(loss))

  rng = np.random.default_rng(seed)
  # Whole batches only: one trace of the step.
  n = len(x_train) // batch_size * batch_size
  for _ in range(epochs):
    order = rng.permutation(len(x_train))[:n]
    for i in range(0, n, batch_size):
      idx = order[i:i + batch_size]
      step(tf.constant(x_train[idx]), tf.constant(y_train[idx]))
  logits = model(tf.constant(x_test))
  return float(np.mean(np.argmax(logits, 1) == y_test)), plan


@pytest.mark.slow
@pytest.mark.parametrize("method", KERAS_METHODS)
def test_keras_plan_method_learns_the_digits(data, control, method):
  accuracy, plan = _keras_run(method, seed=0, epochs=EPOCHS, data=data)
  assert accuracy >= 0.90, (method, accuracy)
  assert accuracy > control, (method, accuracy, control)
  if method == "synthetic":  # the modules trained: no longer all zero
    assert any(abs(v.numpy()).max() > 0
               for v in plan.method_variables.by_key.values())
  else:
    assert plan.feedback_matrices  # made once, for l2 and l3
