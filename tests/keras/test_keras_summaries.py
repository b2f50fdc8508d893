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
  first = "base" if case in (keras_cases.TwoHeads,) else (
      "features" if case is keras_cases.GlueEdge else "l1")
  return (plan.transform_gradients(first, gg.transforms.clip_by_global_norm(0.01))
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

  l1, l2, l3 = (model.get_layer(n) for n in ("l1", "l2", "l3"))
  with tf.GradientTape(persistent=True) as tape:
    h1 = l1(tf.constant(x))
    h2 = l2(h1)
    out = l3(h2)
    loss = case.loss([out], [tf.constant(labels[0])])
  g3 = tape.gradient(loss, out)
  g2 = tape.gradient(out, h2, output_gradients=2.0 * g3)
  g2_after = keras_cases.nonlinear(g2)
  g1 = tape.gradient(h2, l1.trainable_variables, output_gradients=g2_after)
  norm = lambda ts: float(tf.linalg.global_norm(ts))  # noqa: E731
  clipped = norm(g1) if norm(g1) <= 0.01 else 0.01
  expected = {
      "grad_norm/l1/before": norm(g1),
      "grad_norm/l1/after": 0.5 * clipped,
      "grad_norm/l2/before": norm(tape.gradient(
          out, l2.trainable_variables, output_gradients=2.0 * g3)),
      "grad_norm/l3/before": norm(tape.gradient(loss,
                                                l3.trainable_variables)),
      "upstream_norm/l3/before": norm([g3]),
      "upstream_norm/l3/after": 2.0 * norm([g3]),
      "upstream_norm/l2/before": norm([g2]),
      "upstream_norm/l2/after": norm([g2_after]),
  }
  for tag, value in expected.items():
    np.testing.assert_allclose(figures[f"graphgrad/{tag}"], value,
                               rtol=RTOL, err_msg=tag)
  for layer in ("l2", "l3"):  # no transform of their own
    assert (figures[f"graphgrad/grad_norm/{layer}/after"]
            == figures[f"graphgrad/grad_norm/{layer}/before"])
