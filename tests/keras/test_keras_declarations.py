"""KerasPlan declarations that could only be no-ops are refused by name."""

import logging

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg


def _x():
  return tf.constant(np.random.default_rng(0).normal(size=(4, 5)), tf.float32)


def _model(K, frozen: bool = True):
  # Seeded: a test's figures (a clip that acts) must not depend on the
  # random state other tests left behind.
  def init(seed):
    return K.initializers.GlorotUniform(seed=seed)
  model = K.Sequential([
      K.layers.Dense(4, activation="tanh", name="stem",
                     kernel_initializer=init(1)),
      K.layers.Dense(3, activation="tanh", name="frozen",
                     kernel_initializer=init(2)),
      K.layers.Dropout(0.5, name="drop"),
      K.layers.Dense(2, name="head", kernel_initializer=init(3))])
  model(_x())
  model.get_layer("frozen").trainable = not frozen
  return model


def _plan_and_plain_gradients(plan, model):
  """The plan's gradients, and a plain GradientTape's, of the same loss."""
  x = _x()
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(x, training=False)))
  got = tape.gradient(loss)
  with tf.GradientTape() as ref:
    loss = tf.reduce_sum(tf.square(model(x, training=False)))
  return got, ref.gradient(loss, model.trainable_variables)


def test_transform_gradients_on_a_frozen_layer_says_so(K):
  plan = gg.KerasPlan(_model(K))
  with pytest.raises(
      gg.GraphGradError,
      match=r"transform_gradients: layer 'frozen' holds only non-trainable "
            r"variables \(.*kernel.*\), which get no gradient, so there is "
            r"nothing to transform\. Make them trainable .*: stem, head\."):
    plan.transform_gradients("frozen", gg.transforms.scale(2.0))
  assert not plan.declarations.gradients  # nothing was recorded


def test_transform_gradients_on_a_layer_without_variables_says_so(K):
  plan = gg.KerasPlan(_model(K))
  with pytest.raises(
      gg.GraphGradError,
      match=r"transform_gradients: layer 'drop' holds no variables, so it "
            r"has no parameter gradients to transform\. Use "
            r"transform_upstream\('drop', fn\)"):
    plan.transform_gradients("drop", gg.transforms.scale(2.0))


def test_unbuilt_and_unfrozen_layers_are_accepted(K):
  unbuilt = K.Sequential([K.layers.Dense(2, name="a"),
                          K.layers.Dense(1, name="b")])
  gg.KerasPlan(unbuilt).transform_gradients("a", gg.transforms.scale(2.0))
  model = _model(K, frozen=False)
  plan = gg.KerasPlan(model).transform_gradients("frozen",
                                                 gg.transforms.scale(2.0))
  got, want = _plan_and_plain_gradients(plan, model)
  own = [id(v) for v in model.get_layer("frozen").trainable_weights]
  for v, g, w in zip(model.trainable_variables, got, want):
    scale = 2.0 if id(v) in own else 1.0
    np.testing.assert_allclose(g.numpy(), scale * w.numpy(), rtol=1e-5,
                               atol=1e-6)


def test_upstream_through_a_frozen_layer_rewrites_below(K):
  model = _model(K)
  plan = gg.KerasPlan(model).transform_upstream("frozen",
                                                gg.transforms.scale(0.5))
  got, want = _plan_and_plain_gradients(plan, model)
  stem = [id(v) for v in model.get_layer("stem").trainable_weights]
  assert len(got) == 4  # stem and head; the frozen layer has none
  for v, g, w in zip(model.trainable_variables, got, want):
    scale = 0.5 if id(v) in stem else 1.0
    np.testing.assert_allclose(g.numpy(), scale * w.numpy(), rtol=1e-5,
                               atol=1e-6)


def test_group_clip_over_every_layer_follows_layer_scales(K):
  """The GradientPlan declaration of tests/plan/test_plan.py, on Keras: a
  clip over every variable after layer-wise scales."""
  model = _model(K, frozen=False)
  plan = (gg.KerasPlan(model)
          .transform_gradients(["stem", "frozen", "drop", "head"],
                               gg.transforms.clip_by_global_norm(1.0))
          .transform_gradients("stem", gg.transforms.scale(0.5))
          .transform_gradients("head", gg.transforms.scale(2.0)))
  got, raw = _plan_and_plain_gradients(plan, model)
  scaled = [0.5 * g for g in raw[:2]] + raw[2:4] + [2.0 * g for g in raw[4:]]
  ref, norm = tf.clip_by_global_norm(scaled, 1.0)
  assert float(norm) > 1.5  # the clip acts
  for a, b in zip(got, ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_group_of_layers_without_parameters_is_refused(K):
  plan = gg.KerasPlan(_model(K))
  with pytest.raises(gg.GraphGradError,
                     match=r"transform_gradients: layer 'frozen' holds only "
                     r"non-trainable variables"):
    plan.transform_gradients(["frozen", "drop"],
                             gg.transforms.clip_by_global_norm(1.0))
  plan.transform_gradients(plan.layer_names,
                           gg.transforms.clip_by_global_norm(1.0))
  assert plan.declarations.gradient_groups[0][0][-4:] == (
      "stem", "frozen", "drop", "head")


def test_upstream_transform_on_the_bottom_layer_warns_once(K, caplog):
  """As GradientPlan (tests/analysis/test_control_flow_layers.py): the same
  message, and the gradients are the plain ones."""
  model = _model(K, frozen=False)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan = gg.KerasPlan(model).transform_upstream(
        "frozen", gg.transforms.scale(0.0))
    assert not caplog.records  # stem lies below
    for _ in range(2):
      plan.transform_upstream("stem", gg.transforms.scale(0.0))
  assert [r.getMessage() for r in caplog.records] == [
      "transform_upstream('stem') changes nothing: no layer with trainable "
      "variables lies below 'stem', and its own parameters get the "
      "unmodified upstream gradient. For stem's parameter gradients declare "
      "transform_gradients('stem', fn); for what stem receives from the "
      "layer above, declare transform_upstream on that layer: "
      "transform_upstream('frozen', fn)."]
  got, _ = _plan_and_plain_gradients(
      gg.KerasPlan(model).transform_upstream("stem", gg.transforms.scale(0.0)),
      model)
  _, plain = _plan_and_plain_gradients(gg.KerasPlan(model), model)
  for a, b in zip(got, plain):
    np.testing.assert_allclose(a, b, rtol=1e-6)
