"""plan.recompute(keep): the gradients equal the plan's without recompute.

Each case builds the same plan twice on one tf.Graph, once with
``recompute``, and evaluates both in one ``Session.run`` (random ops draw
once per run, so a redrawn dropout mask would show as a difference).
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.plan import _recompute
from helpers import dense, densify, feed, trainable

tf1 = tf.compat.v1

# The largest difference per case, read by the benchmarks' notes.
LARGEST: dict = {}


def _recomputed_ops(graph):
  return [op for op in graph.get_operations() if "/recompute_" in op.name
          and "gradients" not in op.name]


def _compare(loss, declare=lambda p: p, keep=None, feed_dict=None,
             case=None):
  """Evaluates the plan with and without recompute; returns both."""
  plain = declare(gg.GradientPlan(loss)).compute_gradients()
  before = len(_recomputed_ops(loss.graph))
  rc = declare(gg.GradientPlan(loss)).recompute(keep).compute_gradients()
  assert len(_recomputed_ops(loss.graph)) > before  # something recomputed
  assert [v.name for _, v in plain] == [v.name for _, v in rc]
  pairs = [(a, b) for (a, _), (b, _) in zip(plain, rc)]
  assert all((a is None) == (b is None) for a, b in pairs)
  pairs = [(a, b) for a, b in pairs if a is not None]
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    got = sess.run(pairs, feed_dict)
  worst = 0.0
  scale = max(float(np.abs(densify(a)).max()) for a, _ in got)
  for (ta, tb), (a, b) in zip(pairs, got):
    assert isinstance(tb, tf.IndexedSlices) == isinstance(ta, tf.IndexedSlices)
    a, b = densify(a), densify(b)
    # The same ops on the same values; oneDNN may still round a MatMul
    # differently between two runs of one graph (its kernel choice depends
    # on the threads it gets), and a reduction over the batch (batch norm)
    # sums in another order in the copy: equal to rtol 1e-6 of the largest
    # gradient entry (a bias below batch norm has a gradient of zero).
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6 * scale)
    worst = max(worst, float(np.max(np.abs(a - b), initial=0.0)))
  if case:
    LARGEST[case] = worst
  return got


def _chain(depth=9, x=None):
  x = tf.constant(np.random.default_rng(0).normal(size=(16, 8)), tf.float32) \
      if x is None else x
  h = x
  for i in range(depth):
    h = dense(h, 8, f"l{i}", tf.tanh)
  return tf.reduce_sum(tf.square(h))


def test_chain_equals_the_plan_without_recompute(graph):
  _compare(_chain(), case="chain")


def test_keep_none_picks_about_sqrt_n_separators(graph):
  loss = _chain(16)
  kept = [t.name for t in _recompute.kept_tensors(
      gg.analyze(loss), None)]
  # Three boundaries, four segments of about four layers each.
  assert [k.split("/")[0] for k in kept] == ["l4", "l8", "l12"], kept


def _widths(widths):
  """A chain of tanh layers ``l0, l1, ...`` from ``widths[0]`` inputs."""
  h = tf1.placeholder(tf.float32, [None, widths[0]])
  for i, w in enumerate(widths[1:]):
    h = dense(h, w, f"l{i}", tf.tanh)
  return tf.reduce_sum(tf.square(h))


# Each layer makes three activations of its width (MatMul, BiasAdd, Tanh),
# the loss two more (Square, Sum); blocks close at the first activation
# where the bytes since the last kept one reach total / sqrt(layers).
@pytest.mark.parametrize("widths,want", [
    # 49 activations of 8 floats and the sum's 1: 393 / 4 = 98.25 floats
    # per block, reached every 13 activations.
    ([8] * 17, ["l4/MatMul:0", "l8/BiasAdd:0", "l12/Tanh:0"]),
    # 561 floats / sqrt(10) = 177.4, reached at l0's Tanh (192) and at l2's
    # (96 + 96): the layers a KerasPlan keeps on the same widths.
    ([64, 64, 32, 32, 16, 16, 8, 8, 4, 4, 2], ["l0/Tanh:0", "l2/Tanh:0"]),
    # 3573 floats / sqrt(8) = 1263.3, reached at l6's BiasAdd (756 + 512)
    # and at l7's (256 + 1024).
    ([2, 4, 8, 16, 32, 64, 128, 256, 512], ["l6/BiasAdd:0", "l7/BiasAdd:0"]),
], ids=["even", "narrowing", "widening"])
def test_keep_none_choice(graph, widths, want):
  kept = _recompute.kept_tensors(gg.analyze(_widths(widths)), None)
  assert [t.name for t in kept] == want


def test_explicit_keep_and_keep_nothing(graph):
  loss = _chain(6)
  _compare(loss, keep=["l1", "l4"])
  _compare(loss, keep=[])


def _residual(x):
  h = dense(x, 8, "stem", tf.nn.relu)
  for i in range(4):
    a = dense(h, 8, f"b{i}_a", tf.nn.relu)
    h = tf.nn.relu(h + dense(a, 8, f"b{i}_b"))
  return tf.reduce_sum(tf.square(dense(h, 3, "head")))


def test_skip_connections(graph):
  x = tf1.placeholder(tf.float32, [None, 8])
  loss = _residual(x)
  kept = [t.name for t in _recompute.kept_tensors(
      gg.analyze(loss), None)]
  # Only tensors that no skip jumps over: a block's sum or output, never
  # inside.
  assert kept and all(n.startswith(("add", "Relu", "stem/"))
                      for n in kept), kept
  _compare(loss, feed_dict=feed(x), case="skip connections")
  # A kept layer that a skip jumps over: still exact, only less saved.
  _compare(loss, keep=["b1_a", "b2_a"], feed_dict=feed(x))


def test_two_heads(graph):
  x = tf1.placeholder(tf.float32, [None, 8])
  h = x
  for i in range(5):
    h = dense(h, 8, f"t{i}", tf.tanh)
  la = tf.reduce_sum(tf.square(dense(dense(h, 6, "a1", tf.tanh), 2, "a2")))
  lb = tf.reduce_sum(dense(dense(h, 6, "b1", tf.tanh), 3, "b2"))
  _compare(la + lb, keep=["t1", "t3"], feed_dict=feed(x), case="two heads")
  _compare(la + lb, feed_dict=feed(x))


def test_shared_layer(graph):
  x1 = tf1.placeholder(tf.float32, [None, 4])
  x2 = tf1.placeholder(tf.float32, [None, 4])
  t1 = tf1.layers.dense(dense(x1, 5, "stem_a", tf.tanh), 5, tf.tanh,
                        name="tower")
  t2 = tf1.layers.dense(dense(x2, 5, "stem_b", tf.tanh), 5, tf.tanh,
                        name="tower", reuse=True)
  h = tf.concat([t1, t2], 1)
  for i in range(3):
    h = dense(h, 6, f"top{i}", tf.tanh)
  loss = tf.reduce_sum(tf.square(h))
  _compare(loss, keep=["tower", "top1"], feed_dict=feed(x1, x2),
           case="shared layer")


def _bn_model():
  x = tf.constant(np.random.default_rng(3).normal(size=(16, 4)), tf.float32)
  h = x
  for i in range(4):
    h = dense(h, 6, f"l{i}")
    h = tf.nn.relu(tf1.layers.batch_normalization(h, training=True,
                                                  name=f"bn{i}"))
  return tf.reduce_sum(tf.square(dense(h, 2, "top")))


def test_batch_norm_gradients_and_one_update_per_step(graph):
  _compare(_bn_model(), keep=["bn1"], case="batch norm")
  after = []
  for recompute in (False, True):
    with tf.Graph().as_default():
      plan = gg.GradientPlan(_bn_model())
      if recompute:
        plan.recompute(["bn1"])
      train = plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1))
      means = [v for v in tf1.global_variables() if "moving_mean" in v.name]
      with tf1.Session() as sess:
        sess.run(tf1.global_variables_initializer())
        sess.run(train)
        after.append(sess.run(means))
  for a, b in zip(*after):
    assert np.abs(a).max() > 0  # the train op ran UPDATE_OPS
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_sparse_embedding_keeps_indexed_slices(graph):
  ids = tf.constant([[0, 3, 3], [5, 1, 0]])
  table = tf1.get_variable(
      "emb/table", initializer=np.random.default_rng(2).normal(
          size=(7, 4)).astype(np.float32))
  h = tf.reshape(tf.nn.embedding_lookup(table, ids), [2, 12])
  for i in range(4):
    h = dense(h, 12, f"l{i}", tf.tanh)
  loss = tf.reduce_sum(tf.square(h))
  got = _compare(loss, keep=["l1"], case="sparse embedding")
  assert hasattr(got[0][1], "indices")  # an IndexedSlicesValue


def test_dropout_reuses_the_forward_mask(graph):
  x = tf1.placeholder(tf.float32, [None, 8])
  h = x
  for i in range(6):
    h = dense(h, 16, f"l{i}", tf.nn.relu)
    with tf1.variable_scope(f"l{i}"):
      h = tf1.nn.dropout(h, rate=0.5)
      h = h + tf1.random_normal(tf.shape(h), stddev=0.1)
  loss = tf.reduce_sum(tf.square(dense(h, 2, "top")))
  _compare(loss, keep=["l2"], feed_dict=feed(x),
           case="dropout and noise")
  # The random ops are the forward's own: none was copied.
  copied = _recomputed_ops(tf1.get_default_graph())
  assert not [op for op in copied if _recompute.is_random(op)]
  assert any(op.type == "Mul" for op in copied)


def test_a_random_op_fed_by_the_parameters_is_refused(graph):
  h = _chain(2)
  h = dense(tf.reshape(h, [1, 1]), 3, "mid", tf.nn.softplus)
  with tf1.variable_scope("mid"):
    draw = tf.random.gamma([4], alpha=h + 1.0)
  loss = tf.reduce_sum(dense(tf.reshape(draw, [4, 3]), 2, "top"))
  plan = gg.GradientPlan(loss).recompute(["l0"])
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"random op .*RandomGamma.* differentiable input"):
    plan.compute_gradients()


def test_stateful_ops_run_once_per_step(graph):
  counter = tf1.get_variable("counter", initializer=0.0, trainable=False)
  x = tf1.placeholder(tf.float32, [None, 8])
  h = x
  for i in range(6):
    h = dense(h, 8, f"l{i}", tf.tanh)
    if i == 2:
      with tf1.variable_scope("l2"):
        h = h * (1.0 + 0.0 * counter.assign_add(1.0))
  loss = tf.reduce_sum(tf.square(h))
  plan = gg.GradientPlan(loss).recompute(["l1", "l4"])
  train = plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1))
  assert _recomputed_ops(graph)
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    sess.run(train, feed(x))
    assert sess.run(counter) == 1.0
  _compare(loss, keep=["l1", "l4"], feed_dict=feed(x))


def test_while_loop_layer_keeps_its_activations(graph):
  x = tf1.placeholder(tf.float32, [None, 8])
  h = dense(x, 8, "l0", tf.tanh)
  h = dense(h, 8, "l1", tf.tanh)
  with tf1.variable_scope("loop"):
    w = tf1.get_variable("w", initializer=np.eye(8, dtype=np.float32) * 0.9)
    _, h = tf.while_loop(lambda i, a: i < 3,
                         lambda i, a: (i + 1, tf.tanh(a @ w)), [0, h])
  for i in range(2, 5):
    h = dense(h, 8, f"l{i}", tf.tanh)
  loss = tf.reduce_sum(tf.square(h))
  _compare(loss, keep=["l0", "l3"], feed_dict=feed(x), case="while loop")
  copied = _recomputed_ops(graph)
  assert not [op for op in copied if "While" in op.type]


def test_composes_with_every_declaration(graph):
  x = tf1.placeholder(tf.float32, [None, 8])
  h = x
  for i in range(4):
    h = dense(h, 8, f"t{i}", tf.tanh)
  with tf1.variable_scope("t3"):
    h = tf.round(h * 4.0) / 4.0 + h
  la = tf.reduce_sum(tf.square(dense(dense(h, 6, "a1", tf.tanh), 2, "a2")))
  lb = tf.reduce_sum(dense(dense(h, 6, "b1", tf.tanh), 3, "b2"))

  def declare(p):
    return (p.transform_upstream("t2", gg.transforms.clip_by_norm(0.1))
            .transform_upstream("a1", gg.transforms.scale(0.5))
            .transform_edge("t3", "b1", gg.transforms.reverse())
            .transform_gradients("t1", gg.transforms.clip_by_global_norm(0.2))
            .replace_backward("b2", gg.backward.feedback_alignment(seed=0))
            .combine_tasks("t3", [la, lb], gg.mtl.pcgrad(shuffle=False))
            .straight_through("Round"))

  _compare(la + lb, declare, keep=["t1"], feed_dict=feed(x),
           case="every declaration")


def test_composes_with_reduce_fn(graph):
  loss = _chain(6)

  def declare(p):
    return gg.GradientPlan(loss, reduce_fn=lambda gv: [2.0 * g for g, _ in gv])

  _compare(loss, declare, keep=["l2"], case="reduce_fn")


def test_composes_with_linear_rewrite_chains(graph):
  loss = _chain(6)

  def declare(p):
    for i in range(1, 6):
      p.transform_upstream(f"l{i}", gg.transforms.scale(0.5))
    return p

  _compare(loss, declare, keep=["l2"], case="linear chains")


def test_bad_keep_is_refused(graph):
  plan = gg.GradientPlan(_chain(3))
  with pytest.raises(gg.GraphGradError, match="`keep` must be a list"):
    plan.recompute("l1")
  with pytest.raises(gg.LayerNotFoundError, match="l9"):
    plan.recompute(["l9"])
  plan.compute_gradients()
  with pytest.raises(gg.GraphGradError, match="already built"):
    plan.recompute()


def test_keeps_activations_only_at_kept_layers(graph):
  """The copies read the forward graph only at kept tensors, inputs and
  variable reads: every other activation is freed after the forward."""
  x = tf1.placeholder(tf.float32, [None, 8])
  loss = _chain(9, x)
  plan = gg.GradientPlan(loss).recompute(["l2", "l5"])
  plan.compute_gradients()
  kept = {t.name for n in ("l2", "l5") for t in plan.net[n].outputs}
  read = set()
  for op in _recomputed_ops(graph):
    read |= {t.name for t in op.inputs if "/recompute_" not in t.name}
  activations = {t for t in read if t.split("/")[-1].startswith(
      ("Tanh", "BiasAdd", "MatMul"))}
  assert activations == kept
  assert trainable("l0")


def test_memory_report_counts_activation_bytes(graph):
  loss = _chain(3)  # batch 16, width 8, float32: 512 bytes per tensor
  text = _recompute.memory_report(gg.analyze(loss), keep=["l1"])
  # MatMul, BiasAdd and Tanh per layer; Square and the scalar Sum are glue.
  for name in ("l0", "l1", "l2"):
    assert re.search(rf"^  {name}\s+1,536$", text, re.M), text
  assert re.search(r"^  \(glue\)\s+516$", text, re.M)
  assert "without recompute: 5,124 bytes" in text
  # l1's output kept (512) plus the larger segment: l0 and l1's first two
  # ops (2,560) against l2 and the glue (2,052).
  assert "with recompute():  3,072 bytes (1 kept tensors: l1/Tanh:0)" in text
