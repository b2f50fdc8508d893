"""KerasPlan errors: each names the problem and the fix."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import keras_cases


def _chain(K):
  return keras_cases.keras_model(keras_cases.Chain, K)


def _x():
  return tf.constant(np.random.default_rng(0).normal(size=(4, 6)), tf.float32)


def test_unknown_layer(K):
  with pytest.raises(gg.LayerNotFoundError,
                     match=r"no layer named 'l9'.*known layers: .*l1, l2, l3"):
    gg.KerasPlan(_chain(K)).transform_upstream("l9", gg.transforms.scale(2.0))


def test_ambiguous_nested_name_asks_for_the_path(K):
  def block(name):
    inp = K.Input((3,))
    return K.Model(inp, K.layers.Dense(3, name="dense")(inp), name=name)
  inp = K.Input((3,))
  model = K.Model(inp, block("b2")(block("b1")(inp)))
  with pytest.raises(
      gg.LayerNotFoundError,
      match=r"'dense' names 2 nested layers: b1/dense, b2/dense"):
    gg.KerasPlan(model).transform_gradients("dense", gg.transforms.scale(2.0))
  gg.KerasPlan(model).transform_gradients("b2/dense", gg.transforms.scale(2.0))


def test_layer_object_not_in_the_model(K):
  with pytest.raises(gg.LayerNotFoundError, match="is not in the model"):
    gg.KerasPlan(_chain(K)).transform_upstream(K.layers.Dense(2), lambda g: g)


def test_not_a_keras_model():
  with pytest.raises(gg.GraphGradError, match="must be a Keras model"):
    gg.KerasPlan(lambda x: x)


def test_edge_from_a_layer_to_itself(K):
  with pytest.raises(gg.GraphGradError, match="are both 'l2'"):
    gg.KerasPlan(_chain(K)).transform_edge("l2", "l2", lambda g: g)


class _WithSpare(tf.keras.Model):

  def __init__(self):
    super().__init__()
    self.l1 = tf.keras.layers.Dense(3, name="l1")
    self.spare = tf.keras.layers.Dense(3, name="spare")  # never called

  def call(self, x):
    return self.l1(x)


def _sum_step(plan, model, mode):
  """A gradient step of ``sum(model(x))`` under the plan, eager or traced."""

  def step(x):
    with plan.tape() as tape:
      loss = tf.reduce_sum(model(x))
    return tape.gradient(loss)

  return tf.function(step) if mode == "function" else step


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_layer_that_never_ran(mode):
  model = _WithSpare()
  plan = gg.KerasPlan(model).transform_upstream(
      "spare", gg.transforms.scale(2.0))

  step = _sum_step(plan, model, mode)
  with pytest.raises(gg.NotConnectedError,
                     match=r"'spare' never ran in the forward pass.*inside "
                           r"`with plan.tape\(\) as tape:`"):
    step(_x()[:, :3])


def test_forward_pass_outside_the_tape(K):
  model = _chain(K)
  plan = gg.KerasPlan(model).transform_gradients("l1", gg.transforms.scale(2.0))
  loss = tf.reduce_sum(model(_x())[0] if isinstance(model(_x()), list)
                       else model(_x()))
  with plan.tape() as tape:
    pass
  with pytest.raises(gg.NotConnectedError, match="'l1' never ran"):
    tape.gradient(loss)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("kind", ["upstream", "gradients", "edge"])
def test_transform_that_changes_the_shape(K, kind, mode):
  case = keras_cases.TwoHeads
  model = keras_cases.keras_model(case, K)
  bad = lambda g: tf.reduce_sum(g, axis=0)  # noqa: E731
  plan = gg.KerasPlan(model)
  if kind == "upstream":
    plan.transform_upstream("head", bad)
  elif kind == "gradients":
    plan.transform_gradients("head", bad)
  else:
    plan.transform_edge("features", "head", bad)
  x, labels = keras_cases.batch(case)

  def step(x):
    with plan.tape() as tape:
      loss = case.loss(model(x), labels)
    return tape.gradient(loss)

  step = tf.function(step) if mode == "function" else step
  with pytest.raises(gg.IncompatibleGradientError,
                     match=rf"transform_{kind}\(.*'.*\) on .*changed the "
                           r"gradient from shape .* A transform must keep"):
    step(tf.constant(x))


def test_plan_is_fixed_once_a_tape_opened(K):
  plan = gg.KerasPlan(_chain(K))
  plan.tape()
  with pytest.raises(
      gg.GraphGradError, match="already built .*a tape was opened"):
    plan.transform_upstream("l2", gg.transforms.scale(2.0))


def test_a_tape_is_used_once(K):
  model = _chain(K)
  tape = gg.KerasPlan(model).tape()
  with tape:
    model(_x())
  with pytest.raises(gg.GraphGradError, match="already used"):
    with tape:
      pass


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_edge_between_layers_that_are_not_adjacent(K, mode):
  # l1 reaches l3 only through l2, a layer: there is no l1 -> l3 edge.
  model = _chain(K)
  plan = gg.KerasPlan(model).transform_edge("l1", "l3",
                                            gg.transforms.reverse())

  step = _sum_step(plan, model, mode)
  with pytest.raises(gg.NotConnectedError,
                     match=r"transform_edge\('l1', 'l3'\): 'l3' ran, but no "
                           r"gradient from it reached 'l1'"):
    step(_x())
