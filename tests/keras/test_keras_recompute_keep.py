"""KerasPlan.recompute(keep=...) with layer outputs, and kept_tensors().

A functional model's symbolic tensor (``layer.output``) keeps that layer's
call. References: a plain ``tf.GradientTape`` for the gradients and a
sub-model ending at the layer for the kept values.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from keras_cases import normal_rows


def _mlp(K, depth=4):
  init = K.initializers.RandomNormal(stddev=0.5, seed=1)
  inp = K.Input((5,))
  h = inp
  for i in range(depth):
    h = K.layers.Dense(5, activation="tanh", name=f"d{i}",
                       kernel_initializer=init)(h)
  return inp, K.Model(inp, h)


def _loss(model, x):
  return tf.reduce_sum(tf.square(model(x)))


def _plan_step(plan, model, x):
  with plan.tape() as tape:
    loss = _loss(model, x)
  return tape.gradient(loss)


def _reference(model, x):
  with tf.GradientTape() as tape:
    loss = _loss(model, x)
  return tape.gradient(loss, model.trainable_variables)


def test_keep_layer_outputs_equals_gradient_tape(K):
  inp, model = _mlp(K)
  x = normal_rows(3, (4, 5))
  d1, d3 = model.get_layer("d1"), model.get_layer("d3")
  plan = gg.KerasPlan(model).recompute(keep=[d1.output, "d3"])
  grads = _plan_step(plan, model, x)
  for g, w in zip(grads, _reference(model, x)):
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-6)
  kept = plan.kept_tensors()
  want = [K.Model(inp, layer.output)(x) for layer in (d1, d3)]
  assert len(kept) == 2
  for k, w in zip(kept, want):
    np.testing.assert_allclose(np.asarray(k), np.asarray(w), rtol=1e-6)


def test_kept_output_is_read_by_the_replay(K):
  _, model = _mlp(K)
  x = normal_rows(4, (4, 5))
  plan = gg.KerasPlan(model).recompute(keep=[model.get_layer("d1").output])
  grads = tf.function(lambda: _plan_step(plan, model, x))()
  # The reference traced too: TF 2.15's eager kernels round differently.
  reference = tf.function(lambda: _reference(model, x))()
  for g, w in zip(grads, reference):
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-6)
  kept = plan.kept_tensors()
  assert [t.shape.as_list() for t in kept] == [[4, 5]]
  # The replay of the block above d1 starts from d1's forward output: it
  # reads it (through an Identity the replay watches) into d2's MatMul.
  replayed = [c.type for r in kept[0].consumers() if "/recompute/" in r.name
              for t in r.outputs for c in t.consumers()]
  assert "MatMul" in replayed, [c.name for c in kept[0].consumers()]


def test_kept_tensors_before_a_step_and_without_recompute(K):
  _, model = _mlp(K, depth=2)
  plan = gg.KerasPlan(model)
  with pytest.raises(gg.GraphGradError, match=r"KerasPlan does not "
                     r"recompute, so it keeps every activation"):
    plan.kept_tensors()
  plan.recompute(keep=["d0"])
  with pytest.raises(gg.GraphGradError, match=r"no step has run under this "
                     r"KerasPlan's tape yet.*Run one step"):
    plan.kept_tensors()


def test_bad_tensors_in_keep_are_refused(K):
  inp, model = _mlp(K, depth=2)
  plan = gg.KerasPlan(model)
  with pytest.raises(gg.GraphGradError, match=r"`keep` got the tensor name "
                     r"'d0/Tanh:0', but a KerasPlan keeps layer calls.*"
                     r"top-level layers: .*d0, d1"):
    plan.recompute(keep=["d0/Tanh:0"])
  with pytest.raises(gg.GraphGradError, match=r"`keep` got an eager tensor, "
                     r"which names no call of .*layer\.output"):
    plan.recompute(keep=[tf.ones([2, 5])])
  with pytest.raises(gg.GraphGradError, match=r"which is layer\.output of "
                     r"no top-level layer of .* \(a model input"):
    plan.recompute(keep=[inp])


def test_a_shared_layers_second_output_is_refused(K):
  inp = K.Input((5,))
  shared = K.layers.Dense(5, activation="tanh", name="shared")
  first = shared(inp)
  h = shared(first)
  model = K.Model(inp, K.layers.Dense(1, name="top")(h))
  with pytest.raises(gg.GraphGradError, match=r"which is layer\.output of "
                     r"no top-level layer .* a shared layer's second call\)"
                     r"\. Pass layer\.output"):
    gg.KerasPlan(model).recompute(keep=[h])
  # Its first call's output is layer.output: the layer, as its name.
  plan = gg.KerasPlan(model).recompute(keep=[first, "top"])
  assert plan.declarations.recompute.keep == ("shared", "top")


def test_a_subclassed_models_layers_have_no_output(K):
  class Net(K.Model):
    def __init__(self):
      super().__init__()
      self.d = K.layers.Dense(2, name="d")

    def call(self, x):
      return self.d(x)

  model = Net()
  model(tf.ones([1, 3]))
  elsewhere = K.Input((3,))
  with pytest.raises(gg.GraphGradError, match=r"which is layer\.output of "
                     r"no top-level layer"):
    gg.KerasPlan(model).recompute(keep=[K.layers.Dense(2)(elsewhere)])
