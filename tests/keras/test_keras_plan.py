"""KerasPlan: TF2 gradients equal the TF1 plan's and hand-built references.

Both Keras flavours run here: ``tf.keras`` is tf-keras (conftest sets
TF_USE_LEGACY_KERAS=1) and ``keras`` is the Keras 3 package.
"""

import logging
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import keras_cases
from graphgrad import _compat
from graphgrad.core import _rules
from helpers import evaluate

tf1 = tf.compat.v1

RTOL, ATOL = 1e-5, 1e-6  # float32, same weights and batch



@pytest.mark.skipif(_compat.TF_VERSION < (2, 16),
                    reason="TF 2.15 has only its bundled Keras 2; the two "
                           "flavours exist from TF 2.16 on")
def test_both_keras_flavours_are_exercised():
  legacy = tf.keras.layers.Dense(1)
  modern = keras.layers.Dense(1)
  assert type(legacy).__module__.startswith("tf_keras")
  assert type(modern).__module__.startswith("keras.src")
  assert keras.__version__.startswith("3.")


# -- TF2 path equals the TF1 plan on the equivalent graph ----------------------


def _as_list(out):
  return list(out) if isinstance(out, (list, tuple)) else [out]


def _keras_grads(case, model, x, labels, mode, declare=True):
  plan = gg.KerasPlan(model)
  if declare:
    case.declare(plan, gg)

  def step(x):
    with plan.tape() as tape:
      loss = case.loss(_as_list(model(x)), labels)
    return tape.gradient(loss)

  if mode == "function":
    step = tf.function(step)
  grads = step(tf.constant(x))
  by_var = {id(v): g for v, g in zip(model.trainable_variables, grads)}
  return {l.name: [np.asarray(by_var[id(v)]) for v in l.trainable_weights]
          for l in model.layers if l.trainable_weights}


def _tf1_grads(case, weights, x, labels, declare=True):
  with tf.Graph().as_default():
    xp = tf1.placeholder(tf.float32, [None, case.inputs])
    outs = case.forward(keras_cases.TF1Ops(weights), xp)
    loss = case.loss(outs, [tf.constant(l) for l in labels])
    plan = gg.GradientPlan(loss)
    if declare:
      case.declare(plan, gg)
    gv = plan.compute_gradients()
    values = evaluate([g for g, _ in gv], {xp: x})
  out = {}
  for (_, v), value in zip(gv, values):
    out.setdefault(v.op.name.rsplit("/", 1)[0], []).append(value)
  return out


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name", sorted(keras_cases.CASES))
def test_tf2_plan_equals_tf1_plan(K, name, mode):
  case = keras_cases.CASES[name]
  model = keras_cases.keras_model(case, K)
  x, labels = keras_cases.batch(case)
  weights = keras_cases.layer_weights(model)
  got = _keras_grads(case, model, x, labels, mode)
  want = _tf1_grads(case, weights, x, labels)
  plain = _tf1_grads(case, weights, x, labels, declare=False)
  assert sorted(got) == sorted(want)
  changed = False
  for layer in want:
    for a, e, p in zip(got[layer], want[layer], plain[layer]):
      np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL, err_msg=layer)
      changed |= not np.allclose(e, p)
  assert changed  # the plan really rewrote something


def test_two_heads_tf1_reference_by_hand():
  # The edge reversal, built by hand with grad_ys and stop_gradients; the
  # Keras plan is compared with it directly, not only through the TF1 plan.
  case = keras_cases.TwoHeads
  model = keras_cases.keras_model(case, tf.keras)
  x, labels = keras_cases.batch(case, seed=3)
  weights = keras_cases.layer_weights(model)
  got = _keras_grads(case, model, x, labels, "eager")
  with tf.Graph().as_default():
    ops = keras_cases.TF1Ops(weights)
    xc = tf.constant(x)
    base = ops.dense(xc, 8, "base", "tanh")
    feats = ops.dense(base, 6, "features", "tanh")
    head, dom = ops.dense(feats, 3, "head"), ops.dense(feats, 2, "domain_head")
    loss = case.loss([head, dom], [tf.constant(l) for l in labels])
    scoped = lambda s: tf1.get_collection(  # noqa: E731
        tf1.GraphKeys.TRAINABLE_VARIABLES, s + "/")
    g_dom = tf.gradients(loss, dom)[0]
    g_head = tf.gradients(loss, head)[0]
    # domain_head's upstream scale(2), then the edge reverse(0.3), then the
    # sum with the head's share at the features' output.
    at_feats = (tf.gradients(head, feats, grad_ys=g_head)[0]
                - 0.3 * tf.gradients(dom, feats, grad_ys=2.0 * g_dom)[0])
    want = {
        "head": tf.gradients(loss, scoped("head")),
        "domain_head": tf.gradients(loss, scoped("domain_head")),
        "features": tf.gradients(feats, scoped("features"), grad_ys=at_feats),
        "base": tf.gradients(feats, scoped("base"),
                             grad_ys=keras_cases.nonlinear(at_feats)),
    }
    want = evaluate(want)
  for layer, grads in want.items():
    for a, e in zip(got[layer], grads):
      np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL, err_msg=layer)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_identity_plan_equals_tape_gradient(K, mode):
  case = keras_cases.Skip
  model = keras_cases.keras_model(case, K)
  x, labels = keras_cases.batch(case)
  plan = (gg.KerasPlan(model)
          .transform_upstream("l2", gg.transforms.identity())
          .transform_gradients("l3", gg.transforms.identity()))
  forced = (gg.KerasPlan(model)  # not recognised as identity: intercepted
            .transform_upstream("l2", lambda g: g)
            .transform_upstream("l3", lambda g: g))

  def step(x):
    with tf.GradientTape() as tape:
      loss = case.loss(_as_list(model(x)), labels)
    expected = tape.gradient(loss, model.trainable_variables)
    out = []
    for p in (plan, forced):
      with p.tape() as t:
        loss = case.loss(_as_list(model(x)), labels)
      out.append(t.gradient(loss))
    return expected, out

  if mode == "function":
    step = tf.function(step)
  expected, (same, via_custom) = step(tf.constant(x))
  for e, a, b in zip(expected, same, via_custom):
    np.testing.assert_array_equal(a, e)
    np.testing.assert_allclose(b, e, rtol=RTOL, atol=ATOL)


# -- the seed model in three Keras styles --------------------------------------


def _seed_model(K, style):
  def dense(units, name):
    return K.layers.Dense(
        units, name=name,
        kernel_initializer=K.initializers.RandomNormal(seed=len(name)))

  if style == "subclassed":
    class TwoLayerModel(K.Model):  # the seed's model, unchanged

      def __init__(self):
        super().__init__()
        self.l1_dense = dense(20, "l1_dense")
        self.l2_dense = dense(2, "l2_dense")

      def call(self, x):
        return self.l2_dense(self.l1_dense(x))

    return TwoLayerModel()
  if style == "sequential":
    return K.Sequential([dense(20, "l1_dense"), dense(2, "l2_dense")])
  inp = K.Input((10,))
  return K.Model(inp, dense(2, "l2_dense")(dense(20, "l1_dense")(inp)))


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("style", ["subclassed", "sequential", "functional"])
def test_seed_recipe_in_every_keras_style(K, style, mode):
  model = _seed_model(K, style)
  rng = np.random.default_rng(5)
  x = tf.constant(rng.normal(size=(32, 10)).astype(np.float32))
  y = tf.one_hot(rng.integers(0, 2, 32), 2)
  model(x)  # build, for the reference below
  l1, l2 = model.get_layer("l1_dense"), model.get_layer("l2_dense")
  loss_fn = lambda y, logits: tf.reduce_mean(  # noqa: E731
      tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits))

  # The seed's recipe, done right: call the layers by hand to see l2's output.
  with tf.GradientTape(persistent=True) as tape:
    out = l2(l1(x))
    loss = loss_fn(y, out)
  g = tape.gradient(loss, out)
  want = (tape.gradient(out, l1.trainable_variables,
                        output_gradients=keras_cases.nonlinear(g))
          + [0.8 * w for w in tape.gradient(loss, l2.trainable_variables)])

  plan = gg.KerasPlan(model)
  plan.transform_upstream("l2_dense", keras_cases.nonlinear)
  plan.transform_gradients("l2_dense", gg.transforms.scale(0.8))

  def step(x, y):
    with plan.tape() as tape:
      loss = loss_fn(y, model(x))
    return tape.gradient(loss)

  if mode == "function":
    step = tf.function(step)
  got = dict(zip([id(v) for v in model.trainable_variables], step(x, y)))
  order = l1.trainable_variables + l2.trainable_variables
  for v, w in zip(order, want):
    np.testing.assert_allclose(got[id(v)], w, rtol=RTOL, atol=ATOL)
  assert "call" not in vars(l1) and "call" not in vars(l2)  # restored


# -- tf.function: one trace ----------------------------------------------------


@pytest.mark.parametrize("name", ["chain", "two_heads"])
def test_tf_function_does_not_retrace(K, name):
  case = keras_cases.CASES[name]
  model = keras_cases.keras_model(case, K)
  plan = case.declare(gg.KerasPlan(model), gg)
  optimizer = K.optimizers.SGD(0.01, momentum=0.9)
  # Slots made before tracing: tf.function traces twice when the first
  # trace creates variables, with or without graphgrad.
  optimizer.build(model.trainable_variables)
  traces = []

  @tf.function
  def train_step(x, labels):
    traces.append(1)
    with plan.tape() as tape:
      loss = case.loss(_as_list(model(x)), labels)
    optimizer.apply_gradients(zip(tape.gradient(loss),
                                  model.trainable_variables))
    return loss

  losses = []
  for seed in range(4):
    x, labels = keras_cases.batch(case, seed=seed)
    losses.append(float(train_step(tf.constant(x),
                                   [tf.constant(l) for l in labels])))
  assert len(traces) == 1
  assert len(set(losses)) == 4  # it did train on four batches


def test_tf_function_traces_the_plan_without_autograph_warnings(K):
  # AutoGraph warned at each trace that it could not convert the tape's
  # parameter step (notebook 04 showed it).
  model = keras_cases.keras_model(keras_cases.CASES["chain"], K)
  plan = gg.KerasPlan(model).transform_gradients(
      "l2", gg.transforms.clip_by_norm(1e-3))
  x = tf.constant(np.random.default_rng(0).normal(size=(4, 6)), tf.float32)

  @tf.function
  def grads(x):
    with plan.tape() as tape:
      loss = tf.reduce_sum(tf.square(model(x)))
    return tape.gradient(loss)

  records = []
  handler = logging.Handler()
  handler.emit = records.append
  tf_logger = logging.getLogger("tensorflow")
  tf_logger.addHandler(handler)
  try:
    got = grads(x)
  finally:
    tf_logger.removeHandler(handler)
  assert not [r for r in records if "AutoGraph" in r.getMessage()]
  by_id = dict(zip([id(v) for v in model.trainable_variables], got))
  kernel = model.get_layer("l2").trainable_variables[0]
  np.testing.assert_allclose(np.linalg.norm(by_id[id(kernel)]), 1e-3,
                             rtol=1e-5)  # the step ran: l2's kernel clipped


# -- nesting and repeated calls ------------------------------------------------


def _nested_model(K):
  ops = keras_cases.KerasOps(K)
  inner_in = K.Input((5,))
  block = K.Model(inner_in, ops.dense(ops.dense(inner_in, 4, "inner", "tanh"),
                                      4, "top", "tanh"), name="block")
  inp = K.Input((3,))
  return K.Model(inp, ops.dense(block(ops.dense(inp, 5, "stem", "tanh")), 2,
                                "out"))


def test_nested_layers_by_name_and_path(K):
  model = _nested_model(K)
  x = tf.constant(np.random.default_rng(2).normal(size=(8, 3)), tf.float32)
  model(x)
  block = model.get_layer("block")
  stem, inner, top = (model.get_layer("stem"), block.get_layer("inner"),
                      block.get_layer("top"))
  with tf.GradientTape(persistent=True) as tape:
    s = stem(x)
    h = inner(s)
    t = top(h)
    loss = tf.reduce_sum(tf.square(model.get_layer("out")(t)))
  g_t = tape.gradient(loss, t)
  # "top" (by path) scales by 2 what reaches "inner"; "inner" (by name)
  # scales by -1 what reaches "stem"; the container "block" by 0.5.
  # The block's own variables (inner's included) see the block's plain
  # gradient, still rewritten by "top" above them; its input sees 0.5 of it.
  below_top = tape.gradient(t, h, output_gradients=2.0 * g_t)
  want_inner = tape.gradient(h, inner.trainable_variables,
                             output_gradients=below_top)
  want_stem = tape.gradient(h, stem.trainable_variables,
                            output_gradients=-0.5 * below_top)
  plan = (gg.KerasPlan(model)
          .transform_upstream("block", gg.transforms.scale(0.5))
          .transform_upstream("block/top", gg.transforms.scale(2.0))
          .transform_upstream("inner", gg.transforms.scale(-1.0)))
  assert "block/inner" in plan.layer_names
  want_top = tape.gradient(loss, top.trainable_variables)
  with plan.tape() as pt:
    loss = tf.reduce_sum(tf.square(model(x)))
  got = dict(zip([id(v) for v in model.trainable_variables], pt.gradient(loss)))
  for v, w in zip(stem.trainable_variables + inner.trainable_variables
                  + top.trainable_variables, want_stem + want_inner + want_top):
    np.testing.assert_allclose(got[id(v)], w, rtol=RTOL, atol=ATOL)


def test_a_layer_called_twice_is_rewritten_at_each_call(K):
  shared = K.layers.Dense(3, name="shared", kernel_initializer="glorot_normal")
  a = K.layers.Dense(4, name="a", activation="tanh")
  b = K.layers.Dense(4, name="b", activation="tanh")
  inp = K.Input((5,))
  model = K.Model(inp, [shared(a(inp)), shared(b(inp))])
  x = tf.constant(np.random.default_rng(4).normal(size=(6, 5)), tf.float32)
  clip = gg.transforms.clip_by_norm(0.1)
  loss_of = lambda o: (tf.reduce_sum(tf.sin(o[0]))  # noqa: E731
                       + tf.reduce_sum(tf.square(o[1])))
  model(x)
  with tf.GradientTape(persistent=True) as tape:
    ha, hb = a(x), b(x)
    oa, ob = shared(ha), shared(hb)
    loss = loss_of([oa, ob])
  ga, gb = tape.gradient(loss, [oa, ob])
  want_a = tape.gradient(oa, a.trainable_variables,
                         output_gradients=tf.clip_by_norm(ga, 0.1))
  want_b = tape.gradient(ob, b.trainable_variables,
                         output_gradients=tf.clip_by_norm(gb, 0.1))
  want_shared = tape.gradient(loss, shared.trainable_variables)
  plan = gg.KerasPlan(model).transform_upstream("shared", clip)
  with plan.tape() as pt:
    loss = loss_of(model(x))
  got = dict(zip([id(v) for v in model.trainable_variables], pt.gradient(loss)))
  for v, w in zip(a.trainable_variables + b.trainable_variables
                  + shared.trainable_variables, want_a + want_b + want_shared):
    np.testing.assert_allclose(got[id(v)], w, rtol=RTOL, atol=ATOL)


def test_identity_plan_traces_the_plain_graph(K):
  # The cost claim behind the benchmark, without timing: an identity plan
  # intercepts nothing, so its traced step has exactly the plain step's ops.
  case = keras_cases.Chain
  model = keras_cases.keras_model(case, K)
  x, labels = keras_cases.batch(case)
  plan = (gg.KerasPlan(model)
          .transform_upstream("l2", gg.transforms.identity())
          .transform_gradients("l1", gg.transforms.identity()))

  @tf.function
  def plain(x):
    with tf.GradientTape() as tape:
      loss = case.loss(_as_list(model(x)), labels)
    return tape.gradient(loss, model.trainable_variables)

  @tf.function
  def planned(x):
    with plan.tape() as tape:
      loss = case.loss(_as_list(model(x)), labels)
    return tape.gradient(loss)

  ops = [sorted(op.type for op in f.get_concrete_function(
      tf.constant(x)).graph.get_operations()) for f in (plain, planned)]
  assert ops[0] == ops[1]


def test_persistent_tape_gives_the_same_gradients_twice(K):
  case = keras_cases.TwoHeads
  model = keras_cases.keras_model(case, K)
  x, labels = keras_cases.batch(case)
  plan = case.declare(gg.KerasPlan(model), gg)
  with plan.tape(persistent=True) as tape:
    loss = case.loss(_as_list(model(tf.constant(x))), labels)
  first, second = tape.gradient(loss), tape.gradient(loss)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a, b)
  heads = model.get_layer("head").trainable_variables
  only_head = tape.gradient(loss, heads)  # other sources, as GradientTape
  for v, g in zip(heads, only_head):
    np.testing.assert_array_equal(
        g, first[[id(w) for w in model.trainable_variables].index(id(v))])


def test_the_rules_are_compiled_once_per_state_of_the_declarations(K):
  model = K.Sequential([K.Input((3,)), K.layers.Dense(4, name="l1"),
                        K.layers.Dense(2, name="l2")])
  x = tf.ones([2, 3])
  plan = gg.KerasPlan(model)
  scale = 64.0
  with mock.patch.object(_rules, "compile_rules",
                         wraps=_rules.compile_rules) as compiled:
    first = plan.rules
    assert plan.rules is first and plan.rules is first
    assert compiled.call_count == 1
    plan.transform_upstream("l2", gg.transforms.scale(0.5))
    assert plan.rules.rule("l2").factor == 0.5  # the next read sees it
    assert compiled.call_count == 2
    for _ in range(2):  # steps read the rules compiled already
      with plan.tape() as tape:
        loss = tf.reduce_sum(model(x))
      tape.gradient(loss)
    assert compiled.call_count == 2
    for _ in range(2):  # a loss scale is compiled in, once
      with plan.tape(loss_scale=scale) as tape:
        loss = tf.reduce_sum(model(x)) * scale
      tape.gradient(loss)
    assert plan.rules.loss_scale is None
    assert compiled.call_count == 3
