"""KerasPlan runs a user's replacement as GradientPlan does: an exception it
raises, or a malformed result, is a GraphGradError naming the layer; a
BackwardResult's extra pairs reach grads_and_vars. A group transform's
exception names its declaration on both plans."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import keras_cases
from graphgrad.transforms import GroupTransform
from helpers import dense

tf1 = tf.compat.v1



def _model(K):
  return keras_cases.two_dense(K, seed=3)


def _x():
  return keras_cases.normal_rows(1)


def _foreign(shape, dtype):
  with tf.Graph().as_default():
    return tf.zeros(shape, dtype)


def _raise(*_):
  raise RuntimeError("boom")


BAD = {
    "raising": (_raise, gg.GraphGradError,
                r"the replacement .* raised RuntimeError: boom"),
    "one_tensor": (lambda ctx: ctx.inputs[0], gg.IncompatibleGradientError,
                   r"returned one tensor, not a list, for 1 input tensors"),
    "none": (lambda ctx: None, gg.IncompatibleGradientError,
             r"returned None for 1 input tensors"),
    "python_number": (lambda ctx: [0.5], gg.IncompatibleGradientError,
                      r"returned float 0.5 for the input"),
    "wrong_shape": (lambda ctx: [tf.zeros([1])], gg.IncompatibleGradientError,
                    r"returned a gradient of shape \(1,\)"),
    "other_graph": (lambda ctx: [_foreign(t.shape, t.dtype)
                                 for t in ctx.inputs],
                    gg.IncompatibleGradientError,
                    r"the replacement returned .*, a tensor of another "
                    r"tf.Graph; expected an eager tensor"),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_replacement_names_its_layer_on_a_keras_plan(K, bad):
  fn, error, pattern = BAD[bad]
  model = _model(K)
  plan = gg.KerasPlan(model).replace_backward("l2", fn)
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(_x())))
  with pytest.raises(error, match=rf"replace_backward\('l2'\).*{pattern}"):
    tape.gradient(loss)


def test_a_raising_replacement_is_chained_eagerly_and_named_in_tf_function(K):
  model = _model(K)
  plan = gg.KerasPlan(model).replace_backward("l2", _raise)
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(_x())))
  with pytest.raises(gg.GraphGradError) as info:
    tape.gradient(loss)
  assert isinstance(info.value.__cause__, RuntimeError)

  @tf.function
  def step(x):
    with plan.tape() as tape:
      loss = tf.reduce_sum(tf.square(model(x)))
    return tape.gradient(loss)

  # tf.function re-raises the error with its trace, without the cause.
  with pytest.raises(gg.GraphGradError,
                     match=r"replace_backward\('l2'\).*raised RuntimeError"):
    step(_x())


def test_a_backward_result_on_a_keras_plan_adds_its_pairs(K):
  model = _model(K)
  extra = tf.Variable([1.0, 2.0])

  def half(ctx):
    return gg.backward.BackwardResult(
        [0.5 * g for g in ctx.chain_rule()], [(tf.constant([3.0, 4.0]), extra)])

  plan = gg.KerasPlan(model).replace_backward("l2", half)
  x = _x()
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(x)))
  got = tape.grads_and_vars(loss)
  with tf.GradientTape() as ref:
    loss = tf.reduce_sum(tf.square(model(x)))
  want = ref.gradient(loss, model.trainable_variables)
  # Half of what l2 sends below reaches l1's kernel and bias.
  want = [0.5 * w for w in want[:2]] + want[2:]
  assert [v.name for _, v in got[:4]] == [
      v.name for v in model.trainable_variables]
  for (g, _), w in zip(got[:4], want):
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)
  assert got[4][1] is extra
  assert got[4][0].numpy().tolist() == [3.0, 4.0]


class _RaisingGroup(GroupTransform):
  name = "raising_group"

  def apply_group(self, grads_and_vars, context):
    raise ValueError("group boom")


def test_a_raising_group_transform_names_it_on_a_keras_plan(K):
  model = _model(K)
  plan = gg.KerasPlan(model).transform_gradients("l1", _RaisingGroup())
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(_x())))
  with pytest.raises(gg.GraphGradError,
                     match=r"transform_gradients\('l1', raising_group\(\)\): "
                     r"the group transform .* raised ValueError: group "
                     r"boom"):
    tape.gradient(loss)


def test_a_raising_group_transform_names_it_on_a_gradient_plan():
  with tf.Graph().as_default():
    x = tf.constant(np.random.default_rng(2).normal(size=(4, 3)), tf.float32)
    loss = tf.reduce_sum(tf.square(dense(dense(x, 4, "l1", tf.tanh), 2, "l2")))
    plan = gg.GradientPlan(loss).transform_gradients("l1", _RaisingGroup())
    with pytest.raises(gg.GraphGradError,
                       match=r"transform_gradients\('l1', raising_group\(\)\): "
                       r"the group transform .* raised ValueError: group "
                       r"boom") as info:
      plan.compute_gradients()
    assert isinstance(info.value.__cause__, ValueError)
