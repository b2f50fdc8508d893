"""Linear upstream and edge rewrites: one backward pass, weighted.

For every linear transform and six network shapes, the fused plan (one pass
through the rewritten layer, its share below weighted by the factor) must
equal the same plan forced through the cut path (a second backward pass with
``f(g)``), and an independent reference: the same network rebuilt with a
gradient-scaling identity ``stop(t) + c * (t - stop(t))`` wired by hand where
the rewritten share enters the layer, differentiated by ``tf.gradients``.
"""

import contextlib
import functools
import re

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense, evaluate_grads, feed, opaque

tf1 = tf.compat.v1
T = gg.transforms

LINEAR = {
    "scale": (T.scale(0.5), 0.5),
    "reverse": (T.reverse(0.3), -0.3),
    "zero": (T.zero(), 0.0),
    "identity": (T.identity(), 1.0),
    "chain": (T.chain(T.scale(2.0), T.reverse(0.25)), -0.5),
    "declared": (T.linear(lambda g: 0.7 * g, 0.7), 0.7),
}


def _scaled(t, c):
  """Forward: exactly ``t``. Backward: ``c`` times the gradient."""
  if c == 1.0:
    return t
  stop = tf.stop_gradient(t)
  return stop + c * (t - stop)


class Into:
  """Wires a reference's scaled identities: (upper, lower) -> factor."""

  def __init__(self, factors=None):
    self.factors = factors or {}

  def __call__(self, upper, lower, t):
    return _scaled(t, self.factors.get((upper, lower), 1.0))


def _shared(x, units, name, reuse):
  rng = np.random.default_rng(len(name) + units)
  kernel = rng.normal(size=(int(x.shape[-1]), units)).astype(np.float32) / 2
  return tf1.layers.dense(x, units, name=name, reuse=reuse,
                          activation=tf.tanh,
                          kernel_initializer=tf1.constant_initializer(kernel),
                          bias_initializer=tf1.constant_initializer(0.1))


def chain_model(into):
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 5, "l1", tf.tanh)
  h2 = dense(into("l2", "l1", h1), 5, "l2", tf.tanh)
  out = dense(into("l3", "l2", h2), 3, "l3")
  return tf.reduce_sum(tf.square(out)), feed(x, rows=6)


def deep_model(into):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(x, 5, "l1", tf.tanh)
  for i in range(2, 6):
    h = dense(into(f"l{i}", f"l{i - 1}", h), 5, f"l{i}",
              tf.tanh if i < 5 else None)
  return tf.reduce_sum(tf.square(h)), feed(x, rows=6)


def skip_model(into):
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 5, "l1", tf.tanh)
  h2 = dense(into("l2", "l1", h1), 5, "l2", tf.tanh)
  s = tf.nn.relu(into("l3", "l2", h2) + into("l3", "l1", h1))
  return tf.reduce_sum(tf.square(dense(s, 3, "l3"))), feed(x, rows=6)


def heads_model(into):
  x = tf1.placeholder(tf.float32, [None, 4])
  t = dense(dense(x, 5, "l0", tf.tanh), 5, "l1", tf.tanh)
  a = dense(into("ha", "l1", t), 2, "ha")
  b = dense(into("hb", "l1", t), 3, "hb")
  return (tf.reduce_sum(tf.square(a)) + tf.reduce_sum(tf.sin(b)),
          feed(x, rows=6))


def siamese_model(into):
  x1 = tf1.placeholder(tf.float32, [None, 4])
  x2 = tf1.placeholder(tf.float32, [None, 4])
  p1 = _shared(x1, 5, "pre", None)
  p2 = _shared(x2, 5, "pre", True)
  e1 = _shared(into("enc", "pre", p1), 3, "enc", None)
  e2 = _shared(into("enc", "pre", p2), 3, "enc", True)
  out = dense(tf.concat([into("head", "enc", e1), into("head", "enc", e2)], 1),
              2, "head")
  return tf.reduce_sum(tf.square(out)), feed(x1, x2, rows=6)


def lstm_model(into):
  x = tf1.placeholder(tf.float32, [None, 5, 3])
  h = dense(x, 4, "inp", tf.tanh)
  with tf1.variable_scope("rnn"):
    cell = tf1.nn.rnn_cell.LSTMCell(
        6, initializer=tf1.initializers.random_uniform(-0.3, 0.3, seed=3))
    outputs, _ = tf1.nn.dynamic_rnn(cell, into("rnn", "inp", h),
                                    dtype=tf.float32)
  top = dense(into("top", "rnn", outputs[:, -1]), 2, "top")
  return tf.reduce_sum(tf.square(top)), feed(x, rows=6)


def embedding_model(into):
  ids = tf1.placeholder(tf.int32, [None, 3])
  with tf1.variable_scope("embed"):
    table = tf1.get_variable("table", initializer=np.random.default_rng(
        0).normal(size=(20, 4)).astype(np.float32))
    emb = tf.reshape(tf.nn.embedding_lookup(table, ids), [-1, 12])
  h = dense(into("l1", "embed", emb), 6, "l1", tf.tanh)
  loss = tf.reduce_sum(tf.square(dense(into("l2", "l1", h), 2, "l2")))
  # A second lookup reaches the table without passing l1: a bypass.
  loss += tf.reduce_sum(tf.nn.embedding_lookup(table, ids[:, :1]))
  return loss, {ids: np.random.default_rng(1).integers(0, 20, size=(6, 3))}


# (model, upstream layers, edges, reference entries (upper, lower) per
# rewrite): a rewrite on an upstream scales every share into that layer.
CASES = {
    "chain": (chain_model, ["l2"], [], [("l2", "l1")]),
    "chain_two_layers": (chain_model, ["l2", "l3"], [],
                         [("l2", "l1"), ("l3", "l2")]),
    "deep_every_layer": (deep_model, ["l2", "l3", "l4", "l5"], [],
                         [(f"l{i}", f"l{i - 1}") for i in range(2, 6)]),
    "skip": (skip_model, ["l2"], [], [("l2", "l1")]),
    "skip_two_layers": (skip_model, ["l2", "l3"], [],
                        [("l2", "l1"), ("l3", "l2"), ("l3", "l1")]),
    "skip_top": (skip_model, ["l3"], [], [("l3", "l2"), ("l3", "l1")]),
    "heads_edge": (heads_model, [], [("l1", "ha")], [("ha", "l1")]),
    "siamese": (siamese_model, ["enc"], [], [("enc", "pre")]),
    "lstm": (lstm_model, ["rnn"], [], [("rnn", "inp")]),
    "embedding": (embedding_model, ["l1"], [], [("l1", "embed")]),
}


# dynamic_rnn's loop is glue to the automatic grouping (its variables sit in
# rnn/rnn/lstm_cell): the scope puts the While op into the layer.
LAYERS = {lstm_model: {"rnn": "rnn"}}


def _declare(loss, net, upstream, edges, fn, fuse):
  plan = gg.GradientPlan(loss, net)
  fn = fn if fuse else opaque(fn)
  for name in upstream:
    plan.transform_upstream(name, fn)
  for lo, up in edges:
    plan.transform_edge(lo, up, fn)
  return plan.compute_gradients()




def _reference(model, entries, c):
  factors = {}
  for e in entries:
    factors[e] = factors.get(e, 1.0) * c
  with tf.Graph().as_default():
    tf1.set_random_seed(0)
    loss, feed = model(Into(factors))
    variables = tf1.trainable_variables()
    names = [v.name for v in variables]
    return evaluate_grads(tf.gradients(loss, variables), feed), names


@functools.lru_cache(maxsize=None)
def _plain(model):
  """``_reference`` without a rewrite: built once per model, as every
  transform's test compares with it."""
  return _reference(model, [], 1.0)


@pytest.mark.parametrize("transform", sorted(LINEAR))
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_equals_cut_and_reference(case, transform):
  model, upstream, edges, entries = CASES[case]
  fn, c = LINEAR[transform]
  with tf.Graph().as_default():
    tf1.set_random_seed(0)
    loss, feed = model(Into())
    net = gg.analyze(loss, layers=LAYERS.get(model))
    fused = _declare(loss, net, upstream, edges, fn, True)
    # The same loss, forced through the cut path.
    cut = _declare(loss, net, upstream, edges, fn, False)
    names = [v.name for _, v in fused]
    values = evaluate_grads([g for g, _ in fused] + [g for g, _ in cut], feed)
  n = len(fused)
  # With c = 1 the reference's scaled identities are the identity.
  want, ref_names = _plain(model) if c == 1.0 else _reference(model, entries,
                                                              c)
  assert names == ref_names
  for name, got, via_cut, ref in zip(names, values[:n], values[n:], want):
    assert (got is None) == (via_cut is None) == (ref is None), name
    if got is None:
      continue
    # float32: c * J^T g and J^T (c * g) round differently.
    np.testing.assert_allclose(got, via_cut, rtol=1e-6, atol=1e-6,
                               err_msg=name)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=name)
  if c != 1.0:  # the rewrite matters: some gradient differs from the plain one
    plain = _plain(model)[0]
    assert any(not np.allclose(g, p) for g, p in zip(values[:n], plain)
               if g is not None)


def _new_ops(graph, build):
  before = len(graph.get_operations())
  build()
  return graph.get_operations()[before:]


@pytest.mark.parametrize("fuse, loops", [(True, 1), (False, 2)])
def test_lstm_upstream_rewrite_builds_one_backward_loop(fuse, loops):
  with tf.Graph().as_default() as graph:
    loss, _ = lstm_model(Into())
    net = gg.analyze(loss, layers=LAYERS[lstm_model])
    new = _new_ops(graph, lambda: _declare(
        loss, net, ["rnn"], [], T.scale(0.5), fuse))
  assert sum(op.type in ("While", "StatelessWhile") for op in new) == loops


def _grad_ops_of(ops, layer):
  # tf.gradients names the gradient of op ``l1/MatMul`` ``.../l1/MatMul_grad``.
  pattern = re.compile(rf"(^|/){layer}/[^/]+_grad(/|$)")
  return [op.name for op in ops if pattern.search(op.name)]


@pytest.mark.parametrize("declare", ["upstream", "edge"])
@pytest.mark.parametrize("fuse", [True, False])
def test_zero_builds_no_backward_op_for_the_removed_share(declare, fuse):
  with tf.Graph().as_default() as graph:
    loss, feed = chain_model(Into())
    net = gg.analyze(loss)
    ups, edges = (["l2"], []) if declare == "upstream" else ([], [("l1", "l2")])
    out = []
    new = _new_ops(graph, lambda: out.extend(_declare(
        loss, net, ups, edges, T.zero(), fuse)))
    values = evaluate_grads([g for g, _ in out], feed)
  names = [v.op.name for _, v in out]
  if fuse:
    assert _grad_ops_of(new, "l1") == []
  else:  # the cut path backpropagates zeros through l1: the test can fail
    assert _grad_ops_of(new, "l1")
  assert _grad_ops_of(new, "l2") and _grad_ops_of(new, "l3")
  for name, g in zip(names, values):
    # l1's gradients are zeros (not None: momentum still steps them).
    assert g is not None
    assert (np.abs(g).max() == 0) == name.startswith("l1/"), name


def test_zero_leaves_the_bypass_share():
  with tf.Graph().as_default() as graph:
    loss, feed = skip_model(Into())
    net = gg.analyze(loss)
    new = _new_ops(graph, lambda: _declare(
        loss, net, ["l2"], [], T.zero(), True))
    assert _grad_ops_of(new, "l1")  # l1 still gets l3's share by the skip
    got = dict((v.name, g) for g, v in _declare(
        loss, net, ["l2"], [], T.zero(), True))
    l1 = [v for v in tf1.trainable_variables() if v.name.startswith("l1/")]
    h1 = graph.get_tensor_by_name("l1/Tanh:0")
    h2 = graph.get_tensor_by_name("l2/Tanh:0")
    # Reference: what reaches h1 from l3 alone, then through l1.
    g_h1 = tf.gradients(loss, h1, stop_gradients=[h2])[0]
    want = tf.gradients(h1, l1, grad_ys=g_h1)
    actual, expected = evaluate_grads([[got[v.name] for v in l1], want], feed)
  np.testing.assert_allclose(actual[0], expected[0], rtol=1e-6, atol=1e-7)
  assert np.abs(actual[0]).max() > 0


def test_linear_factors_of_the_builtin_transforms():
  assert T.scale(0.5).linear_factor == 0.5
  assert T.reverse(0.3).linear_factor == -0.3
  assert T.zero().linear_factor == 0
  assert T.identity().linear_factor == 1
  assert T.chain(T.scale(2.0), T.reverse(0.25)).linear_factor == -0.5
  assert T.chain(T.scale(2.0), T.clip_by_norm(1.0)).linear_factor is None
  assert T.clip_by_value(-1.0, 1.0).linear_factor is None
  assert T.add_noise(0.1).linear_factor is None
  assert T.as_transform(lambda g: 2.0 * g).linear_factor is None
  assert T.linear(lambda g: 2.0 * g, 2.0).linear_factor == 2.0


@pytest.mark.parametrize("factor", ["0.5", None, True])
def test_linear_refuses_a_factor_that_is_not_a_number(factor):
  with pytest.raises(gg.GraphGradError,
                     match=r"linear: `factor` must be a Python number"):
    T.linear(lambda g: g, factor)


@pytest.mark.parametrize("factor, match", [
    (float("nan"), r"linear: `factor` must be finite"),
    (tf.constant(0.5), r"linear: `factor` must be a Python number, .* got "
                       r"tensor"),
])
def test_linear_refuses_a_factor_not_known_when_building(factor, match):
  with pytest.raises(gg.GraphGradError, match=match):
    T.linear(lambda g: g, factor)


def test_linear_refuses_what_is_not_callable():
  with pytest.raises(gg.GraphGradError, match=r"`fn` must be a callable"):
    T.linear(0.5, 0.5)


def test_linear_next_to_a_replaced_backward_keeps_the_documented_order():
  # replace_backward sees the rewritten gradient itself: the factor cannot
  # be moved past it, so both paths call the transform.
  seen = []
  fn = T.linear(lambda g: seen.append(g) or 0.5 * g, 0.5)
  with tf.Graph().as_default():
    loss, feed = chain_model(Into())
    net = gg.analyze(loss)
    plan = (gg.GradientPlan(loss, net).transform_upstream("l2", fn)
            .replace_backward("l2", gg.backward.feedback_alignment(seed=1)))
    gv = plan.compute_gradients()
    assert seen  # the transform ran on the gradient at l2's outputs
    h2 = tf1.get_default_graph().get_tensor_by_name("l2/Tanh:0")
    assert all(t.shape.is_compatible_with(h2.shape) for t in seen)
    assert all(g is not None for g, _ in gv)


@pytest.mark.parametrize("layer", ["l1", "embed"])
def test_sparse_gradients_stay_sparse_when_weighted(layer):
  with tf.Graph().as_default():
    loss, _ = embedding_model(Into())
    net = gg.analyze(loss)
    gv = _declare(loss, net, [layer, "l2"], [], T.scale(0.5), True)
  table = [g for g, v in gv if v.op.name == "embed/table"][0]
  assert isinstance(table, tf.IndexedSlices)


def rounded_model(into, override_map=False):
  """A chain whose l2 rounds its activations: Round has no gradient."""
  x = tf1.placeholder(tf.float32, [None, 4])
  h1 = dense(x, 5, "l1", tf.tanh)
  h2 = dense(into("l2", "l1", h1), 5, "l2", tf.sigmoid)
  identity = (tf1.get_default_graph().gradient_override_map(
      {"Round": "Identity"}) if override_map else contextlib.nullcontext())
  with tf.name_scope("l2/quant/"), identity:
    h2 = tf.round(h2 * 255.0) / 255.0
  out = dense(into("l3", "l2", h2), 3, "l3")
  return tf.reduce_sum(tf.square(out)), feed(x, rows=6)


@pytest.mark.parametrize("fuse", [True, False])
def test_an_override_inside_the_rewritten_layer(fuse):
  # The fused segment through l2 crosses its Round: it must make its call
  # through the plan's gradient function, which applies the override.
  with tf.Graph().as_default():
    tf1.set_random_seed(0)
    loss, feed = rounded_model(Into())
    plan = (gg.GradientPlan(loss)
            .transform_upstream("l2", T.scale(0.5) if fuse
                                else opaque(T.scale(0.5)))
            .straight_through("Round"))
    got = evaluate_grads([g for g, _ in plan.compute_gradients()], feed)
  with tf.Graph().as_default():
    tf1.set_random_seed(0)
    loss, feed = rounded_model(Into({("l2", "l1"): 0.5}), override_map=True)
    want = evaluate_grads(tf.gradients(loss, tf1.trainable_variables()), feed)
  assert all(g is not None and np.abs(g).max() > 0 for g in got)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_weighted_rewrite_builds_its_trace_entry_when_read():
  with tf.Graph().as_default() as graph:
    loss, feed = chain_model(Into())
    plan = gg.GradientPlan(loss).transform_upstream("l2", T.scale(0.5))
    plan.compute_gradients()
    n = len(graph.get_operations())
    record = plan.trace[0]
    assert record.context.layer == "l2" and len(graph.get_operations()) == n
    after = record.after
    assert len(graph.get_operations()) > n and record.after is after
    before, after = evaluate_grads([record.before, after], feed)
  np.testing.assert_allclose(after, 0.5 * before, rtol=1e-6)
  assert np.abs(before).max() > 0


def _mlp(depth):
  x = tf1.placeholder(tf.float32, [None, 4])
  h = x
  for i in range(depth):
    h = dense(h, 4, f"l{i}", tf.nn.relu if i < depth - 1 else None)
  return tf.reduce_sum(tf.square(h)), feed(x, rows=6)


def _op_types(ops):
  counts = {}
  for op in ops:
    counts[op.type] = counts.get(op.type, 0) + 1
  return counts


def test_a_span_of_scaled_layers_is_one_call_and_one_mul_per_boundary():
  depth = 6
  with tf.Graph().as_default() as graph:
    loss, feed = _mlp(depth)
    gg.analyze(loss)
    variables = tf1.trainable_variables()
    sgd = tf1.train.GradientDescentOptimizer(0.1)
    plain = _new_ops(graph, lambda: sgd.compute_gradients(loss))
    plan = gg.GradientPlan(loss)
    for i in range(depth):
      plan.transform_upstream(f"l{i}", T.scale(0.5))
    out = []
    fused = _new_ops(graph, lambda: out.extend(plan.compute_gradients()))
    got = evaluate_grads([g for g, _ in out], feed)
  # Each tf.gradients call opens a name scope of its own: one call in all.
  scopes = {op.name.split("/")[1] for op in fused
            if op.name.startswith("graphgrad/")}
  assert scopes == {"gradients", "seed"}, scopes
  # What the plan adds to minimize()'s ops: one Mul by 0.5 at each of the
  # depth - 1 boundaries below a variable, and the one constant they share.
  # Its seed (ones_like(loss), and the Identity tf.gradients puts around any
  # grad_ys) is one op fewer than minimize()'s (Shape, Fill and its value).
  assert len(fused) == len(plain) + (depth - 1) + 1 - 1
  got_types, want_types = _op_types(fused), _op_types(plain)
  assert got_types["Mul"] == want_types["Mul"] + depth - 1
  seed_ops = {"Mul", "Const", "Identity", "Fill", "Shape"}
  assert ({k: v for k, v in got_types.items() if k not in seed_ops}
          == {k: v for k, v in want_types.items() if k not in seed_ops})
  # Layer i's parameters see 0.5 ** (layers above it) of the plain gradient
  # in the network where each boundary scales by 0.5 (the reference).
  names = [v.op.name for v in variables]
  with tf.Graph().as_default():
    x = tf1.placeholder(tf.float32, [None, 4])
    h = x
    for i in range(depth):
      h = dense(_scaled(h, 0.5) if i else h, 4, f"l{i}",
                tf.nn.relu if i < depth - 1 else None)
    ref_vars = tf1.trainable_variables()
    ref = evaluate_grads(tf.gradients(tf.reduce_sum(tf.square(h)), ref_vars),
               {x: next(iter(feed.values()))})
  assert [v.op.name for v in ref_vars] == names
  for name, g, r in zip(names, got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7, err_msg=name)
  assert np.abs(got[0]).max() > 0


def test_a_chain_leaves_tf_gradients_as_it_was():
  with tf.Graph().as_default():
    loss, feed = _mlp(4)
    variables = tf1.trainable_variables()
    before = tf.gradients(loss, variables)
    plan = gg.GradientPlan(loss)
    for i in range(4):
      plan.transform_upstream(f"l{i}", T.scale(0.5))
    fused = [g for g, _ in plan.compute_gradients()]
    after = tf.gradients(loss, variables)
    values = evaluate_grads(before + after + fused, feed)
  n = len(variables)
  b, a, f = values[:n], values[n:2 * n], values[2 * n:]
  for x, y in zip(b, a):
    np.testing.assert_array_equal(x, y)
  assert not all(np.allclose(x, z) for x, z in zip(b, f))


@pytest.mark.parametrize("fuse", [True, False])
def test_a_chain_records_each_layers_upstream_gradient(fuse):
  with tf.Graph().as_default():
    loss, feed = deep_model(Into())
    net = gg.analyze(loss)
    plan = gg.GradientPlan(loss)
    for i in range(2, 6):
      plan.transform_upstream(f"l{i}", T.scale(0.5) if fuse
                              else opaque(T.scale(0.5)))
    plan.compute_gradients()
    records = {r.context.layer: r for r in plan.trace}
    assert sorted(records) == ["l2", "l3", "l4", "l5"]
    # The gradient at layer i's output is 0.5 per layer above it.
    plain = tf.gradients(loss, [net[f"l{i}"].outputs[0] for i in range(2, 6)])
    values = evaluate_grads([records[f"l{i}"].before for i in range(2, 6)]
                  + [records["l3"].after] + plain, feed)
  for i, (got, ref) in enumerate(zip(values[:4], values[5:])):
    np.testing.assert_allclose(got, 0.5 ** (3 - i) * ref, rtol=1e-6,
                               atol=1e-7)
  np.testing.assert_allclose(values[4], 0.5 * values[1], rtol=1e-6)


def rounded_deep_model(into, override_map=False):
  """Five layers; l2 rounds its activations (Round has no gradient)."""
  x = tf1.placeholder(tf.float32, [None, 4])
  h = dense(x, 5, "l1", tf.tanh)
  h = dense(into("l2", "l1", h), 5, "l2", tf.sigmoid)
  identity = (tf1.get_default_graph().gradient_override_map(
      {"Round": "Identity"}) if override_map else contextlib.nullcontext())
  with tf.name_scope("l2/quant/"), identity:
    h = tf.round(h * 255.0) / 255.0
  for i in range(3, 6):
    h = dense(into(f"l{i}", f"l{i - 1}", h), 5, f"l{i}",
              tf.tanh if i < 5 else None)
  return tf.reduce_sum(tf.square(h)), feed(x, rows=6)


def test_a_span_of_scaled_layers_crosses_an_override():
  # The scaled layers l5 to l2 form one span, whose call crosses l2's
  # Round with the override substituted for its gradient function.
  calls = {}
  for linear in ("fused", "general"):
    with tf.Graph().as_default() as graph:
      tf1.set_random_seed(0)
      loss, feed = rounded_deep_model(Into())
      plan = gg.GradientPlan(loss).straight_through("Round")
      for i in range(2, 6):
        plan.transform_upstream(f"l{i}", T.scale(0.5) if linear == "fused"
                                else opaque(T.scale(0.5)))
      n = len(graph.get_operations())
      got = evaluate_grads([g for g, _ in plan.compute_gradients()], feed)
      scopes = [op.name.split("/") for op in graph.get_operations()[n:]]
      calls[linear] = len({p[1] for p in scopes
                           if len(p) > 2 and p[1].startswith("gradients")})
    with tf.Graph().as_default():
      tf1.set_random_seed(0)
      loss, feed = rounded_deep_model(
          Into({(f"l{i}", f"l{i - 1}"): 0.5 for i in range(2, 6)}),
          override_map=True)
      want = evaluate_grads(tf.gradients(loss, tf1.trainable_variables()), feed)
    assert all(g is not None and np.abs(g).max() > 0 for g in got)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=linear)
  # One call from the loss through l5 to l2, one below l2.
  assert calls == {"fused": 2, "general": 10}, calls
