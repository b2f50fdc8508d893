"""One KerasPlan tape open at a time; tapes one after another keep working."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import keras_cases

NESTED = (r"a tape of this KerasPlan is already open.*apply every transform "
          r"twice")



def _model(K):
  return keras_cases.two_dense(K, seed=1)


def _x():
  return keras_cases.normal_rows(0)


def _reference(model, x):
  """l2 halves its upstream: l1's gradients are half the plain ones."""
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.square(model(x)))
  grads = tape.gradient(loss, model.trainable_variables)
  return [0.5 * g for g in grads[:2]] + grads[2:]


def _plan(model):
  return gg.KerasPlan(model).transform_upstream("l2", gg.transforms.scale(0.5))


def _grads(plan, model, x):
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(x)))
  return tape.gradient(loss)


def _assert_close(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-6)


def test_a_nested_tape_raises(K):
  model = _model(K)
  plan = _plan(model)
  x = _x()
  with pytest.raises(gg.GraphGradError, match=NESTED):
    with plan.tape():
      with plan.tape():
        model(x)
  # The outer tape closed and restored the layers: the next tape is correct.
  _assert_close(_grads(plan, model, x), _reference(model, x))


def test_tapes_one_after_another_keep_working(K):
  model = _model(K)
  plan = _plan(model)
  x = _x()
  want = _reference(model, x)
  for _ in range(3):
    _assert_close(_grads(plan, model, x), want)


def test_a_failed_forward_pass_closes_the_tape(K):
  model = _model(K)
  plan = _plan(model)
  with pytest.raises(ValueError, match="forward pass failed"):
    with plan.tape():
      raise ValueError("forward pass failed")
  x = _x()
  _assert_close(_grads(plan, model, x), _reference(model, x))


def test_in_tf_function_nested_raises_and_sequential_works(K):
  model = _model(K)
  plan = _plan(model)
  x = _x()

  @tf.function
  def nested(x):
    with plan.tape():
      with plan.tape() as inner:
        loss = tf.reduce_sum(model(x))
    return inner.gradient(loss)

  @tf.function
  def twice(x):
    return [_grads(plan, model, x), _grads(plan, model, x)]

  with pytest.raises(gg.GraphGradError, match=NESTED):
    nested(x)
  first, second = twice(x)
  want = _reference(model, x)
  _assert_close(first, want)
  _assert_close(second, want)


def test_an_outer_plain_tape_around_a_plan_tape_is_allowed(K):
  model = _model(K)
  plan = _plan(model)
  x = _x()
  with tf.GradientTape() as outer:
    outer.watch(x)
    got = _grads(plan, model, x)
    penalty = tf.add_n([tf.reduce_sum(tf.square(g)) for g in got])
  assert outer.gradient(penalty, x) is not None
  _assert_close(got, _reference(model, x))
