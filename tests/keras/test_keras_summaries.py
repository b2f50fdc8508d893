"""KerasPlan.summaries(): the figures of GradientPlan.summaries(), in parity.

Each case of ``keras_cases`` is built as a TF1 graph and as a Keras model
with the same weights, and declared the same on both plans, with two
parameter transforms on one layer besides (a per-tensor one after a group
one). The TF1 plan's merged summary, run in a Session, and the KerasPlan's
figures (eager and in a ``tf.function``, tf-keras and Keras 3) must have the
same tags and values to ``rtol=1e-5``; the event files written hold the
same. A reference built by hand with ``GradientTape`` checks the figures of
the chain themselves.
"""

import glob
import importlib.util
import logging

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import keras_cases
from keras_cases import FLAVOURS

tf1 = tf.compat.v1
RTOL, ATOL = 1e-5, 1e-6


def _declare(case, plan):
  """The case's declarations and two parameter transforms on l1 (or base)."""
  plan = case.declare(plan, gg)
  first = {keras_cases.TwoHeads: "base",
           keras_cases.GlueEdge: "features"}.get(case, "l1")
  clip = gg.transforms.clip_by_global_norm(0.01)
  return (plan.transform_gradients(first, clip)
          .transform_gradients(first, gg.transforms.scale(0.5)))


def _tf1_figures(case, weights, x, labels):
  with tf.Graph().as_default():
    outs = case.forward(keras_cases.TF1Ops(weights), tf.constant(x))
    loss = case.loss(outs, [tf.constant(l) for l in labels])
    plan = _declare(case, gg.GradientPlan(loss))
    merged = plan.summaries()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      summary = tf1.Summary.FromString(sess.run(merged))
  return {v.tag: v.simple_value for v in summary.value}


def _keras_step(case, model, x, labels, traced, **summaries):
  """A KerasPlan step and its figures, in the step."""
  plan = _declare(case, gg.KerasPlan(model))

  def step(x):
    with plan.tape() as tape:
      outs = model(x)
      outs = outs if isinstance(outs, list) else [outs]
      loss = case.loss(outs, [tf.constant(l) for l in labels])
    tape.gradient(loss)
    return plan.summaries(**summaries)

  run = tf.function(step) if traced else step
  return {k: float(v) for k, v in run(tf.constant(x)).items()}


def _events(logdir):
  values = {}
  for path in glob.glob(f"{logdir}/events.*"):
    for event in tf1.train.summary_iterator(path):
      for v in event.summary.value:
        values[v.tag] = float(tf.make_ndarray(v.tensor))
  return values


def _assert_same(actual, expected):
  assert sorted(actual) == sorted(expected)
  for tag in expected:
    np.testing.assert_allclose(actual[tag], expected[tag], rtol=RTOL,
                               atol=ATOL, err_msg=tag)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("shape", sorted(keras_cases.CASES))
def test_the_keras_figures_are_the_graph_plans(shape, flavour, traced,
                                               tmp_path):
  case = keras_cases.CASES[shape]
  model = keras_cases.keras_model(case, FLAVOURS[flavour])
  x, labels = keras_cases.batch(case)
  expected = _tf1_figures(case, keras_cases.layer_weights(model), x, labels)
  assert any(t.startswith(("graphgrad/upstream_norm/", "graphgrad/edge_norm/"))
             for t in expected)

  writer = tf.summary.create_file_writer(str(tmp_path))
  with writer.as_default(step=3):
    actual = _keras_step(case, model, x, labels, traced)
  writer.close()
  _assert_same(actual, expected)
  _assert_same(_events(tmp_path), expected)


def test_the_chain_figures_are_the_hand_recipes():
  """Chain: l3's upstream scaled by 2, l2's by ``nonlinear``, l1's
  parameter gradients clipped (global norm 0.01) then halved."""
  case = keras_cases.Chain
  model = keras_cases.keras_model(case, FLAVOURS["keras3"])
  x, labels = keras_cases.batch(case)
  figures = _keras_step(case, model, x, labels, traced=False, step=0)

  by_hand = keras_cases.chain_by_hand(model, x, labels)
  norm = lambda ts: float(tf.linalg.global_norm(ts))  # noqa: E731
  g1 = norm(by_hand["l1"])
  expected = {
      "grad_norm/l1/before": g1,
      "grad_norm/l1/after": 0.5 * min(g1, 0.01),
      "grad_norm/l2/before": norm(by_hand["l2"]),
      "grad_norm/l3/before": norm(by_hand["l3"]),
      "upstream_norm/l3/before": norm([by_hand["out"]]),
      "upstream_norm/l3/after": 2.0 * norm([by_hand["out"]]),
      "upstream_norm/l2/before": norm([by_hand["h2"]]),
      "upstream_norm/l2/after": norm([by_hand["h2_after"]]),
  }
  for tag, value in expected.items():
    np.testing.assert_allclose(figures[f"graphgrad/{tag}"], value,
                               rtol=RTOL, err_msg=tag)
  for layer in ("l2", "l3"):  # no transform of their own
    assert (figures[f"graphgrad/grad_norm/{layer}/after"]
            == figures[f"graphgrad/grad_norm/{layer}/before"])


def _two_dense(K):
  """``keras_cases.two_dense`` with ``l2``'s upstream scaled by 0.5."""
  model = keras_cases.two_dense(K, seed=1)
  return model, gg.KerasPlan(model).transform_upstream(
      "l2", gg.transforms.scale(0.5))


def _mse(model, x, y):
  return tf.reduce_mean(tf.square(model(x) - y))


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_fit_writes_every_step_at_the_optimizers_step(flavour, tmp_path):
  K = FLAVOURS[flavour]
  x = keras_cases.normal_rows(0, (12, 3))
  y = keras_cases.normal_rows(1, (12, 2))
  # The reference: the same plan's figures of each step, run by hand.
  model, plan = _two_dense(K)
  weights = model.get_weights()
  expected = []
  for i in range(3):
    rows = slice(4 * i, 4 * i + 4)
    with plan.tape() as tape:
      loss = _mse(model, x[rows], y[rows])
    grads = tape.gradient(loss)
    expected.append({k: float(v) for k, v in plan.summaries(step=i).items()})
    for v, g in zip(model.trainable_variables, grads):
      v.assign_sub(0.1 * g)

  model, plan = _two_dense(K)
  model.set_weights(weights)
  model.compile(K.optimizers.SGD(0.1), loss="mse")
  plan.attach(summaries=str(tmp_path))
  model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
  by_step = {}
  for path in glob.glob(f"{tmp_path}/events.*"):
    for event in tf1.train.summary_iterator(path):
      for v in event.summary.value:
        by_step.setdefault(event.step, {})[v.tag] = float(
            tf.make_ndarray(v.tensor))
  assert sorted(by_step) == [0, 1, 2]
  for step, figures in enumerate(expected):
    _assert_same(by_step[step], figures)


def test_under_a_loss_scale_the_figures_are_unscaled():
  model, plan = _two_dense(FLAVOURS["keras3"])
  x, y = keras_cases.normal_rows(0), keras_cases.normal_rows(1, (5, 2))
  figures = []
  for scale in (None, 1024.0):
    with plan.tape(loss_scale=scale) as tape:
      loss = _mse(model, x, y)
      target = loss if scale is None else scale * loss
    tape.gradient(target)
    figures.append({k: float(v) for k, v in plan.summaries(step=0).items()})
  _assert_same(figures[1], figures[0])
  assert figures[0]["graphgrad/upstream_norm/l2/after"] == pytest.approx(
      0.5 * figures[0]["graphgrad/upstream_norm/l2/before"], rel=1e-6)


def test_summaries_before_a_step_are_refused():
  _, plan = _two_dense(FLAVOURS["keras3"])
  with pytest.raises(gg.GraphGradError, match="no step has computed"):
    plan.summaries(step=0)


def test_a_traced_steps_summaries_are_refused_outside_it():
  model, plan = _two_dense(FLAVOURS["keras3"])

  @tf.function
  def step(x, y):
    with plan.tape() as tape:
      loss = _mse(model, x, y)
    return tape.gradient(loss)

  step(keras_cases.normal_rows(0), keras_cases.normal_rows(1, (5, 2)))
  with pytest.raises(gg.GraphGradError,
                     match="ran in another graph .* inside the same"):
    plan.summaries(step=0)


def test_a_writer_without_a_step_is_refused(tmp_path):
  _, plan = _stepped()
  with tf.summary.create_file_writer(str(tmp_path)).as_default():
    with pytest.raises(gg.GraphGradError, match="no step to write at"):
      plan.summaries()


def _stepped():
  model, plan = _two_dense(FLAVOURS["keras3"])
  with plan.tape() as tape:
    loss = _mse(model, keras_cases.normal_rows(0),
                keras_cases.normal_rows(1, (5, 2)))
  tape.gradient(loss)
  return model, plan


def test_histograms_hold_every_final_gradient_and_rewritten_upstream(
    tmp_path):
  pytest.importorskip("tensorboard")
  model, plan = _stepped()
  with tf.summary.create_file_writer(str(tmp_path)).as_default(step=0):
    plan.summaries(histograms=True)
  counts = {}
  for path in glob.glob(f"{tmp_path}/events.*"):
    for event in tf1.train.summary_iterator(path):
      for v in event.summary.value:
        if v.metadata.plugin_data.plugin_name == "histograms":
          # Buckets of (left, right, count): the counts add up to the values.
          counts[v.tag] = int(tf.make_ndarray(v.tensor)[:, 2].sum())
  # A Keras 3 variable's path; a Keras 2 one's name, without ":0".
  name = lambda v: getattr(v, "path", v.name.split(":")[0])  # noqa: E731
  sizes = {f"graphgrad/grad_hist/{name(v)}": int(np.prod(v.shape))
           for v in model.trainable_variables}
  sizes["graphgrad/upstream_hist/l2"] = 5 * 2  # l2's output, 5 rows
  assert counts == sizes


def test_histograms_without_tensorboard_are_refused(monkeypatch):
  _, plan = _stepped()
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
      None if name == "tensorboard" else find_spec(name, *a)))
  with pytest.raises(gg.GraphGradError, match="pip install tensorboard"):
    plan.summaries(step=0, histograms=True)


def test_attach_refuses_a_summaries_that_is_no_writer():
  _, plan = _two_dense(FLAVOURS["keras3"])
  with pytest.raises(gg.GraphGradError,
                     match="`summaries` must be None, a log directory .* got "
                           "int"):
    plan.attach(summaries=3)
  assert not plan.attached


def test_summaries_without_a_writer_are_returned_and_logged_once(caplog,
                                                                 tmp_path):
  model, plan = _two_dense(FLAVOURS["keras3"])
  x, y = keras_cases.normal_rows(0), keras_cases.normal_rows(1, (5, 2))
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    for _ in range(2):
      with plan.tape() as tape:
        loss = _mse(model, x, y)
      tape.gradient(loss)
      figures = plan.summaries(step=0)
  assert "graphgrad/upstream_norm/l2/after" in figures
  warned = [r for r in caplog.records if "no default tf.summary writer"
            in r.getMessage()]
  assert len(warned) == 1, caplog.text
  # With a writer, nothing is logged.
  _, plan = _stepped()
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    with tf.summary.create_file_writer(str(tmp_path)).as_default(step=0):
      plan.summaries()
  assert "no default tf.summary writer" not in caplog.text
