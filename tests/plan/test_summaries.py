"""plan.summaries(): TensorBoard events that hold the true gradient norms."""

import glob
import logging

import bert_optimization
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense, global_norm, trainable

tf1 = tf.compat.v1
keras = pytest.importorskip("keras")


def _three_layers():
  x = tf1.placeholder(tf.float32, [None, 4], name="x")
  h1 = dense(x, 6, "l1", tf.tanh)
  h2 = dense(h1, 5, "l2", tf.tanh)
  out3 = dense(h2, 3, "l3")
  loss = tf.reduce_sum(tf.square(out3), name="loss")
  return x, loss


def _events(logdir):
  values, histos = {}, set()
  for path in glob.glob(f"{logdir}/events.*"):
    for event in tf1.train.summary_iterator(path):
      for v in event.summary.value:
        if v.HasField("histo"):
          histos.add(v.tag)
        else:
          values[v.tag] = v.simple_value
  return values, histos




def test_summaries_hold_the_norms_before_and_after(graph, tmp_path):
  x, loss = _three_layers()
  net = gg.analyze(loss)
  plan = (gg.GradientPlan(loss, net)
          .transform_upstream("l3", gg.transforms.scale(0.5))
          .transform_gradients("l2", gg.transforms.scale(0.8))
          .transform_edge("l1", "l2", gg.transforms.scale(3.0)))
  merged = plan.summaries(histograms=True)
  assert merged.dtype == tf.string

  # The reference, by hand: the seed recipe applied layer by layer.
  out3, = net["l3"].outputs
  out2, = net["l2"].outputs
  out1, = net["l1"].outputs
  g3 = tf.gradients(loss, out3)[0]
  l3_grads = tf.gradients(loss, trainable("l3"))
  l2_grads = tf.gradients(out3, trainable("l2"), grad_ys=0.5 * g3)
  into_l1 = tf.gradients(out3, out1, grad_ys=0.5 * g3)[0]
  l1_grads = tf.gradients(out1, trainable("l1"), grad_ys=3.0 * into_l1)
  del out2

  feed = {x: np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)}
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    summary, ref = sess.run(
        [merged, dict(g3=g3, l3=l3_grads, l2=l2_grads, into=into_l1,
                      l1=l1_grads)], feed)
    writer = tf1.summary.FileWriter(str(tmp_path), graph=None)
    writer.add_summary(summary, global_step=7)
    writer.close()

  values, histos = _events(tmp_path)
  want = {
      "graphgrad/grad_norm/l3/before": global_norm(ref["l3"]),
      "graphgrad/grad_norm/l3/after": global_norm(ref["l3"]),
      "graphgrad/grad_norm/l2/before": global_norm(ref["l2"]),
      "graphgrad/grad_norm/l2/after": 0.8 * global_norm(ref["l2"]),
      "graphgrad/grad_norm/l1/before": global_norm(ref["l1"]),
      "graphgrad/grad_norm/l1/after": global_norm(ref["l1"]),
      "graphgrad/upstream_norm/l3/before": global_norm([ref["g3"]]),
      "graphgrad/upstream_norm/l3/after": 0.5 * global_norm([ref["g3"]]),
      "graphgrad/edge_norm/l1_to_l2/before": global_norm([ref["into"]]),
      "graphgrad/edge_norm/l1_to_l2/after": 3.0 * global_norm([ref["into"]]),
  }
  assert set(values) == set(want)
  for tag, expected in want.items():
    np.testing.assert_allclose(values[tag], expected, rtol=1e-5, err_msg=tag)
  assert "graphgrad/grad_hist/l1/kernel" in histos
  assert "graphgrad/upstream_hist/l3" in histos


def test_summaries_without_histograms_and_custom_scope(graph, tmp_path):
  x, loss = _three_layers()
  merged = gg.GradientPlan(loss).summaries(name="norms")
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    summary, grads = sess.run(
        [merged, tf.gradients(loss, trainable("l2"))],
        {x: np.ones((2, 4), np.float32)})
  writer = tf1.summary.FileWriter(str(tmp_path))
  writer.add_summary(summary, 0)
  writer.close()
  values, histos = _events(tmp_path)
  assert not histos
  assert sorted(values) == sorted(f"norms/grad_norm/{l}/{w}"
                                  for l in ("l1", "l2", "l3")
                                  for w in ("before", "after"))
  np.testing.assert_allclose(values["norms/grad_norm/l2/after"],
                             global_norm(grads), rtol=1e-5)


# -- the adaptive-optimizer warning -------------------------------------------


def _records(caplog):
  return [r for r in caplog.records
          if r.name == "graphgrad" and r.levelno == logging.WARNING]


def test_scale_under_adam_warns_once(graph, caplog):
  _, loss = _three_layers()
  plan = (gg.GradientPlan(loss)
          .transform_gradients("l2", gg.transforms.scale(0.8))
          .transform_upstream("l3", gg.transforms.reverse(0.5)))
  opt = tf1.train.AdamOptimizer(1e-3)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan.apply_gradients(opt)
    plan.apply_gradients(opt)
  records = _records(caplog)
  assert len(records) == 1
  message = records[0].getMessage()
  assert ("transform_gradients('l2') scales by 0.8 under AdamOptimizer"
          in message)
  assert "GradientDescentOptimizer" in message and "learning rate" in message
  assert "l3" not in message  # a reversal is not cancelled


@pytest.mark.parametrize("opt", ["RMSPropOptimizer", "AdagradOptimizer"])
def test_scale_under_other_adaptive_optimizers_warns(graph, caplog, opt):
  _, loss = _three_layers()
  plan = gg.GradientPlan(loss).transform_edge(
      "l1", "l2", gg.transforms.chain(gg.transforms.scale(2.0),
                                      gg.transforms.scale(2.0)))
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan.apply_gradients(getattr(tf1.train, opt)(0.1))
  (record,) = _records(caplog)
  assert f"transform_edge('l1', 'l2') scales by 4 under {opt}" in (
      record.getMessage())


@pytest.mark.parametrize("fn,opt", [
    (gg.transforms.scale(0.8), "GradientDescentOptimizer"),
    (gg.transforms.reverse(1.0), "AdamOptimizer"),
    (gg.transforms.zero(), "AdamOptimizer"),
    (gg.transforms.chain(gg.transforms.scale(2.0), gg.transforms.scale(0.5)),
     "AdamOptimizer"),
    (gg.transforms.chain(gg.transforms.scale(2.0),
                         gg.transforms.clip_by_norm(1.0)), "AdamOptimizer"),
])
def test_no_warning_when_the_scale_matters(graph, caplog, fn, opt):
  _, loss = _three_layers()
  plan = gg.GradientPlan(loss).transform_upstream("l3", fn)
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan.apply_gradients(getattr(tf1.train, opt)(0.1))
  assert not _records(caplog)


def test_warning_names_at_most_three_scales(graph, caplog):
  _, loss = _three_layers()
  plan = gg.GradientPlan(loss)
  for layer in ("l1", "l2", "l3"):
    plan.transform_gradients(layer, gg.transforms.scale(0.5))
  plan.transform_upstream("l3", gg.transforms.scale(2.0))
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan.apply_gradients(tf1.train.AdamOptimizer(1e-3))
  (record,) = _records(caplog)
  message = record.getMessage()
  assert message.count("scales by") == 3
  assert "; and 1 more under AdamOptimizer" in message


class _MomentumByHand(tf1.train.Optimizer):
  """Momentum written out, as BERT writes Adam: no slots, no fused kernel,
  and no square root, so not adaptive."""

  def __init__(self, lr):
    super().__init__(False, "MomentumByHand")
    self.lr = lr

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    ops = []
    for g, v in grads_and_vars:
      m = tf1.get_variable(v.op.name + "/mom", shape=v.shape, trainable=False,
                           initializer=tf1.zeros_initializer())
      new_m = 0.9 * m + g
      ops += [m.assign(new_m), v.assign_sub(self.lr * new_m)]
    return tf.group(*ops, name=name)


@pytest.mark.parametrize("make, adaptive", [
    (lambda: bert_optimization.AdamWeightDecayOptimizer(1e-3), True),
    (lambda: _MomentumByHand(0.1), False),
    (lambda: tf1.train.MomentumOptimizer(0.1, 0.9), False),
    (lambda: keras.optimizers.Adam(1e-3), True),
    (lambda: keras.optimizers.SGD(0.1), False),
    (lambda: gg.transforms.apply_if_finite(tf1.train.AdamOptimizer(1e-3)),
     True),
    (lambda: gg.transforms.apply_if_finite(
        tf1.train.GradientDescentOptimizer(0.1)), False),
], ids=["bert_adam", "momentum_by_hand", "momentum", "keras3_adam",
        "keras3_sgd", "adam_if_finite", "sgd_if_finite"])
def test_adaptive_optimizer_is_read_from_its_update_rule(graph, caplog, make,
                                                         adaptive):
  """BERT's AdamWeightDecayOptimizer is no AdamOptimizer and has no slots:
  the square root of its second moment makes it adaptive."""
  _, loss = _three_layers()
  plan = gg.GradientPlan(loss).transform_gradients(
      "l2", gg.transforms.scale(0.81))
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    plan.apply_gradients(make())
  records = _records(caplog)
  assert len(records) == int(adaptive)
  if adaptive:
    assert "transform_gradients('l2') scales by 0.81" in (
        records[0].getMessage())
