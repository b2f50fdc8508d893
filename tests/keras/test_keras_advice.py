"""KerasPlan's logged advice: the no-gradient warning and the scale that an
adaptive optimizer cancels, worded as GradientPlan's, with Keras' fix."""

import logging
import re

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense

tf1 = tf.compat.v1


def _x():
  return tf.constant(np.random.default_rng(4).normal(size=(5, 3)), tf.float32)


def _rounded(K, unused: bool = False):
  """l1 -> tf.round in a Lambda layer -> l2 (and an unused ``spare``)."""
  inputs = K.Input((3,))
  h = K.layers.Dense(4, name="l1")(inputs)
  h = K.layers.Lambda(lambda t: tf.round(t * 3.0), name="quant")(h)
  out = K.layers.Dense(2, name="l2")(h)
  if unused:
    out = [out, K.layers.Dense(1, name="spare")(inputs)]
  return K.Model(inputs, out)


def _messages(caplog):
  return [r.getMessage() for r in caplog.records if r.name == "graphgrad"]


def _traced_step(plan, model):
  @tf.function
  def step(x):
    with plan.tape() as tape:
      out = tf.nest.flatten(model(x))[0]
      loss = tf.reduce_sum(tf.square(out))
    return tape.gradient(loss)
  return step


def test_a_round_between_keras_layers_warns_once_naming_op_and_layer(
    K, caplog):
  model = _rounded(K)
  step = _traced_step(gg.KerasPlan(model), model)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    grads = step(_x())
    step(_x()[:4])  # a second trace
  [message] = _messages(caplog)
  kernel, bias = re.search(
      r"\(2 variable\(s\): (\S*l1/kernel), (\S*l1/bias)\)", message).groups()
  op = message.split("the op(s) ")[1].split(" (Round)")[0]
  assert op.endswith("Round") and "quant" in op
  assert message == (
      f"layer(s) 'l1' get no gradient from the loss Sum:0 (2 variable(s): "
      f"{kernel}, {bias}): the op(s) {op} (Round) between them and the loss "
      f"have no gradient, so nothing reaches below them. To train through "
      f"'{op}', declare plan.straight_through('quant') (an identity backward "
      f"pass) or plan.override_gradient('quant', fn); otherwise "
      f"apply_gradients skips these variables.")
  assert [g is None for g in grads] == [True, True, False, False]


@pytest.mark.filterwarnings("ignore:Gradients do not exist")  # Keras 3's own
def test_fit_warns_about_the_round_too(K, caplog):
  model = _rounded(K)
  model.compile(optimizer=K.optimizers.SGD(0.1), loss="mse")
  gg.KerasPlan(model).attach()
  before = model.get_layer("l1").get_weights()[0].copy()
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    model.fit(_x(), tf.zeros((5, 2)), epochs=1, verbose=0)
  [message] = _messages(caplog)
  assert message.startswith("layer(s) 'l1' get no gradient from the loss ")
  assert "declare plan.straight_through('quant')" in message
  # What the warning says: l1 did not train.
  np.testing.assert_array_equal(model.get_layer("l1").get_weights()[0], before)


def test_the_suggested_keras_straight_through_trains_the_layer(K, caplog):
  model = _rounded(K)
  plan = gg.KerasPlan(model).straight_through("quant")
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    grads = _traced_step(plan, model)(_x())
  assert not _messages(caplog)
  # By hand: the quant layer's call with an identity backward pass.
  l1, l2 = model.get_layer("l1"), model.get_layer("l2")
  with tf.GradientTape() as tape:
    h = l1(_x())
    h = h + tf.stop_gradient(tf.round(h * 3.0) - h)
    loss = tf.reduce_sum(tf.square(l2(h)))
  ref = tape.gradient(loss, model.trainable_variables)
  for g, r in zip(grads, ref):
    np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-6)


def test_a_variable_the_loss_does_not_read_is_not_reported(K, caplog):
  model = _rounded(K, unused=True)
  plan = gg.KerasPlan(model).straight_through("quant")
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    grads = _traced_step(plan, model)(_x())
  assert not _messages(caplog)
  assert [g is None for g in grads] == [False] * 4 + [True, True]


def test_both_plans_word_the_no_gradient_warning_alike(K, caplog):
  model = _rounded(K)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    _traced_step(gg.KerasPlan(model), model)(_x())
    with tf.Graph().as_default():
      h = tf.round(dense(_x(), 4, "l1") * 3.0)
      loss = tf.reduce_sum(tf.square(dense(h, 2, "l2")))
      gg.GradientPlan(loss).compute_gradients()
  keras_msg, graph_msg = _messages(caplog)
  head = "layer(s) 'l1' get no gradient from the loss Sum:0 (2 variable(s): "
  assert keras_msg.startswith(head) and graph_msg.startswith(head)
  tail = ("between them and the loss have no gradient, so nothing reaches "
          "below them.")
  assert tail in keras_msg and tail in graph_msg


# -- a scale under an adaptive optimizer -------------------------------------

_ADAPTIVE = ["Adam", "RMSprop", "Adagrad", "Adamax", "Adadelta", "Nadam"]


def _scaled_plan(K):
  model = K.Sequential([K.Input((3,)), K.layers.Dense(4, name="l1"),
                        K.layers.Dense(2, name="l2")])
  return gg.KerasPlan(model).transform_gradients(
      "l2", gg.transforms.scale(0.5)), model


@pytest.mark.parametrize("name", _ADAPTIVE)
def test_an_adaptive_keras_optimizer_gets_the_advice_once(K, name, caplog):
  plan, _ = _scaled_plan(K)
  optimizer = getattr(K.optimizers, name)()
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert plan.check_optimizer(optimizer)
    assert not plan.check_optimizer(optimizer)
  assert _messages(caplog) == [
      f"transform_gradients('l2') scales by 0.5 under {name}: an adaptive "
      f"optimizer divides each parameter's step by a running estimate of its "
      f"gradient's magnitude, so a constant scale largely cancels out. To "
      f"make these parameters learn faster or slower, give them their own "
      f"learning rate (a second optimizer that applies their gradients), or "
      f"train with keras.optimizers.SGD (with or without momentum), where a "
      f"scale acts like a learning-rate factor."]


def test_a_loss_scale_optimizer_is_read_through_its_inner_one(K, caplog):
  plan, _ = _scaled_plan(K)
  wrapped = K.mixed_precision.LossScaleOptimizer(K.optimizers.Adam())
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan.tape(loss_scale=wrapped)
  [message] = _messages(caplog)
  assert message.startswith("transform_gradients('l2') scales by 0.5 under "
                            "Adam: an adaptive optimizer")


def test_sgd_and_a_plan_that_does_more_than_scale_get_no_advice(K, caplog):
  plan, model = _scaled_plan(K)
  clipped = gg.KerasPlan(model).transform_gradients(
      "l2", gg.transforms.clip_by_norm(1.0))
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert not plan.check_optimizer(K.optimizers.SGD(0.1))
    assert not clipped.check_optimizer(K.optimizers.Adam())
  assert not _messages(caplog)


def test_fit_with_adam_logs_the_advice(K, caplog):
  plan, model = _scaled_plan(K)
  model.compile(optimizer=K.optimizers.Adam(), loss="mse")
  plan.attach()
  x = _x()
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    model.fit(x, tf.zeros((5, 2)), epochs=2, verbose=0)
  assert [m for m in _messages(caplog) if "scales by 0.5 under Adam" in m]
  assert len(_messages(caplog)) == 1


def test_both_plans_name_the_same_scaled_declarations(K, caplog):
  plan, _ = _scaled_plan(K)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan.check_optimizer(K.optimizers.Adam())
    with tf.Graph().as_default():
      h = dense(_x(), 4, "l1")
      loss = tf.reduce_sum(tf.square(dense(h, 2, "l2")))
      gg.GradientPlan(loss).transform_gradients(
          "l2", gg.transforms.scale(0.5)).apply_gradients(
              tf1.train.AdamOptimizer())
  keras_msg, graph_msg = _messages(caplog)
  # The same declarations and reason; each plan's fix in its own optimizers.
  keras_why, keras_fix = keras_msg.split(" To make ")
  graph_why, graph_fix = graph_msg.split(" To make ")
  assert keras_why.replace("under Adam:", "under AdamOptimizer:") == graph_why
  assert "keras.optimizers.SGD" in keras_fix and "tf.compat" not in keras_fix
  assert "GradientDescentOptimizer" in graph_fix
