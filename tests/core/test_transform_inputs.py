"""``transform_inputs`` on both plans, against references built by hand.

The net is ``x -> l1 -> h1 -> l2 -> h2``, ``l3(h1 + h2)``: a skip connection
around ``l2``. ``transform_inputs("l2", fn)`` gives ``h1`` ``fn(dx) + skip``,
with ``dx`` what ``l2``'s VJP gives ``h1`` (of the upstream transform's
result, when ``l2`` has one too) and ``skip`` the gradient through
``h1 + h2``'s first term. The TF1 reference takes ``tf.gradients`` with
``grad_ys`` and ``stop_gradients``; the Keras one a ``tf.GradientTape`` with
``output_gradients``. ``fn`` is applied by hand, in TensorFlow's own ops.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.core._declaration_model import Declarations
from graphgrad.core._rules import Mode, compile_rules
from helpers import dense, evaluate
from keras_cases import FLAVOURS, tanh_chain

tf1 = tf.compat.v1

CLIP = 0.1  # well below the norm of l2's input gradient: the clip acts
X = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)

# name -> (the plan's transform, the same function by hand, linear)
FNS = {
    "clip": (gg.transforms.clip_by_norm(CLIP),
             lambda g: tf.clip_by_norm(g, CLIP)),
    "scale": (gg.transforms.scale(-0.5), lambda g: -0.5 * g),
}
UP = (gg.transforms.clip_by_norm(0.3), lambda g: tf.clip_by_norm(g, 0.3))


@pytest.fixture(params=sorted(FLAVOURS))
def K(request):
  """Each Keras flavour in turn, as in tests/keras."""
  return FLAVOURS[request.param]


def _close(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


# -- GradientPlan --------------------------------------------------------------

def _tf1_net(per_example=False):
  x = tf.constant(X)
  h1 = dense(x, 5, "l1", tf.tanh)
  h2 = dense(h1, 5, "l2", tf.tanh)
  out = dense(h1 + h2, 3, "l3")
  return h1, h2, tf.reduce_sum(tf.square(out), axis=1 if per_example else None)


def _tf1_case(fn, by_hand, up=None):
  """The plan's gradients, the reference, and the norm of ``dx``."""
  with tf.Graph().as_default():
    h1, h2, loss = _tf1_net()
    plan = gg.GradientPlan(loss)
    if up is not None:
      plan.transform_upstream("l2", up[0])
    plan.transform_inputs("l2", fn)
    got = [g for g, _ in plan.compute_gradients()]
    g_h2 = tf.gradients(loss, h2)[0]
    dx = tf.gradients(h2, h1, grad_ys=g_h2 if up is None
                      else up[1](g_h2))[0]
    skip = tf.gradients(loss, h1, stop_gradients=[h2])[0]
    l1 = tf1.trainable_variables("l1/")
    rest = [v for v in tf1.trainable_variables() if v not in l1]
    want = (tf.gradients(h1, l1, grad_ys=by_hand(dx) + skip)
            + tf.gradients(loss, rest))
    return evaluate([got, want, tf.norm(dx)])


@pytest.mark.parametrize("kind", sorted(FNS))
def test_gradient_plan_rewrites_what_l2_sends_to_h1(kind):
  got, want, norm = _tf1_case(*FNS[kind])
  assert norm > 5 * CLIP
  _close(got, want)


def test_gradient_plan_composes_upstream_vjp_then_inputs():
  got, want, _ = _tf1_case(*FNS["clip"], up=UP)
  _close(got, want)


def test_gradient_plan_differs_from_transform_upstream_for_a_clip():
  with tf.Graph().as_default():
    _, _, loss = _tf1_net()
    fn = FNS["clip"][0]
    inputs = gg.GradientPlan(loss).transform_inputs("l2", fn)
    upstream = gg.GradientPlan(loss).transform_upstream("l2", fn)
    scaled = [gg.GradientPlan(loss).transform_inputs("l2", FNS["scale"][0]),
              gg.GradientPlan(loss).transform_upstream("l2", FNS["scale"][0])]
    a, b, c, d = evaluate([[g for g, _ in p.compute_gradients()][:2]
                           for p in [inputs, upstream] + scaled])
  assert not np.allclose(a[0], b[0], rtol=1e-3)  # l1's kernel
  _close(c, d)  # a linear fn: the two agree


def test_gradient_plan_layer_with_two_inputs_rewrites_each():
  with tf.Graph().as_default():
    h1 = dense(tf.constant(X), 5, "l1", tf.tanh)
    h2 = dense(h1, 5, "l2", tf.tanh)
    rng = np.random.default_rng(3)
    with tf1.variable_scope("l3"):
      wa = tf1.get_variable("wa", initializer=rng.normal(
          size=(5, 3)).astype(np.float32))
      wb = tf1.get_variable("wb", initializer=rng.normal(
          size=(5, 3)).astype(np.float32))
      out = tf.matmul(h1, wa) + tf.matmul(h2, wb)
    loss = tf.reduce_sum(tf.square(out))
    plan = gg.GradientPlan(loss).transform_inputs(
        "l3", gg.transforms.clip_by_norm(CLIP))
    got = [g for g, _ in plan.compute_gradients()]
    g_out = tf.gradients(loss, out)[0]
    da = tf.gradients(out, h1, grad_ys=g_out, stop_gradients=[h2])[0]
    db = tf.gradients(out, h2, grad_ys=g_out)[0]
    dh2 = tf.clip_by_norm(db, CLIP)
    l1, l2 = tf1.trainable_variables("l1/"), tf1.trainable_variables("l2/")
    dh1 = tf.clip_by_norm(da, CLIP) + tf.gradients(h2, h1, grad_ys=dh2)[0]
    want = (tf.gradients(h1, l1, grad_ys=dh1)
            + tf.gradients(h2, l2, grad_ys=dh2)
            + tf.gradients(loss, [wa, wb]))
    got, want, norms = evaluate([got, want, [tf.norm(da), tf.norm(db)]])
  assert min(norms) > 5 * CLIP
  _close(got, want)


def test_summaries_show_the_norm_at_the_inputs():
  with tf.Graph().as_default():
    h1, h2, loss = _tf1_net()
    plan = gg.GradientPlan(loss).transform_inputs(
        "l2", gg.transforms.clip_by_norm(CLIP))
    merged = plan.summaries()
    dx = tf.gradients(h2, h1, grad_ys=tf.gradients(loss, h2)[0])[0]
    proto, want = evaluate([merged, tf.norm(dx)])
  values = {v.tag: v.simple_value
            for v in tf1.Summary.FromString(proto).value}
  np.testing.assert_allclose(
      [values["graphgrad/inputs_norm/l2/before"],
       values["graphgrad/inputs_norm/l2/after"]], [want, CLIP], rtol=1e-5)


def test_gradient_plan_linear_layers_keep_the_input_transform():
  # scale(2) above l3 and l2 would run as one span of linear layers (one
  # segment call); l2's input transform must still act at h1.
  with tf.Graph().as_default():
    h1 = dense(tf.constant(X), 5, "l1", tf.tanh)
    h2 = dense(h1, 5, "l2", tf.tanh)
    loss = tf.reduce_sum(tf.square(dense(h2, 3, "l3")))
    plan = gg.GradientPlan(loss)
    for name in ("l3", "l2"):
      plan.transform_upstream(name, gg.transforms.scale(2.0))
    plan.transform_inputs("l2", gg.transforms.clip_by_norm(CLIP))
    got = [g for g, _ in plan.compute_gradients()]
    l1, l2, l3 = (tf1.trainable_variables(f"{n}/")
                  for n in ("l1", "l2", "l3"))
    dx = 4.0 * tf.gradients(loss, h1)[0]
    want = (tf.gradients(h1, l1, grad_ys=tf.clip_by_norm(dx, CLIP))
            + [2.0 * g for g in tf.gradients(loss, l2)]
            + tf.gradients(loss, l3))
    got, want, norm = evaluate([got, want, tf.norm(dx)])
  assert norm > 2 * CLIP  # the clip acts
  _close(got, want)


# -- KerasPlan -----------------------------------------------------------------

def _keras_model(K):
  def dense_layer(units, name, act=None, seed=0):
    init = K.initializers.RandomNormal(stddev=0.6, seed=seed)
    return K.layers.Dense(units, activation=act, name=name,
                          kernel_initializer=init, bias_initializer=init)
  x = K.Input((4,))
  h1 = dense_layer(5, "l1", "tanh", 1)(x)
  h2 = dense_layer(5, "l2", "tanh", 2)(h1)
  out = dense_layer(3, "l3", seed=3)(K.layers.Add()([h1, h2]))
  return K.Model(x, out)


def _keras_reference(model, by_hand, up=None):
  l1, l2, l3 = (model.get_layer(n) for n in ("l1", "l2", "l3"))
  x = tf.constant(X)
  with tf.GradientTape(persistent=True) as tape:
    h1 = l1(x)
    h2 = l2(h1)
    s = h1 + h2
    loss = tf.reduce_sum(tf.square(l3(s)))
  g_h2 = tape.gradient(loss, h2)
  dx = tape.gradient(h2, h1, output_gradients=g_h2 if up is None
                     else up[1](g_h2))
  skip = tape.gradient(loss, s)  # s = h1 + h2: h1's share bypasses l2
  want = (tape.gradient(h1, l1.trainable_variables,
                        output_gradients=by_hand(dx) + skip)
          + tape.gradient(loss, l2.trainable_variables
                          + l3.trainable_variables))
  return [w.numpy() for w in want], float(tf.norm(dx))


def _keras_plan_grads(plan, model):
  with plan.tape() as tape:
    loss = tf.reduce_sum(tf.square(model(tf.constant(X))))
  return [g.numpy() for g in tape.gradient(loss)]


@pytest.mark.parametrize("kind", sorted(FNS))
def test_keras_plan_rewrites_what_l2_sends_to_h1(K, kind):
  fn, by_hand = FNS[kind]
  model = _keras_model(K)
  got = _keras_plan_grads(gg.KerasPlan(model).transform_inputs("l2", fn),
                          model)
  want, norm = _keras_reference(model, by_hand)
  assert norm > 5 * CLIP
  _close(got, want)


def test_keras_plan_composes_upstream_vjp_then_inputs(K):
  fn, by_hand = FNS["clip"]
  model = _keras_model(K)
  plan = gg.KerasPlan(model).transform_upstream("l2", UP[0]).transform_inputs(
      "l2", fn)
  want, _ = _keras_reference(model, by_hand, up=UP)
  _close(_keras_plan_grads(plan, model), want)


def test_keras_plan_linear_layers_keep_the_input_transform(K):
  # scale(2) alone on l2 would run it on scaled inputs, with no backward
  # step of its own; its input transform must still act at h1.
  x = tf.constant(X)
  model = tanh_chain(K, x)
  plan = gg.KerasPlan(model)
  for name in ("l3", "l2"):
    plan.transform_upstream(name, gg.transforms.scale(2.0))
  plan.transform_inputs("l2", gg.transforms.clip_by_norm(CLIP))
  got = _keras_plan_grads(plan, model)
  l1, l2, l3 = model.layers
  with tf.GradientTape(persistent=True) as tape:
    h1 = l1(x)
    loss = tf.reduce_sum(tf.square(l3(l2(h1))))
  dx = 4.0 * tape.gradient(loss, h1)
  assert float(tf.norm(dx)) > 2 * CLIP  # the clip acts
  dh1 = tf.clip_by_norm(dx, CLIP)
  want = (tape.gradient(h1, l1.trainable_variables, output_gradients=dh1)
          + [2.0 * g for g in tape.gradient(loss, l2.trainable_variables)]
          + tape.gradient(loss, l3.trainable_variables))
  _close(got, [w.numpy() for w in want])


def test_keras_plan_layer_with_two_inputs_rewrites_each(K):
  class TwoInputs(K.layers.Layer):
    def build(self, shapes):
      init = K.initializers.RandomNormal
      self.wa = self.add_weight(name="wa", shape=(5, 3),
                                initializer=init(stddev=0.6, seed=4))
      self.wb = self.add_weight(name="wb", shape=(5, 3),
                                initializer=init(stddev=0.6, seed=5))

    def call(self, inputs):
      a, b = inputs
      return tf.matmul(a, self.wa) + tf.matmul(b, self.wb)

  x = K.Input((4,))
  l1, l2 = (K.layers.Dense(
      5, activation="tanh", name=f"l{i}",
      kernel_initializer=K.initializers.RandomNormal(stddev=0.6, seed=i))
      for i in (1, 2))
  l3 = TwoInputs(name="l3")
  h1 = l1(x)
  model = K.Model(x, l3([h1, l2(h1)]))
  plan = gg.KerasPlan(model).transform_inputs(
      "l3", gg.transforms.clip_by_norm(CLIP))
  got = _keras_plan_grads(plan, model)
  with tf.GradientTape(persistent=True) as tape:
    a = l1(tf.constant(X))
    b = l2(a)
    out = l3([a, b])
    loss = tf.reduce_sum(tf.square(out))
  with tf.GradientTape() as own:  # l3's own VJP: a and b as two inputs
    own.watch([a, b])
    alone = l3([a, b])
  da, db = own.gradient(alone, [a, b],
                        output_gradients=tape.gradient(loss, out))
  dh2 = tf.clip_by_norm(db, CLIP)
  dh1 = (tf.clip_by_norm(da, CLIP)
         + tape.gradient(b, a, output_gradients=dh2))
  want = (tape.gradient(a, l1.trainable_variables, output_gradients=dh1)
          + tape.gradient(b, l2.trainable_variables, output_gradients=dh2)
          + tape.gradient(loss, l3.trainable_variables))
  assert min(float(tf.norm(da)), float(tf.norm(db))) > 5 * CLIP
  _close(got, [w.numpy() for w in want])


def test_keras_plan_under_a_loss_scale_clips_the_unscaled_gradient(K):
  # As transform_upstream's: a non-linear fn sees g / S, not refused.
  model = _keras_model(K)
  fn = FNS["clip"][0]
  want = _keras_plan_grads(gg.KerasPlan(model).transform_inputs("l2", fn),
                           model)
  plan = gg.KerasPlan(model).transform_inputs("l2", fn)
  with plan.tape(loss_scale=1024.0) as tape:
    scaled = 1024.0 * tf.reduce_sum(tf.square(model(tf.constant(X))))
  got = [g.numpy() / 1024.0 for g in tape.gradient(scaled)]
  _close(got, want)


# -- the declaration, its rule and its refusals ------------------------------

def test_rule_is_special_and_cuts_on_every_mode():
  d = Declarations(resolve=lambda name, arg: name, owner="GradientPlan")
  d.add_inputs("l2", gg.transforms.scale(2.0))
  d.add_inputs("l2", gg.transforms.scale(3.0))
  d.add_upstream("l3", gg.transforms.scale(0.5))
  d.add_inputs("l3", gg.transforms.identity())
  rules = compile_rules(d)
  l2, l3 = rules.rule("l2"), rules.rule("l3")
  assert l2.mode is Mode.PLAIN and l2.inputs.linear_factor == 6.0
  assert l2.cut and l2.special and l2.rewrites and rules.rewrites_backward
  # An identity composes away: l3 keeps its linear fast path.
  assert l3.mode is Mode.LINEAR and l3.inputs is None and not l3.special
  assert rules.named == ("l2", "l3") and list(rules.inputs) == ["l2"]


def test_refused_with_privatize_on_both_plans(K):
  message = (r"privatize cannot be combined with inputs declarations on "
             r"'l2': transform_inputs acts on the whole batch's gradient")
  with tf.Graph().as_default():
    _, _, loss = _tf1_net(per_example=True)
    plan = gg.GradientPlan(loss).transform_inputs(
        "l2", gg.transforms.clip_by_norm(1.0)).privatize(1.0, 0.0)
    with pytest.raises(gg.GraphGradError, match=message):
      plan.compute_gradients()
  model = _keras_model(K)
  plan = gg.KerasPlan(model).transform_inputs(
      "l2", gg.transforms.clip_by_norm(1.0)).privatize(1.0, 0.0)
  with pytest.raises(gg.GraphGradError, match=message):
    with plan.tape():
      pass


def test_refuses_a_group_transform_and_a_built_plan():
  with tf.Graph().as_default():
    _, _, loss = _tf1_net()
    plan = gg.GradientPlan(loss)
    with pytest.raises(gg.GraphGradError,
                       match=r"transform_inputs: clip_by_global_norm\(1\.0\) "
                             r"is a group transform"):
      plan.transform_inputs("l2", gg.transforms.clip_by_global_norm(1.0))
    with pytest.raises(gg.LayerNotFoundError, match="l9"):
      plan.transform_inputs("l9", gg.transforms.scale(2.0))
    plan.compute_gradients()
    with pytest.raises(gg.GraphGradError, match=r"already built"):
      plan.transform_inputs("l2", gg.transforms.scale(2.0))
  assert not plan.declarations.inputs


_BOTTOM = ("transform_inputs('l1') changes nothing: no layer with trainable "
           "variables lies below 'l1', and its own parameters get the "
           "unmodified upstream gradient.")


def test_bottom_layer_of_a_keras_model_warns_once_by_its_name(K, caplog):
  model = _keras_model(K)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan = gg.KerasPlan(model)
    for _ in range(2):
      plan.transform_inputs("l1", gg.transforms.scale(2.0))
    plan.transform_upstream("l1", gg.transforms.scale(2.0))
  messages = [r.getMessage() for r in caplog.records]
  assert len(messages) == 2
  assert messages[0].startswith(_BOTTOM)
  assert messages[1].startswith("transform_upstream('l1') changes nothing")


def test_bottom_layer_of_a_tf_graph_warns_once_by_its_name(caplog):
  with tf.Graph().as_default():
    _, _, loss = _tf1_net()
    net = gg.analyze(loss)
    with caplog.at_level(logging.WARNING, logger="graphgrad"):
      for _ in range(2):
        gg.GradientPlan(loss, net).transform_inputs(
            "l1", gg.transforms.scale(2.0))
  (message,) = [r.getMessage() for r in caplog.records]
  assert message.startswith(_BOTTOM)


@pytest.mark.parametrize("method,what", [
    ("transform_upstream", "no upstream gradient to rewrite"),
    ("transform_inputs", "no gradient it sends to its inputs")])
def test_a_layer_with_no_float_output_is_refused_by_its_name(method, what):
  """``picker``'s only output on the way to the loss is an argmax."""
  with tf.Graph().as_default():
    x = tf.constant(X[:, :3])
    with tf1.variable_scope("picker"):
      w = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
      idx = tf.argmax(tf.matmul(x, w), axis=1)
    with tf1.variable_scope("emb"):
      e = tf1.get_variable("e", initializer=np.ones((3, 2), np.float32))
      loss = tf.reduce_sum(tf.square(tf.gather(e, idx)))
    plan = gg.GradientPlan(loss)
    with pytest.raises(gg.GraphGradError) as raised:
      getattr(plan, method)("picker", gg.transforms.scale(2.0))
  assert str(raised.value) == (
      f"{method}: layer 'picker' has no floating-point output on the way to "
      f"the loss, so there is {what}. Use transform_gradients('picker', fn) "
      f"for its parameter gradients.")
  assert not plan.declarations.upstream and not plan.declarations.inputs


def test_the_advice_and_the_loss_scale_policy_read_it_with_the_others(
    caplog):
  # What reads transforms by their linearity reads transform_inputs too,
  # from the compiled rules, with no list of kinds of its own.
  from graphgrad.core._logged_advice import log_if_scaled
  from graphgrad.keras._loss_scale import nonlinear
  d = Declarations(resolve=lambda name, arg: name, owner="GradientPlan")
  d.add_inputs("l2", gg.transforms.scale(0.5))
  scaled = compile_rules(d)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    assert log_if_scaled(scaled, "AdamOptimizer")
  assert "transform_inputs('l2') scales by 0.5 under AdamOptimizer" in (
      caplog.text)
  assert not nonlinear(scaled)
  d.add_inputs("l1", gg.transforms.clip_by_norm(1.0))
  assert nonlinear(compile_rules(d))
