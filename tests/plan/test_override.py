"""override_gradient and straight_through, against TF's own mechanisms."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops  # pylint: disable=g-direct-tensorflow-import

import graphgrad as gg
from helpers import assert_grads_close, dense, evaluate

tf1 = tf.compat.v1
RNG = np.random.default_rng(11)
X = RNG.normal(size=(8, 4)).astype(np.float32)


def _quantize(h, scope, reference):
  """Rounds ``h`` (in [0, 1]) to 8 bits, inside ``scope``'s layer."""
  override = (tf1.get_default_graph().gradient_override_map(
      {"Round": "Identity"}) if reference else contextlib.nullcontext())
  with tf.name_scope(scope + "/quant/"), override:
    return tf.round(h * 255.0) / 255.0


def _qat_model(reference):
  """fc1, fc2 with rounded activations, a head, and a bypass from fc1."""
  tf1.set_random_seed(0)
  x = tf1.placeholder(tf.float32, [None, 4], name="x")
  h1 = _quantize(dense(x, 6, "fc1", tf.sigmoid), "fc1", reference)
  h2 = _quantize(dense(h1, 5, "fc2", tf.sigmoid), "fc2", reference)
  logits = dense(h2, 3, "out")
  loss = tf.reduce_sum(tf.square(logits)) + 0.1 * tf.reduce_sum(h1)
  return x, loss


DECLARATIONS = {
    "none": lambda p: p,
    "upstream_at_the_rounded_layer": lambda p: p.transform_upstream(
        "fc2", gg.transforms.scale(0.5)),
    "two_upstreams": lambda p: p.transform_upstream(
        "fc1", gg.transforms.clip_by_norm(0.01)).transform_upstream(
            "fc2", gg.transforms.scale(3.0)),
    "edge": lambda p: p.transform_edge("fc1", "fc2", gg.transforms.reverse()),
    "parameters": lambda p: p.transform_gradients(
        "fc1", gg.transforms.scale(2.0)),
    "feedback_alignment": lambda p: p.replace_backward(
        "out", gg.backward.feedback_alignment(seed=3)),
}


def _plan_grads(reference, declare, override=None):
  with tf.Graph().as_default():
    x, loss = _qat_model(reference)
    plan = declare(gg.GradientPlan(loss))
    if override is not None:
      override(plan)
    return evaluate([g for g, _ in plan.compute_gradients()], {x: X})


@pytest.mark.parametrize("declare", DECLARATIONS.values(),
                         ids=DECLARATIONS.keys())
def test_straight_through_equals_gradient_override_map(declare):
  expected = _plan_grads(True, declare)
  actual = _plan_grads(False, declare, lambda p: p.straight_through("Round"))
  assert all(np.any(g != 0) for g in actual[:2])  # fc1 learns through Round
  assert_grads_close(actual, expected, rtol=1e-6, atol=1e-7)


def test_an_op_by_object_or_by_name_equals_its_type():
  with tf.Graph().as_default() as g:
    x, loss = _qat_model(False)
    rounds = [op for op in g.get_operations() if op.type == "Round"]
    by_type = gg.GradientPlan(loss).straight_through("Round")
    by_op = gg.GradientPlan(loss).straight_through(rounds[0]).straight_through(
        rounds[1].name)
    only_fc2 = gg.GradientPlan(loss).straight_through(rounds[1])
    a, b = evaluate([[g for g, _ in p.compute_gradients()]
                     for p in (by_type, by_op)], {x: X})
    # Without its own Round overridden, fc1 gets no gradient at all (TF's
    # Round gradient is None), while fc2 learns.
    c = [g for g, _ in only_fc2.compute_gradients()]
    assert c[:2] == [None, None] and c[2] is not None
  assert_grads_close(b, a, rtol=0, atol=0)


def _sign_model(custom):
  tf1.set_random_seed(0)
  x = tf1.placeholder(tf.float32, [None, 4], name="x")
  h = dense(x, 6, "enc")

  @tf.custom_gradient
  def binarize(t):
    return tf.sign(t), lambda dy: dy * tf.cast(tf.abs(t) <= 1.0, dy.dtype)

  s = binarize(h) if custom else tf.sign(h, name="binarize")
  loss = tf.reduce_sum(tf.square(dense(s, 3, "head") - 0.5))
  return x, loss


def _saturating_ste(op, dy):
  """Hubara et al.'s straight-through estimator for sign: 1{|x| <= 1}."""
  t = op.inputs[0]
  return dy * tf.cast(tf.abs(t) <= 1.0, dy.dtype)


@pytest.mark.parametrize("upstream", [False, True])
def test_custom_fn_equals_a_custom_gradient_model(upstream):
  def grads(custom):
    with tf.Graph().as_default():
      x, loss = _sign_model(custom)
      plan = gg.GradientPlan(loss)
      if upstream:
        plan.transform_upstream("head", gg.transforms.scale(0.5))
      if not custom:
        plan.override_gradient("binarize", _saturating_ste)
      return evaluate([g for g, _ in plan.compute_gradients()], {x: X})
  actual, expected = grads(False), grads(True)
  assert np.any(actual[0] != 0)
  assert_grads_close(actual, expected, rtol=1e-6, atol=1e-7)


def test_other_gradient_calls_are_unaffected(graph):
  x, loss = _qat_model(False)
  before = set(tf_ops.gradient_registry.list())
  plan = gg.GradientPlan(loss).straight_through("Round")
  plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1))
  assert set(tf_ops.gradient_registry.list()) == before
  for op in graph.get_operations():
    if op.type == "Round":
      with pytest.raises(ValueError):
        op.get_attr("_gradient_op_type")
  # Through the Round ops, plain tf.gradients still gives nothing.
  logits = graph.get_tensor_by_name("out/BiasAdd:0")
  assert tf.gradients(logits, tf1.trainable_variables("fc1")) == [None, None]


def _squash(op, dy):
  """A gradient function not linear in ``dy``: ``dy * |dy|``."""
  del op
  return dy * tf.abs(dy)


tf_ops.RegisterGradient("GraphgradTestSquash")(_squash)


def _squashed_model(reference, glue):
  """l1 -> l2 -> head, with an overridden op read twice inside l2 (or as
  glue between l1 and l2); l1 also reaches the loss directly."""
  x = tf1.placeholder(tf.float32, [None, 4], name="x")
  h1 = dense(x, 5, "l1", tf.tanh)
  override = (tf1.get_default_graph().gradient_override_map(
      {"Identity": "GraphgradTestSquash"}) if reference
              else contextlib.nullcontext())

  def squashed(t):
    with override:
      q = tf.identity(t, name="squash")
    return tf.tanh(q) + 0.5 * q

  if glue:
    with tf.name_scope("between/"):
      h2 = dense(squashed(h1), 5, "l2")
  else:
    z = dense(h1, 5, "l2")
    with tf.name_scope("l2/"):
      h2 = squashed(z)
  loss = (tf.reduce_sum(tf.square(dense(h2, 3, "head")))
          + 0.1 * tf.reduce_sum(h1))
  return x, h1, h2, loss


@pytest.mark.parametrize("glue", [False, True], ids=["in_layer", "glue"])
def test_a_nonlinear_override_under_a_linear_upstream_rewrite(glue):
  """Both VJPs of l2 (its own variables with g, its input with 0.5 g) go
  through the override, which is not linear: the factor is not moved past
  it. In the layer, an edge rewrite is declared too. The reference
  differentiates each piece with gradient_override_map."""
  edge = 1.0 if glue else 3.0
  with tf.Graph().as_default():
    x, _, _, loss = _squashed_model(False, glue)
    plan = (gg.GradientPlan(loss)
            .override_gradient("l2/squash" if not glue else "between/squash",
                               _squash)
            .transform_upstream("l2", gg.transforms.scale(0.5)))
    if not glue:
      plan.transform_edge("l1", "l2", gg.transforms.scale(edge))
    gv = plan.compute_gradients()
    names = [v.op.name for _, v in gv]
    actual = evaluate([g for g, _ in gv], {x: X})
  expected, wrong = [], []
  for factor, out in ((None, expected), (0.5, wrong)):
    with tf.Graph().as_default():
      x, h1, h2, loss = _squashed_model(True, glue)
      by_name = {v.op.name: v for v in tf1.trainable_variables()}
      l1, l2, head = ([by_name[n] for n in names if n.startswith(p)]
                      for p in ("l1/", "l2/", "head/"))
      (g2,) = tf.gradients(loss, [h2])
      # With ``factor``, 0.5 moved past the override: what a fused
      # linear rewrite would give, and must not.
      (below,) = tf.gradients(h2, [h1],
                              grad_ys=[0.5 * g2 if factor is None else g2])
      if factor is not None:
        below = factor * below
      (bypass,) = tf.gradients(loss, [h1], stop_gradients=[h2])
      out += evaluate(
          tf.gradients(h1, l1, grad_ys=[edge * below + bypass])
          + tf.gradients(h2, l2, grad_ys=[g2]) + tf.gradients(loss, head),
          {x: X})
  assert_grads_close(actual, expected, rtol=1e-6, atol=1e-7)
  assert not np.allclose(wrong[0], expected[0], rtol=1e-3)


def _legacy_graph(path):
  """A graph whose two quantizers have a gradient no process registered."""
  with tf.Graph().as_default() as g:
    x = tf1.placeholder(tf.float32, [None, 4], name="x")
    h = dense(x, 6, "enc", tf.tanh)
    with g.gradient_override_map({"Identity": "LegacyQuantizerGrad"}):
      with tf.name_scope("enc/"):
        h = tf.identity(h, name="quantize")
      h = tf.identity(h, name="requantize")
    tf.identity(tf.reduce_sum(tf.square(dense(h, 3, "head"))), name="loss")
    tf1.train.export_meta_graph(str(path))


def test_imported_graph_without_gradients(tmp_path):
  _legacy_graph(tmp_path / "legacy.meta")
  with tf.Graph().as_default() as g:
    tf1.train.import_meta_graph(str(tmp_path / "legacy.meta"))
    loss = g.get_tensor_by_name("loss:0")
    with pytest.raises(
        gg.GraphGradError,
        match=r"crosses 2 ops with no registered gradient, where tf.gradients "
              r"would stop with LookupError: enc/quantize \(type Identity, "
              r"layer 'enc'\), requantize \(type Identity, glue\)\. .*"
              r"plan\.straight_through\(op\) "
              r".*plan\.override_gradient\(op, fn\)"):
      gg.GradientPlan(loss).compute_gradients()
    with pytest.raises(gg.GraphGradError,
                       match=r"crosses 1 op with no "
                             r"registered gradient.*requantize"):
      gg.GradientPlan(loss).straight_through("enc/quantize").compute_gradients()
    plan = (gg.GradientPlan(loss)
            .override_gradient("enc/quantize", lambda op, dy: 3.0 * dy)
            .straight_through(g.get_operation_by_name("requantize"))
            .transform_upstream("head", gg.transforms.scale(0.5)))
    actual = [gr for gr, _ in plan.compute_gradients()]
    with pytest.raises(LookupError, match="No gradient defined"):
      tf.gradients(loss, tf1.trainable_variables())
    assert g.get_operation_by_name("requantize").get_attr(
        "_gradient_op_type") == b"LegacyQuantizerGrad"
    actual = evaluate(actual, {"x:0": X})
  # Reference: the same network with plain identities; enc gets 3 x 0.5.
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 4])
    h = dense(x, 6, "enc", tf.tanh)
    loss = tf.reduce_sum(tf.square(dense(h, 3, "head")))
    expected = evaluate(tf.gradients(loss, tf1.trainable_variables()), {x: X})
  assert_grads_close(actual[:2], [1.5 * e for e in expected[:2]], rtol=1e-6)
  assert_grads_close(actual[2:], expected[2:], rtol=1e-6)


def test_a_plain_plan_stops_at_the_first_with_lookup_error_in_tf(tmp_path):
  _legacy_graph(tmp_path / "legacy.meta")
  with tf.Graph().as_default() as g:
    tf1.train.import_meta_graph(str(tmp_path / "legacy.meta"))
    with pytest.raises(LookupError, match="requantize"):
      tf.gradients(g.get_tensor_by_name("loss:0"), tf1.trainable_variables())


def test_override_errors(graph):
  x, loss = _qat_model(False)
  other = tf.constant(1.0, name="unused") * 2.0
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError, match=r"`fn` must be a callable "
                                              r"fn\(op, \*output_grads\)"):
    plan.override_gradient("Round", 3)
  with pytest.raises(gg.GraphGradError,
                     match=r"'Quantize' is neither an op "
                           r"name .* Types on that path: .*Round"):
    plan.straight_through("Quantize")
  with pytest.raises(gg.NotConnectedError, match=r"the op mul_1 is not on the "
                                                 r"backward path of"):
    plan.straight_through(other.op.name)
  with pytest.raises(gg.NotConnectedError, match=r"the op unused is not on"):
    plan.straight_through(other.op.inputs[0].op)
  with pytest.raises(gg.GraphGradError, match=r"`op` must be a tf.Operation, "
                                              r"an op name or an op type"):
    plan.straight_through(3)
  with tf.Graph().as_default():
    foreign = tf.round(tf.constant(1.0)).op
  with pytest.raises(gg.GraphGradError, match=r"belongs to another tf.Graph"):
    plan.straight_through(foreign)
  plan.straight_through("Round")
  with pytest.raises(gg.GraphGradError, match=r"'Round' already has a backward "
                                              r"pass in this plan"):
    plan.override_gradient("Round", lambda op, g: g)
  plan.compute_gradients()
  with pytest.raises(gg.GraphGradError, match=r"straight_through: this plan is "
                                              r"already built"):
    plan.straight_through("fc1/quant/Round")


def test_fn_results_are_checked(graph):
  x, loss = _qat_model(False)
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"fn returned 2 gradient\(s\) for fc2/quant/Round, "
                           r"which has 1 input"):
    gg.GradientPlan(loss).override_gradient(
        "Round", lambda op, g: [g, g]).compute_gradients()
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"has shape \(\) float32; the input has shape "
                           r"\(None, 5\)"):
    gg.GradientPlan(loss).override_gradient(
        "Round", lambda op, g: tf.reduce_sum(g)).compute_gradients()


def test_straight_through_needs_a_matching_input(graph):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(x, 6, "enc")
  loss = tf.reduce_sum(tf.square(tf.reshape(h, [-1])))
  with pytest.raises(gg.GraphGradError,
                     match=r"straight_through: no input of Reshape \(type "
                           r"Reshape\) matches an output"):
    gg.GradientPlan(loss).straight_through("Reshape").compute_gradients()


@pytest.mark.parametrize("upstream", [False, True])
def test_an_override_inside_a_v1_loop_equals_gradient_override_map(upstream):
  """TF builds a loop body's gradients in the same call, through the same
  lookup: the override acts in every iteration."""
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top

  def grads(mode):
    with tf.Graph().as_default() as g:
      x = tf1.placeholder(tf.float32, [None, 4])
      h = dense(x, 4, "enc")
      override = (g.gradient_override_map({"Round": "Identity"})
                  if mode == "reference" else contextlib.nullcontext())

      def body(i, h):
        with override:
          return i + 1, tf.round(h * 4.0) * 0.25 + 0.1 * h

      _, h = tf1.while_loop(lambda i, h: i < 2, body, (0, h))
      loss = tf.reduce_sum(tf.square(dense(h, 2, "head")))
      plan = gg.GradientPlan(loss)
      if mode == "plan":
        plan.straight_through("Round")
      if upstream:
        plan.transform_upstream("head", gg.transforms.scale(0.5))
      return evaluate([g for g, _ in plan.compute_gradients()], {x: X})

  was_enabled = control_flow_util.ENABLE_CONTROL_FLOW_V2
  tf1.disable_control_flow_v2()
  try:
    actual, expected, plain = grads("plan"), grads("reference"), grads("none")
  finally:
    if was_enabled:
      tf1.enable_control_flow_v2()
  # Round's own gradient is None: without the override enc gets another one.
  assert not np.allclose(plain[0], expected[0], rtol=1e-3)
  assert_grads_close(actual, expected, rtol=1e-6, atol=1e-7)


def _two_task_model(reference):
  """A trunk whose rounded output feeds two task heads."""
  tf1.set_random_seed(0)
  x = tf1.placeholder(tf.float32, [None, 4], name="x")
  h = dense(x, 6, "trunk", tf.sigmoid)
  with tf.name_scope("heads"):
    q = _quantize(h, "heads", reference)
  la = tf.reduce_sum(tf.square(dense(q, 3, "head_a")))
  lb = tf.reduce_sum(dense(q, 2, "head_b"))
  return x, la, lb


def test_an_override_applies_to_the_task_gradients_of_combine_tasks():
  """Round sits between the trunk and both task losses: the task gradients
  at the trunk go through the override, as gradient_override_map's do."""
  got, want = [], []
  for reference, out in ((False, got), (True, want)):
    with tf.Graph().as_default():
      x, la, lb = _two_task_model(reference)
      plan = gg.GradientPlan(la + lb).combine_tasks(
          "trunk", [la, lb], gg.mtl.mean())
      if not reference:
        plan.straight_through("Round")
      out += evaluate([g for g, _ in plan.compute_gradients()], {x: X})
  trunk_w = got[0]
  assert np.abs(trunk_w).max() > 0
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def test_a_group_transform_returning_too_few_gradients_is_refused(graph):
  class Short(gg.transforms.GroupTransform):
    name = "short"

    def apply_group(self, grads_and_vars, context):
      return [g for g, _ in grads_and_vars][:1]

  x = tf.constant(X)
  loss = tf.reduce_sum(dense(dense(x, 3, "l1"), 2, "l2"))
  plan = gg.GradientPlan(loss).transform_gradients("l2", Short())
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"returned 1 gradients for 2 \(gradient, variable"):
    plan.compute_gradients()
