"""A plan tape lets go of the forward pass once its gradient is taken.

A tape the plan makes persistent for itself (task combinations,
``privatize``) and an edge's glue tape hold the forward pass's activations;
the plan keeps its last tape (``plan.trace``), so they would stay alive into
the next step. A weak reference to an activation shows whether it is freed.
"""

import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import keras_cases
from keras_cases import FLAVOURS

K = FLAVOURS["keras3"]


class _Seen(K.layers.Layer):
  """A tanh layer that keeps a weak reference to what it passes (symbolic
  ones too: ``privatize`` traces the layers once, into a cached graph)."""

  def __init__(self, **kw):
    super().__init__(**kw)
    self.seen = []

  def call(self, x):
    y = tf.tanh(x) * 1.0
    self.seen.append(weakref.ref(y))
    return y


def _model():
  inp = K.Input((3,))
  seen = _Seen(name="seen")
  h = seen(K.layers.Dense(4, name="l1")(inp))
  h = K.layers.Dense(4, name="l2")(h)
  return K.Model(inp, [K.layers.Dense(2, name="a")(h),
                       K.layers.Dense(2, name="b")(h)]), seen


def _plans(model):
  return {
      "tasks": gg.KerasPlan(model).project_conflicts("l2"),
      "edge": gg.KerasPlan(model).transform_edge(
          "l1", "l2", gg.transforms.scale(0.5)),
      "private": gg.KerasPlan(model).privatize(1.0, 0.0, seed=0),
  }


def _losses(model, x):
  a, b = model(x)
  return [tf.reduce_mean(tf.square(a), axis=-1),
          tf.reduce_mean(tf.square(b - 1.0), axis=-1)]


@pytest.mark.parametrize("kind", ["tasks", "edge", "private"])
def test_the_activations_are_freed_after_the_gradient(kind):
  model, seen = _model()
  plan = _plans(model)[kind]
  x = keras_cases.normal_rows(0)
  with plan.tape() as tape:
    per_example = _losses(model, x)
    tasks = [tf.reduce_mean(l) for l in per_example]
    loss = tf.add_n(per_example) if kind == "private" else tf.add_n(tasks)
  kwargs = {"task_losses": tasks} if kind == "tasks" else {}
  grads = tape.gradient(loss, **kwargs)
  del per_example, tasks, loss
  gc.collect()
  assert all(g is not None for g in grads)
  assert plan.trace is not None and tape is not None  # both still held
  eager = [r for r in seen.seen
           if r() is None or not tf.is_symbolic_tensor(r())]
  assert eager and all(r() is None for r in eager), kind
  with pytest.raises(gg.GraphGradError, match="gradient was already taken"):
    tape.gradient(tf.constant(0.0))


def test_a_persistent_tape_gives_several_equal_gradients():
  model, _ = _model()
  plan = gg.KerasPlan(model).project_conflicts("l2")
  x = keras_cases.normal_rows(0)
  with plan.tape(persistent=True) as tape:
    tasks = [tf.reduce_mean(l) for l in _losses(model, x)]
    loss = tf.add_n(tasks)
  first = tape.gradient(loss, task_losses=tasks)
  second = tape.gradient(loss, task_losses=tasks)
  for a, b in zip(first, second):
    np.testing.assert_allclose(a, b, rtol=1e-6)
