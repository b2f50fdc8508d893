"""gg.gradient_report on a Keras model: the figures of the graph's report.

Each case of ``keras_cases`` is built as a TF1 graph and as a Keras model
with the same weights and the same declarations. The TF1 report (run in a
Session) and the Keras one (run in a ``tf.function``, tf-keras and Keras 3)
must have the same rows, figures (``before`` and ``after``, to
``rtol=1e-5``) and flags. References built by hand with ``GradientTape``
check the Keras figures themselves.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import keras_cases
from keras_cases import FLAVOURS

tf1 = tf.compat.v1
RTOL, ATOL = 1e-5, 1e-7
FIGURES = ("grad_norm", "grad_to_weight", "upstream_norm", "zero_upstream")


def _tf1_report(case, weights, x, labels):
  with tf.Graph().as_default():
    outs = case.forward(keras_cases.TF1Ops(weights), tf.constant(x))
    loss = case.loss(outs, [tf.constant(l) for l in labels])
    net = gg.analyze(loss)
    plan = case.declare(gg.GradientPlan(loss, net), gg)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      return gg.gradient_report(sess, net, plan=plan)


def _loss(case, model, labels):
  def loss(x):
    outs = model(x)
    return case.loss(outs if isinstance(outs, list) else [outs],
                     [tf.constant(l) for l in labels])
  return loss


def _assert_same(actual, expected):
  """Row by row; the order may differ where two layers are not ordered
  (each report lists them in its own topological order)."""
  assert sorted(r["name"] for r in actual.layers) == sorted(
      r["name"] for r in expected.layers)
  for e in expected.layers:
    a = actual[e["name"]]
    assert a["params"] == e["params"] and a["flag"] == e["flag"], a["name"]
    for key in FIGURES:
      for side in ("before", "after"):
        if e[key][side] is None:
          assert a[key][side] is None, (a["name"], key, side)
        else:
          np.testing.assert_allclose(a[key][side], e[key][side], rtol=RTOL,
                                     atol=ATOL,
                                     err_msg=f"{a['name']} {key} {side}")


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("shape", sorted(keras_cases.CASES))
def test_the_keras_report_is_the_graph_report(shape, flavour):
  case = keras_cases.CASES[shape]
  model = keras_cases.keras_model(case, FLAVOURS[flavour])
  x, labels = keras_cases.batch(case)
  expected = _tf1_report(case, keras_cases.layer_weights(model), x, labels)
  assert expected.has_plan
  plan = case.declare(gg.KerasPlan(model), gg)
  actual = gg.gradient_report(model, _loss(case, model, labels),
                              tf.constant(x), plan=plan)
  assert actual.has_plan and actual.batches == 1
  _assert_same(actual, expected)


def test_the_chain_figures_are_the_hand_recipes():
  """Chain: l3's upstream scaled by 2, l2's by ``nonlinear``, l1's
  parameter gradients halved."""
  case = keras_cases.Chain
  model = keras_cases.keras_model(case, FLAVOURS["keras3"])
  x, labels = keras_cases.batch(case)
  report = gg.gradient_report(model, _loss(case, model, labels),
                              tf.constant(x),
                              plan=case.declare(gg.KerasPlan(model), gg))
  by_hand = keras_cases.chain_by_hand(model, x, labels)
  norm = lambda ts: float(tf.linalg.global_norm(ts))  # noqa: E731
  plain_h1 = by_hand["h1_plain"]
  l1 = model.get_layer("l1")
  expected = {
      ("l1", "grad_norm", "before"): norm(by_hand["l1_plain"]),
      ("l1", "grad_norm", "after"): 0.5 * norm(by_hand["l1"]),
      ("l1", "upstream_norm", "before"): norm([plain_h1]),
      ("l1", "zero_upstream", "before"): float(np.mean(
          plain_h1.numpy() == 0)),
      ("l1", "grad_to_weight", "before"): norm(by_hand["l1_plain"]) / norm(
          l1.trainable_variables),
      ("l3", "upstream_norm", "before"): norm([by_hand["out"]]),
      ("l3", "upstream_norm", "after"): 2.0 * norm([by_hand["out"]]),
      ("l2", "upstream_norm", "after"): norm([by_hand["h2_after"]]),
  }
  for (layer, key, side), value in expected.items():
    np.testing.assert_allclose(report[layer][key][side], value, rtol=RTOL,
                               err_msg=f"{layer} {key} {side}")
  assert report["l1"]["upstream_norm"]["after"] is None  # no rewrite there
  assert report.flagged() == {}


def test_batches_average_the_per_batch_figures():
  model = keras_cases.two_dense(FLAVOURS["keras3"], seed=2)
  batches = [(keras_cases.normal_rows(i), keras_cases.normal_rows(
      10 + i, (5, 2))) for i in range(3)]
  loss = lambda x, y: tf.reduce_mean(tf.square(model(x) - y))  # noqa: E731
  by_list = gg.gradient_report(model, loss, batches, batches=3)
  by_fn = gg.gradient_report(model, loss, lambda i: batches[i], batches=3)
  per_batch = []
  for x, y in batches:
    with tf.GradientTape() as tape:
      value = loss(x, y)
    per_batch.append(float(tf.linalg.global_norm(tape.gradient(
        value, model.get_layer("l2").trainable_variables))))
  for report in (by_list, by_fn):
    assert not report.has_plan and report.batches == 3
    np.testing.assert_allclose(report["l2"]["grad_norm"]["before"],
                               np.mean(per_batch), rtol=RTOL)
    assert report["l2"]["grad_norm"]["after"] is None


def test_a_layer_without_any_gradient_is_flagged():
  K = FLAVOURS["keras3"]
  inp = K.Input((3,))
  h = K.layers.Dense(4, name="l1")(inp)
  h = K.layers.Lambda(tf.round, name="round")(h)
  model = K.Model(inp, K.layers.Dense(2, name="l2")(h))
  loss = lambda x: tf.reduce_sum(tf.square(model(x)))  # noqa: E731
  x = keras_cases.normal_rows(0)
  report = gg.gradient_report(model, loss, x)
  assert report["l1"]["grad_norm"]["before"] is None
  assert report.flagged() == {"l1": "no gradient"}
  mended = gg.KerasPlan(model).straight_through("round")
  with_plan = gg.gradient_report(model, loss, x, plan=mended)
  assert with_plan["l1"]["grad_norm"]["after"] > 0
  assert with_plan.flagged() == {}


def test_layers_feed_each_other_through_layers_without_variables():
  """l1 -> l2, and add(l1, l2) -> l3: l2 feeds l3 only through the
  addition, as in the graph's layer graph. With l3's kernel tiny, the
  gradients of l1 and l2 pass through it and vanish; l3's own, with its
  small weights, is normal."""
  case = keras_cases.Skip
  model = keras_cases.keras_model(case, FLAVOURS["keras3"])
  x, labels = keras_cases.batch(case)
  l3 = model.get_layer("l3")
  kernel, bias = l3.get_weights()
  l3.set_weights([kernel * 1e-6, bias])
  report = gg.gradient_report(model, _loss(case, model, labels),
                              tf.constant(x))
  expected = _tf1_report_plain(case, keras_cases.layer_weights(model), x,
                               labels)
  assert report.flagged() == expected.flagged() == {
      "l1": "vanishing", "l2": "vanishing"}
  assert report["l3"]["grad_norm"]["before"] > 0.1
  _assert_same(report, expected)


@pytest.mark.parametrize("name", sorted(keras_cases.FLAGGED_CHAINS))
def test_flags_say_where_the_gradient_vanishes_or_explodes(name):
  """keras_cases.FLAGGED_CHAINS, whose gradients tests/plan/test_report.py
  checks against their construction."""
  chain, expected = keras_cases.FLAGGED_CHAINS[name]
  model = chain.keras_model(FLAVOURS["keras3"])
  x, labels = keras_cases.batch(chain)
  loss = _loss(chain, model, labels)
  report = gg.gradient_report(model, loss, tf.constant(x))
  with tf.GradientTape() as tape:
    value = loss(tf.constant(x))
  layers = [model.get_layer(n) for n in chain.weights]
  grads = tape.gradient(value, [l.trainable_variables for l in layers])
  assert [r["name"] for r in report.layers] == list(chain.weights)
  for layer, g in zip(layers, grads):
    np.testing.assert_allclose(report[layer.name]["grad_norm"]["before"],
                               float(tf.linalg.global_norm(g)), rtol=RTOL,
                               err_msg=layer.name)
  assert report.flagged() == expected


def _tf1_report_plain(case, weights, x, labels):
  with tf.Graph().as_default():
    outs = case.forward(keras_cases.TF1Ops(weights), tf.constant(x))
    loss = case.loss(outs, [tf.constant(l) for l in labels])
    net = gg.analyze(loss)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      return gg.gradient_report(sess, net)


def test_bad_arguments():
  K = FLAVOURS["keras3"]
  model = keras_cases.two_dense(K, seed=0)
  other = keras_cases.two_dense(K, seed=1)
  loss = lambda: tf.reduce_sum(model(keras_cases.normal_rows(0)))  # noqa
  with pytest.raises(gg.GraphGradError, match="the second argument must be "
                                              "the loss, a callable"):
    gg.gradient_report(model, 3.0)
  with pytest.raises(gg.GraphGradError, match="`plan` must be a gg.KerasPlan"):
    gg.gradient_report(model, loss, plan=gg.KerasPlan(other))
  with pytest.raises(gg.GraphGradError, match="must hold `batches`=2"):
    gg.gradient_report(model, loss, [()], batches=2)
  with pytest.raises(gg.GraphGradError, match="`batches` must be a pos"):
    gg.gradient_report(model, loss, batches=0)
  unbuilt = K.Sequential([K.layers.Dense(2)])
  with pytest.raises(gg.GraphGradError, match="has no weights yet"):
    gg.gradient_report(unbuilt, loss)
  flat = K.Sequential([K.Input((3,)), K.layers.Flatten()])
  with pytest.raises(gg.GraphGradError, match="no layer with trainable"):
    gg.gradient_report(flat, lambda: tf.reduce_sum(flat(tf.ones([1, 3]))))


def test_a_plan_with_tasks_takes_them_from_the_loss():
  """Two heads, PCGrad at the shared features: the loss function returns
  the two task losses, as the graph's plan declares them."""
  case = keras_cases.TwoHeads
  model = keras_cases.keras_model(case, FLAVOURS["keras3"])
  x, labels = keras_cases.batch(case)
  ce = lambda y, o: tf.reduce_mean(  # noqa: E731
      tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=o))
  weights = keras_cases.layer_weights(model)
  with tf.Graph().as_default():
    outs = case.forward(keras_cases.TF1Ops(weights), tf.constant(x))
    tasks = [ce(tf.constant(l), o) for l, o in zip(labels, outs)]
    net = gg.analyze(tf.add_n(tasks))
    plan = gg.GradientPlan(net.loss, net).project_conflicts("features", tasks)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      expected = gg.gradient_report(sess, net, plan=plan)

  def task_losses(x):
    return [ce(tf.constant(l), o) for l, o in zip(labels, model(x))]

  keras_plan = gg.KerasPlan(model).project_conflicts("features")
  actual = gg.gradient_report(model, task_losses, tf.constant(x),
                              plan=keras_plan)
  _assert_same(actual, expected)
  assert actual["base"]["grad_norm"]["after"] != pytest.approx(
      actual["base"]["grad_norm"]["before"])
  with pytest.raises(gg.GraphGradError, match="Return them from `loss` as a"):
    gg.gradient_report(model, lambda x: tf.add_n(task_losses(x)),
                       tf.constant(x), plan=keras_plan)


def test_the_report_changes_no_variable():
  """A loss that runs batch norm in training mode updates its moving
  statistics; the report puts them back."""
  K = FLAVOURS["keras3"]
  inp = K.Input((3,))
  h = K.layers.BatchNormalization(name="bn")(K.layers.Dense(4, name="l1")(inp))
  model = K.Model(inp, K.layers.Dense(2, name="l2")(h))
  before = [np.array(v) for v in model.variables]
  loss = lambda x: tf.reduce_sum(model(x, training=True))  # noqa: E731
  plan = gg.KerasPlan(model).transform_upstream("l2",
                                                gg.transforms.scale(0.5))
  report = gg.gradient_report(model, loss, keras_cases.normal_rows(0) + 3.0,
                              plan=plan, batches=2)
  assert report["bn"]["grad_norm"]["before"] > 0
  for v, value in zip(model.variables, before):
    np.testing.assert_array_equal(np.array(v), value)
