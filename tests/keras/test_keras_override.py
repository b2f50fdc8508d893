"""KerasPlan.override_gradient and straight_through: a layer call's backward.

References: the same model whose quantizer layer's call is a
``tf.custom_gradient`` with the same backward (rtol=1e-6), and
``GradientPlan.straight_through("Round")`` on the equivalent tf.compat.v1
graph built from the same weights (rtol=1e-6). Each runs on tf-keras and
Keras 3, eagerly and inside ``tf.function``.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import evaluate
from keras_cases import FLAVOURS

tf1 = tf.compat.v1
RUNS = [(f, traced) for f in FLAVOURS for traced in (False, True)]
IDS = [f"{f}-{'traced' if t else 'eager'}" for f, t in RUNS]
RTOL = 1e-6

_rng = np.random.RandomState(0)
W1 = _rng.normal(size=(3, 4)).astype(np.float32)
W2 = _rng.normal(size=(4, 2)).astype(np.float32)
X = (2.0 * _rng.normal(size=(5, 3))).astype(np.float32)


def quantize(t):
  return tf.round(t * 4.0) / 4.0


def _quant_layer(k, call=quantize):
  class Quant(k.layers.Layer):
    def call(self, x):  # noqa: D102
      return call(x)
  return Quant(name="quant")


def _model(k, quant_call=quantize):
  inp = k.Input((3,))
  h = k.layers.Dense(4, use_bias=False, name="fc1",
                     kernel_initializer=k.initializers.Constant(W1))(inp)
  q = _quant_layer(k, quant_call)(h)
  out = k.layers.Dense(2, use_bias=False, name="fc2",
                       kernel_initializer=k.initializers.Constant(W2))(q)
  return k.Model(inp, out)


def _loss(out):
  return tf.reduce_mean(tf.square(out - 0.3))


def _grads(model, plan=None, traced=False):
  """The model's gradients, under ``plan``'s tape or a plain one."""
  def step():
    with (plan.tape() if plan is not None else tf.GradientTape()) as tape:
      loss = _loss(model(tf.constant(X)))
    return tape.gradient(loss, model.trainable_variables)
  out = tf.function(step)() if traced else step()
  return [None if g is None else np.asarray(g) for g in out]


def _close(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g is not None and w is not None
    np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-7)


def _tanh_backward(scale):
  def grad_of(x, dy):
    return scale * dy * (1.0 - tf.tanh(x) ** 2)
  return grad_of


def _custom_quant(backward):
  @tf.custom_gradient
  def quant(x):
    return quantize(x), lambda dy: backward(x, dy)
  return quant


@pytest.mark.parametrize("flavour,traced", RUNS, ids=IDS)
def test_override_equals_a_custom_gradient_layer(flavour, traced):
  k = FLAVOURS[flavour]
  backward = _tanh_backward(1.0)
  model = _model(k)
  plain = _grads(model, traced=traced)
  assert plain[0] is None  # Round stops the chain rule without an override
  plan = gg.KerasPlan(model).override_gradient(
      "quant", lambda call, g: backward(call.inputs[0], g))
  got = _grads(model, plan, traced)
  want = _grads(_model(k, _custom_quant(backward)), traced=traced)
  _close(got, want)
  assert np.abs(got[0]).max() > 1e-3


@pytest.mark.parametrize("flavour,traced", RUNS, ids=IDS)
def test_override_composes_with_an_upstream_transform(flavour, traced):
  k = FLAVOURS[flavour]
  model = _model(k)
  seen = []

  def fn(call, g):
    seen.append((call.name, call.type, len(call.inputs), len(call.outputs)))
    return _tanh_backward(1.0)(call.inputs[0], g)

  plan = (gg.KerasPlan(model)
          .transform_upstream("quant", gg.transforms.scale(0.5))
          .override_gradient(model.get_layer("quant"), fn))
  got = _grads(model, plan, traced)
  want = _grads(_model(k, _custom_quant(_tanh_backward(0.5))), traced=traced)
  _close(got, want)
  assert seen[0] == ("quant", "Quant", 1, 1)


def _tf1_grads(upstream: bool):
  with tf.Graph().as_default():
    x = tf.constant(X)
    with tf1.variable_scope("fc1"):
      h = x @ tf1.get_variable("kernel", initializer=W1)
    q = quantize(h)
    with tf1.variable_scope("fc2"):
      out = q @ tf1.get_variable("kernel", initializer=W2)
    plan = gg.GradientPlan(_loss(out)).straight_through("Round")
    if upstream:
      plan.transform_upstream("fc2", gg.transforms.scale(0.5))
    return evaluate([g for g, _ in plan.compute_gradients()])


@pytest.mark.parametrize("upstream", [False, True])
@pytest.mark.parametrize("flavour,traced", RUNS, ids=IDS)
def test_straight_through_on_a_round_matches_gradient_plan(flavour, traced,
                                                           upstream):
  model = _model(FLAVOURS[flavour])
  plan = gg.KerasPlan(model).straight_through("quant")
  if upstream:
    plan.transform_upstream("fc2", gg.transforms.scale(0.5))
  _close(_grads(model, plan, traced), _tf1_grads(upstream))


def test_override_errors():
  model = _model(tf.keras)
  plan = gg.KerasPlan(model)
  with pytest.raises(gg.LayerNotFoundError,
                     match=r"straight_through: `layer` 'Round' is not a layer "
                           r"of the model. A KerasPlan overrides the backward "
                           r"pass of a layer's call, not of an op type"):
    plan.straight_through("Round")
  with pytest.raises(gg.LayerNotFoundError, match=r"`layer` must be a layer"):
    plan.straight_through(3)
  with pytest.raises(gg.GraphGradError, match=r"override_gradient: `fn` must "
                                              r"be a callable"):
    plan.override_gradient("quant", 3)
  plan.straight_through("quant")
  with pytest.raises(gg.GraphGradError, match=r"override_gradient: 'quant' "
                                              r"already has a backward pass"):
    plan.override_gradient("quant", lambda call, g: g)
  with pytest.raises(gg.GraphGradError, match=r"replace_backward: layer "
                                              r"'quant' already has an "
                                              r"override"):
    plan.replace_backward("quant", lambda ctx: list(ctx.upstream))
  plan.replace_backward("fc2", lambda ctx: list(ctx.upstream))
  with pytest.raises(gg.GraphGradError, match=r"straight_through: layer "
                                              r"'fc2' already has the "
                                              r"backward replacement"):
    plan.straight_through("fc2")
  plan.tape()
  with pytest.raises(gg.GraphGradError, match=r"straight_through: this "
                                              r"KerasPlan is already built"):
    plan.straight_through("fc1")
  assert "overrides=['quant']" in repr(plan)


def test_fn_results_are_checked_eagerly():
  model = _model(tf.keras)
  plan = gg.KerasPlan(model).override_gradient("quant",
                                               lambda call, g: [g, g])
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"fn returned 2 gradient\(s\) for quant, which "
                           r"has 1 input"):
    _grads(model, plan)
  plan = gg.KerasPlan(model).override_gradient(
      "quant", lambda call, g: tf.reduce_sum(g))
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"the input of shape \(5, 4\) of quant has shape "
                           r"\(\) float32"):
    _grads(model, plan)


@pytest.mark.parametrize("traced", [False, True])
def test_a_layer_called_twice_is_overridden_at_each_call(traced):
  backward = _tanh_backward(1.0)

  def shared_model(quant_call):
    k = tf.keras
    inp = k.Input((3,))
    quant = _quant_layer(k, quant_call)
    h = k.layers.Dense(4, use_bias=False, name="fc1",
                       kernel_initializer=k.initializers.Constant(W1))(inp)
    h = quant(h)
    h = k.layers.Dense(4, use_bias=False, name="mid",
                       kernel_initializer=k.initializers.Constant(
                           W1.T @ W1))(h)
    out = k.layers.Dense(2, use_bias=False, name="fc2",
                         kernel_initializer=k.initializers.Constant(W2))(
                             quant(h))
    return k.Model(inp, out)

  model = shared_model(quantize)
  plan = gg.KerasPlan(model).override_gradient(
      "quant", lambda call, g: backward(call.inputs[0], g))
  got = _grads(model, plan, traced)
  _close(got, _grads(shared_model(_custom_quant(backward)), traced=traced))


def test_an_overridden_layer_keeps_its_variables_chain_rule_gradients():
  model = _model(tf.keras)
  plain = _grads(model)
  w2 = tf.constant(W2)
  plan = gg.KerasPlan(model).override_gradient(
      "fc2", lambda call, g: 3.0 * tf.matmul(g, w2, transpose_b=True))
  got = _grads(model, plan)
  np.testing.assert_allclose(got[1], plain[1], rtol=RTOL)  # fc2's kernel
  # fc1 gets nothing through the Round below fc2, overridden or not.
  assert got[0] is None

  # With the Round straight-through, fc1 sees fc2's input gradient tripled.
  plan = (gg.KerasPlan(model).straight_through("quant").override_gradient(
      "fc2", lambda call, g: 3.0 * tf.matmul(g, w2, transpose_b=True)))
  got = _grads(model, plan)
  want = _grads(model, gg.KerasPlan(model).straight_through("quant"))
  np.testing.assert_allclose(got[0], 3.0 * want[0], rtol=RTOL)
  np.testing.assert_allclose(got[1], want[1], rtol=RTOL)
