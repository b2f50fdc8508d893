"""gg.gradient_report against gradients built by hand with tf.gradients."""

import json
import math

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import keras_cases
from helpers import dense, global_norm, trainable
from keras_cases import FLAGGED_CHAINS, ReluChain

tf1 = tf.compat.v1


def _net():
  """x -> l1 (relu) -> l2 (relu) -> l3, with a skip l1 -> l3."""
  x = tf1.placeholder(tf.float32, [None, 4], name="x")
  a1 = dense(x, 6, "l1")
  h1 = tf.nn.relu(a1)
  a2 = dense(h1, 6, "l2")
  a3 = dense(tf.nn.relu(a2) + h1, 1, "l3")
  loss = tf.reduce_mean(tf.square(a3))
  return x, loss, {"l1": a1, "l2": a2, "l3": a3}




def _batch(seed):
  return np.random.default_rng(seed).normal(size=(8, 4)).astype(np.float32)


def test_plain_figures_equal_tf_gradients():
  with tf.Graph().as_default():
    x, loss, outs = _net()
    net = gg.analyze(loss)
    names = ["l1", "l2", "l3"]
    param_grads = {n: tf.gradients(loss, trainable(n)) for n in names}
    upstream = {n: tf.gradients(loss, outs[n])[0] for n in names}
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      feed = {x: _batch(0)}
      report = gg.gradient_report(sess, net, feed)
      g, u, w = sess.run([param_grads, upstream,
                          {n: trainable(n) for n in names}], feed)
  assert [r["name"] for r in report.layers] == names
  for n in names:
    row = report[n]
    np.testing.assert_allclose(row["grad_norm"]["before"], global_norm(g[n]),
                               rtol=1e-6)
    np.testing.assert_allclose(row["grad_to_weight"]["before"],
                               global_norm(g[n]) / global_norm(w[n]), rtol=1e-6)
    np.testing.assert_allclose(row["upstream_norm"]["before"],
                               global_norm([u[n]]), rtol=1e-6)
    assert row["zero_upstream"]["before"] == pytest.approx(np.mean(u[n] == 0))
    assert row["grad_norm"]["after"] is None
  # The ReLU after l2 kills some of its units on this batch.
  assert 0 < report["l2"]["zero_upstream"]["before"] < 1


def test_batches_average_the_per_batch_figures():
  with tf.Graph().as_default():
    x, loss, _ = _net()
    net = gg.analyze(loss)
    grads = tf.gradients(loss, trainable("l2"))
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      feeds = [{x: _batch(i)} for i in range(3)]
      by_list = gg.gradient_report(sess, net, feeds, batches=3)
      by_fn = gg.gradient_report(sess, net, lambda i: feeds[i], batches=3)
      expected = np.mean([global_norm(sess.run(grads, f)) for f in feeds])
  np.testing.assert_allclose(by_list["l2"]["grad_norm"]["before"], expected,
                             rtol=1e-6)
  assert by_fn.to_dict() == by_list.to_dict()


def test_plan_figures_after_the_rewrites():
  with tf.Graph().as_default():
    x, loss, outs = _net()
    net = gg.analyze(loss)
    plan = (gg.GradientPlan(loss, net)
            .transform_upstream("l2", gg.transforms.scale(0.1))
            .transform_gradients("l3", gg.transforms.scale(2.0)))
    # By hand: l2's upstream x0.1 reaches l1 only through l2; the skip
    # into l3 keeps its plain gradient.
    g_a2 = tf.gradients(loss, outs["l2"])[0]
    l1_ref = [a + b for a, b in zip(
        tf.gradients(outs["l2"], trainable("l1"), grad_ys=0.1 * g_a2),
        tf.gradients(loss, trainable("l1"), stop_gradients=[outs["l2"]]))]
    l3_ref = [2.0 * g for g in tf.gradients(loss, trainable("l3"))]
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      feed = {x: _batch(1)}
      report = gg.gradient_report(sess, net, feed, plan=plan)
      l1, l3, up2 = sess.run([l1_ref, l3_ref, g_a2], feed)
  np.testing.assert_allclose(report["l1"]["grad_norm"]["after"],
                             global_norm(l1), rtol=1e-5)
  np.testing.assert_allclose(report["l3"]["grad_norm"]["after"],
                             global_norm(l3), rtol=1e-6)
  np.testing.assert_allclose(report["l2"]["upstream_norm"]["after"],
                             0.1 * global_norm([up2]), rtol=1e-6)
  np.testing.assert_allclose(report["l2"]["upstream_norm"]["before"],
                             global_norm([up2]), rtol=1e-6)
  # l2's own parameters see the plain upstream: before == after.
  assert report["l2"]["grad_norm"]["after"] == pytest.approx(
      report["l2"]["grad_norm"]["before"], rel=1e-6)
  # The plan does not materialise l1's upstream: no after value.
  assert report["l1"]["upstream_norm"]["after"] is None
  assert "->" in report.table()


@pytest.mark.parametrize("factor,flag", [(1e-4, "vanishing"),
                                         (1e4, "exploding"), (1.0, None)])
def test_flags_follow_the_documented_rule(factor, flag):
  with tf.Graph().as_default():
    x, loss, _ = _net()
    net = gg.analyze(loss)
    plan = gg.GradientPlan(loss, net).transform_gradients(
        "l2", gg.transforms.scale(factor))
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      report = gg.gradient_report(sess, net, {x: _batch(2)}, plan=plan)
  logs = {r["name"]: math.log10(r["grad_norm"]["after"])
          for r in report.layers}
  # l2 feeds l3, the output layer: its gradient comes from there.
  below = logs["l2"] < logs["l3"] - 2
  above = logs["l2"] > max(logs["l3"], np.median(list(logs.values()))) + 2
  assert (below, above) == (flag == "vanishing", flag == "exploding")
  assert report["l2"]["flag"] == flag
  assert report.flagged() == ({"l2": flag} if flag else {})


def _chain_report(chain):
  """The report of ``chain``'s tf.Graph, and each layer's gradient norm by
  tf.gradients."""
  x, labels = keras_cases.batch(chain)
  with tf.Graph().as_default():
    outs = chain.forward(keras_cases.TF1Ops(chain.weights), tf.constant(x))
    loss = chain.loss(outs, [tf.constant(l) for l in labels])
    net = gg.analyze(loss)
    grads = {n: tf.gradients(loss, trainable(n)) for n in chain.weights}
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      report = gg.gradient_report(sess, net)
      by_hand = sess.run(grads)
  return report, {n: global_norm(g) for n, g in by_hand.items()}


@pytest.mark.parametrize("name", sorted(FLAGGED_CHAINS))
def test_flags_say_where_the_gradient_vanishes_or_explodes(name):
  chain, expected = FLAGGED_CHAINS[name]
  report, norms = _chain_report(chain)
  assert [r["name"] for r in report.layers] == list(chain.weights)
  for n, value in norms.items():
    np.testing.assert_allclose(report[n]["grad_norm"]["before"], value,
                               rtol=1e-5, err_msg=n)
  assert report.flagged() == expected


def test_the_flagged_chains_have_the_gradients_they_are_built_for():
  """The gradient norms of keras_cases.FLAGGED_CHAINS, by tf.gradients, are
  what their construction says, whatever the flag rule."""
  he = _chain_report(ReluChain(8))[1]
  assert max(he.values()) < 10 * min(he.values())
  exploding = _chain_report(FLAGGED_CHAINS["exploding_middle"][0])[1]
  for n, value in he.items():
    if n == "fc3":
      assert exploding[n] == pytest.approx(1e4 * value, rel=1e-3)
    elif n == "fc4":  # its kernel's gradient is 1e-4 of what it was
      assert 0.1 * value < exploding[n] < value
    else:
      assert exploding[n] == pytest.approx(value, rel=1e-3), n
  tiny = _chain_report(FLAGGED_CHAINS["tiny_top"][0])[1]
  assert max(tiny["fc0"], tiny["fc1"], tiny["fc2"]) < 1e-3 * tiny["fc3"]
  assert tiny["fc3"] == pytest.approx(_chain_report(ReluChain(4))[1]["fc3"],
                                      rel=1.0)
  small = _chain_report(FLAGGED_CHAINS["small_middle"][0])[1]
  assert small["fc0"] < 1e-3 * min(small["fc1"], small["fc2"], small["fc3"])
  assert max(small.values()) < 10 * min(small["fc1"], small["fc2"],
                                         small["fc3"])


def test_sparse_gradient_norm_sums_duplicate_rows():
  with tf.Graph().as_default():
    ids = tf.constant([0, 2, 2, 1])
    with tf1.variable_scope("embed"):
      table = tf1.get_variable("table", initializer=np.arange(
          12, dtype=np.float32).reshape(4, 3))
      e = tf.gather(table, ids)
    with tf1.variable_scope("head"):
      out = e @ tf1.get_variable("w", initializer=np.ones((3, 1), np.float32))
    loss = tf.reduce_sum(tf.square(out))
    net = gg.analyze(loss)
    dense_grad = tf.convert_to_tensor(tf.gradients(loss, table)[0])
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      report = gg.gradient_report(sess, net)
      expected = global_norm([sess.run(dense_grad)])
  np.testing.assert_allclose(report["embed"]["grad_norm"]["before"], expected,
                             rtol=1e-6)


def test_plot_and_to_dict(tmp_path):
  with tf.Graph().as_default():
    x, loss, _ = _net()
    net = gg.analyze(loss)
    plan = gg.GradientPlan(loss, net).transform_upstream(
        "l2", gg.transforms.scale(1e-3))
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      report = gg.gradient_report(sess, net, {x: _batch(3)}, plan=plan)
  path = report.plot(str(tmp_path / "grads.png"))
  assert (tmp_path / "grads.png").stat().st_size > 10_000
  assert path.endswith("grads.png")
  data = json.loads(json.dumps(report.to_dict()))
  assert data["has_plan"] and [r["name"] for r in data["layers"]] == [
      "l1", "l2", "l3"]
  with pytest.raises(gg.GraphGradError, match=r"must end in \.png"):
    report.plot(str(tmp_path / "grads.jpg"))
  with pytest.raises(gg.LayerNotFoundError, match="no layer named 'l9'"):
    report["l9"]  # pylint: disable=pointless-statement


def test_bad_arguments():
  with tf.Graph().as_default():
    x, loss, _ = _net()
    net = gg.analyze(loss)
    with tf.Graph().as_default():
      other = tf.constant(1.0)
      other_sess = tf1.Session()
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      feed = {x: _batch(0)}
      with pytest.raises(gg.GraphGradError, match="`net` must be a gg.Layer"):
        gg.gradient_report(sess, loss, feed)
      with pytest.raises(gg.GraphGradError, match="`sess` must be a tf.compat"):
        gg.gradient_report(other_sess, net, feed)
      with pytest.raises(gg.GraphGradError, match="`plan` must be a gg.Grad"):
        gg.gradient_report(sess, net, feed, plan="plan")
      with pytest.raises(gg.GraphGradError, match="`batches` must be a pos"):
        gg.gradient_report(sess, net, feed, batches=0)
      with pytest.raises(gg.GraphGradError, match="`threshold` must be a"):
        gg.gradient_report(sess, net, feed, threshold=float("nan"))
      with pytest.raises(gg.GraphGradError, match="must hold `batches`=2"):
        gg.gradient_report(sess, net, [feed], batches=2)
      with pytest.raises(gg.GraphGradError, match="`feed` must be None, a"):
        gg.gradient_report(sess, net, 3)
      tf1.get_default_graph().finalize()
      with pytest.raises(gg.GraphGradError, match="tf.Graph is finalized"):
        gg.gradient_report(sess, net, feed)
    other_sess.close()
    del other


def test_plot_without_matplotlib_is_an_error(monkeypatch, tmp_path):
  from graphgrad import _installed  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    x, loss, _ = _net()
    net = gg.analyze(loss)
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      report = gg.gradient_report(sess, net, {x: _batch(0)})
  monkeypatch.setattr(_installed, "has_module", lambda name: False)
  with pytest.raises(gg.GraphGradError, match="needs matplotlib"):
    report.plot(str(tmp_path / "grads.png"))


def _rounded():
  """x -> l1 -> tf.round -> l2: l1 gets no gradient."""
  x = tf1.placeholder(tf.float32, [None, 4], name="x")
  h = tf.round(dense(x, 6, "l1") * 4.0)
  return x, tf.reduce_sum(tf.square(dense(h, 2, "l2")))


def test_a_layer_without_any_gradient_is_flagged():
  with tf.Graph().as_default():
    x, loss = _rounded()
    net = gg.analyze(loss)
    mended = gg.GradientPlan(loss, net).straight_through("Round")
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      report = gg.gradient_report(sess, net, {x: _batch(3)})
      with_plan = gg.gradient_report(sess, net, {x: _batch(3)}, plan=mended)
  assert report["l1"]["grad_norm"]["before"] is None
  assert report.flagged() == {"l1": "no gradient"}
  assert "no gradient" in report.table()
  assert with_plan["l1"]["grad_norm"]["after"] > 0
  assert with_plan.flagged() == {}
