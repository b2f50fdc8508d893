"""GradientPlan.privatize: DP-SGD against per-example references.

Each reference takes one ``tf.gradients`` call per example, clips the
example's gradient over all variables together in numpy, sums and divides by
the batch size.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from tests.helpers import dense, densify

tf1 = tf.compat.v1
B = 6


def reference(loss, variables, feed, clip):
  """(1/B) sum_i clip_C(grad l_i), one tf.gradients per example."""
  per = [tf1.gradients(loss[i], variables) for i in range(B)]
  with tf1.Session() as s:
    s.run(tf1.global_variables_initializer())
    values = s.run(per, feed)
  total = None
  norms = []
  for grads in values:
    grads = [np.zeros(v.shape, np.float64) if g is None
             else densify(g).astype(np.float64)
             for g, v in zip(grads, variables)]
    norm = np.sqrt(sum(np.sum(g * g) for g in grads))
    norms.append(norm)
    c = min(1.0, clip / norm) if norm > 0 else 1.0
    total = ([c * g for g in grads] if total is None
             else [t + c * g for t, g in zip(total, grads)])
  return [t / B for t in total], np.array(norms)


def private(loss, feed, clip, noise=0.0, seed=None, expected_batch_size=None,
            **kw):
  plan = gg.GradientPlan(loss, **kw).privatize(
      clip, noise, seed=seed, expected_batch_size=expected_batch_size)
  gv = plan.compute_gradients()
  with tf1.Session() as s:
    s.run(tf1.global_variables_initializer())
    return [densify(g) for g in s.run([g for g, _ in gv], feed)], gv


def check(loss, feed, clip=None):
  variables = tf1.trainable_variables()
  if clip is None:  # half the examples clipped
    _, norms = reference(loss, variables, feed, 1.0)
    clip = float(np.median(norms))
  expected, norms = reference(loss, variables, feed, clip)
  assert (norms > clip).any() and (norms < clip).any()
  got, _ = private(loss, feed, clip)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
  return got


def normal(*shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_scoped_mlp(graph):
  x = tf1.placeholder(tf.float32, [None, 5])
  y = tf1.placeholder(tf.float32, [None, 3])
  h = dense(x, 8, "l1", tf.nn.relu)
  h = dense(h, 8, "l2", tf.nn.tanh)
  out = dense(h, 3, "l3")
  loss = tf.reduce_sum(tf.square(out - y), axis=1)
  check(loss, {x: normal(B, 5), y: normal(B, 3, seed=1)})


def test_unscoped_mlp(graph):
  x = tf.constant(normal(B, 4))
  w1 = tf1.get_variable("w1", initializer=normal(4, 7, seed=2))
  b1 = tf1.get_variable("b1", initializer=normal(7, seed=3))
  w2 = tf1.get_variable("w2", initializer=normal(7, 1, seed=4))
  out = tf.matmul(tf.nn.sigmoid(tf.matmul(x, w1) + b1), w2)
  check(tf.squeeze(out, 1) ** 2, None)


@pytest.mark.parametrize("k2, padding", [(2, "VALID"), (3, "SAME")])
def test_conv_net(graph, k2, padding):
  x = tf.constant(normal(B, 8, 8, 2))
  rng = np.random.default_rng(5)
  k1 = tf1.get_variable("c1/k", initializer=rng.normal(
      size=(3, 3, 2, 4)).astype(np.float32) / 4)
  b1 = tf1.get_variable("c1/b", initializer=np.ones(4, np.float32) * 0.1)
  k2 = tf1.get_variable("c2/k", initializer=rng.normal(
      size=(k2, k2, 4, 3)).astype(np.float32) / 4)
  h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, k1, 1, "SAME"), b1))
  h = tf.nn.conv2d(h, k2, 2, padding)  # SAME pads 0 before, 1 after
  out = dense(tf.reshape(h, [B, 4 * 4 * 3]), 2, "head")
  check(tf.reduce_sum(tf.square(out), axis=1), None)


def test_embedding_with_repeated_ids(graph):
  ids = tf.constant([[1, 1, 2], [0, 3, 3], [4, 4, 4], [2, 0, 1], [3, 3, 1],
                     [0, 0, 0]])
  table = tf1.get_variable("emb/table", initializer=normal(5, 4, seed=6))
  e = tf.nn.embedding_lookup(table, ids)  # [B, 3, 4]
  out = dense(tf.reshape(e, [B, 12]), 2, "head", tf.nn.tanh)
  got = check(tf.reduce_sum(out, axis=1), None)
  assert got[0].shape == (5, 4)


def test_sequence_dense_tensordot_and_einsum(graph):
  x = tf.constant(normal(B, 5, 3))
  w1 = tf1.get_variable("seq1/w", initializer=normal(3, 4, seed=7))
  w2 = tf1.get_variable("seq2/w", initializer=normal(4, 2, seed=8))
  h = tf.nn.tanh(tf.tensordot(x, w1, axes=1))
  out = tf.einsum("btd,de->bte", h, w2)
  check(tf.reduce_sum(tf.square(out), axis=[1, 2]), None)


def test_layers_on_the_rows_of_a_sequence_as_bert_writes_them(graph):
  # BERT's TF1 code reshapes [B, T, H] to [B*T, H] once and runs its dense
  # layers, biases, activations and layer norms on those rows.
  t = 3
  x = tf.constant(normal(B, t, 4))
  h = tf.reshape(x, [B * t, 4])
  h = dense(h, 6, "intermediate", tf.nn.gelu)
  h = dense(h, 4, "output")  # its input is no Reshape: found through gelu
  gamma = tf1.get_variable("ln/gamma", initializer=normal(4, seed=12))
  beta = tf1.get_variable("ln/beta", initializer=normal(4, seed=13))
  mean, var = tf.nn.moments(h, axes=[1], keepdims=True)
  h = (h - mean) * tf.math.rsqrt(var + 1e-3) * gamma + beta
  out = tf.reshape(h, [B, t * 4])
  check(tf.reduce_sum(tf.square(out - 0.5), axis=1), None)


def test_einsum_onto_heads_and_back(graph, monkeypatch):
  from graphgrad.plan import _privatize_graph

  def no_fallback(self, var, *args):
    raise AssertionError(f"fallback for {var.name}")

  monkeypatch.setattr(_privatize_graph.GraphUses, "_fallback", no_fallback)
  x = tf.constant(normal(B, 5, 3))
  wq = tf1.get_variable("q/w", initializer=normal(3, 2, 4, seed=7))
  wo = tf1.get_variable("o/w", initializer=normal(2, 4, 3, seed=8))
  h = tf.nn.tanh(tf.einsum("abc,cde->abde", x, wq))
  out = tf.einsum("...de,def->...f", h, wo)
  check(tf.reduce_sum(tf.square(out), axis=[1, 2]), None)


def test_rnn_unrolled_with_a_python_loop(graph):
  x = tf.constant(normal(B, 4, 3))
  wx = tf1.get_variable("rnn/wx", initializer=normal(3, 5, seed=9) / 2)
  wh = tf1.get_variable("rnn/wh", initializer=normal(5, 5, seed=10) / 2)
  b = tf1.get_variable("rnn/b", initializer=normal(5, seed=11))
  h = tf.zeros([B, 5])
  for t in range(4):
    h = tf.nn.tanh(tf.matmul(x[:, t], wx) + tf.matmul(h, wh) + b)
  check(tf.reduce_sum(h, axis=1), None)


def test_layer_norm_scale_and_shift(graph):
  x = tf.constant(normal(B, 6))
  gamma = tf1.get_variable("ln/gamma", initializer=normal(6, seed=12))
  beta = tf1.get_variable("ln/beta", initializer=normal(6, seed=13))
  mean, var = tf.nn.moments(x, axes=[1], keepdims=True)
  h = (x - mean) * tf.math.rsqrt(var + 1e-3) * gamma + beta
  out = dense(h, 2, "head")
  check(tf.reduce_sum(tf.square(out), axis=1), None)


def test_op_without_rule_is_exact_through_the_fallback(graph, caplog):
  x = tf.constant(normal(B, 4))
  w = tf1.get_variable("t/w", initializer=normal(3, 4, seed=14))
  out = dense(tf.nn.relu(tf.matmul(x, w, transpose_b=True)), 1, "head")
  with caplog.at_level(logging.WARNING, logger="graphgrad"):
    check(tf.squeeze(out, 1), None)
  assert any("no norm rule for the uses of t/w" in r.getMessage()
             for r in caplog.records)


def test_while_loop_rnn_is_refused_by_name(graph):
  x = tf.constant(normal(B, 4, 3))
  w = tf1.get_variable("loop/w", initializer=normal(3, 3, seed=15))

  def body(t, h):
    return t + 1, tf.nn.tanh(x[:, 0] + tf.matmul(h, w))

  _, h = tf1.while_loop(lambda t, h: t < 4, body, [0, tf.zeros([B, 3])])
  plan = gg.GradientPlan(tf.reduce_sum(h, axis=1)).privatize(1.0, 0.0)
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"loop/w.*is read inside the .*Unroll the loop"):
    plan.compute_gradients()


def _lstm_cell(units):
  """tf.compat.v1's LSTMCell, which Keras 3 does not provide."""
  try:
    return tf1.nn.rnn_cell.LSTMCell(units, name="lstm")
  except AttributeError:  # TensorFlow 2.16+ without TF_USE_LEGACY_KERAS=1
    pytest.skip("tf.compat.v1.nn.rnn_cell needs tf-keras "
                "(TF_USE_LEGACY_KERAS=1)")


def test_dynamic_rnn_lstm_is_refused_with_static_rnn_as_the_fix(graph):
  x = tf.constant(normal(B, 3, 2))
  out, _ = tf1.nn.dynamic_rnn(_lstm_cell(3), x, dtype=tf.float32)
  loss = tf.reduce_sum(tf.square(out[:, -1]), axis=1)
  plan = gg.GradientPlan(loss).privatize(1.0, 0.0)
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"the variable rnn/lstm/kernel:0 is read inside "
                     r"the \w*While op rnn/while .*Unroll the loop .*"
                     r"tf\.compat\.v1\.nn\.static_rnn\(cell, "):
    plan.compute_gradients()


def test_static_rnn_lstm_is_exact(graph):
  x = tf.constant(normal(B, 3, 2))
  out, _ = tf1.nn.static_rnn(_lstm_cell(3), tf.unstack(x, axis=1),
                             dtype=tf.float32)
  check(tf.reduce_sum(tf.square(out[-1]), axis=1), None)


def test_scalar_loss_is_refused(graph):
  w = tf1.get_variable("w", initializer=[1.0])
  plan = gg.GradientPlan(tf.reduce_sum(w * 2.0))
  with pytest.raises(gg.GraphGradError,
                     match=r"vector of per-example losses, shape \[batch\]"):
    plan.privatize(1.0, 1.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(l2_norm_clip=0.0, noise_multiplier=1.0), "`l2_norm_clip` must be"),
    (dict(l2_norm_clip=1.0, noise_multiplier=-1.0),
     "`noise_multiplier` must be"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, seed="a"),
     "`seed` must be an int"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=0),
     "`expected_batch_size` must be a positive finite number"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size="8"),
     "`expected_batch_size` must be a positive finite number"),
])
def test_bad_arguments_are_refused(graph, kwargs, match):
  w = tf1.get_variable("w", initializer=[1.0, 2.0])
  plan = gg.GradientPlan(w * 2.0)
  with pytest.raises(gg.GraphGradError, match=match):
    plan.privatize(**kwargs)


def test_privatize_twice_is_refused(graph):
  w = tf1.get_variable("w", initializer=[1.0, 2.0])
  plan = gg.GradientPlan(w * 2.0).privatize(1.0, 1.0)
  with pytest.raises(gg.GraphGradError, match="already private"):
    plan.privatize(1.0, 1.0)


def test_weight_penalty_in_the_loss_is_refused(graph):
  x = tf.constant(normal(B, 3))
  w = tf1.get_variable("w", initializer=normal(3, 2))
  loss = tf.reduce_sum(tf.matmul(x, w), axis=1) + tf.nn.l2_loss(w)
  plan = gg.GradientPlan(loss).privatize(1.0, 0.0)
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"L2Loss op .*has no batch dimension"):
    plan.compute_gradients()


def test_security_one_large_loss_moves_the_sum_by_at_most_2c(graph):
  x = tf1.placeholder(tf.float32, [B, 5])
  h = dense(dense(x, 8, "a", tf.nn.relu), 1, "b")
  scale = tf1.placeholder(tf.float32, [B])
  loss = scale * tf.squeeze(h, 1) ** 2
  clip = 0.5
  plan = gg.GradientPlan(loss).privatize(clip, 0.0)
  grads = [g for g, _ in plan.compute_gradients()]
  ones = np.ones(B, np.float32)
  big = ones.copy()
  big[2] = 1e4
  with tf1.Session() as s:
    s.run(tf1.global_variables_initializer())
    feed = {x: normal(B, 5)}
    a = s.run(grads, {**feed, scale: ones})
    b = s.run(grads, {**feed, scale: big})
  moved = np.sqrt(sum(np.sum((B * (p - q)) ** 2) for p, q in zip(a, b)))
  assert 0.1 * clip < moved <= 2 * clip + 1e-6


def test_noise_std_is_sigma_c_over_b(graph):
  x = tf.constant(normal(B, 256))
  w = tf1.get_variable("w", initializer=np.zeros((256, 256), np.float32))
  loss = tf.reduce_sum(tf.matmul(x, w), axis=1)
  clip, sigma = 2.0, 1.5
  plan = gg.GradientPlan(loss).privatize(clip, sigma)
  (g, _), = plan.compute_gradients()
  with tf1.Session() as s:
    s.run(tf1.global_variables_initializer())
    first, second = s.run(g), s.run(g)
  # Clipped sum: x's rows summed then scaled; the noise is the rest.
  _, norms = reference(loss, [w], None, clip)
  signal = sum(min(1, clip / n) * np.outer(r, np.ones(256))
               for r, n in zip(normal(B, 256), norms)) / B
  for value in (first, second):
    noise = value - signal
    assert noise.size >= 65536
    np.testing.assert_allclose(noise.std(), sigma * clip / B, rtol=0.05)
    assert abs(noise.mean()) < 0.05 * sigma * clip / B
  assert not np.allclose(first, second)  # never the same draw twice


def _ancestors(op):
  seen, stack = set(), [op]
  while stack:
    o = stack.pop()
    if o not in seen:
      seen.add(o)
      stack += [t.op for t in o.inputs] + list(o.control_inputs)
  return seen


def test_the_large_variables_draw_their_noise_in_turns(graph):
  # The peak memory of docs/privacy.md's cost section: every draw waits for
  # every clipped sum, and the large variables' draws for one another.
  from graphgrad.core._privacy import LARGE
  n = int(LARGE ** 0.5)
  x = tf.constant(normal(B, n))
  h = x
  for i in range(3):
    h = dense(h, n, f"l{i}", tf.nn.relu)
  loss = tf.reduce_sum(h, axis=1)
  plan = gg.GradientPlan(loss).privatize(1.0, 1.1, seed=3)
  gv = plan.compute_gradients()
  noised = [g for g, _ in gv]
  sums = [g.op.inputs[0] for g in noised]  # g + z
  draws = [o for o in graph.get_operations()  # the noise's XLA kernel
           if o.type == "PartitionedCall" and "_box_muller" in o.get_attr(
               "f").name]
  assert len(draws) == 4  # each kernel's, and the biases' together
  for d in draws:
    assert set(s.op for s in sums) <= _ancestors(d)
  kernels = [g for g, v in gv if v.shape.rank == 2]
  for j in range(1, len(kernels)):
    assert kernels[j - 1].op in _ancestors(kernels[j].op)
  biases = [g for g, v in gv if v.shape.rank == 1]
  assert not any(b.op in _ancestors(k.op) for b in biases for k in kernels)


def test_expected_batch_size_divides_the_sum_and_the_noise(graph):
  # Poisson sampling: the divisor is the expected size, never the realized
  # one (here 6 examples, expected 4).
  x = tf.constant(normal(B, 256))
  w = tf1.get_variable("w", initializer=np.zeros((256, 256), np.float32))
  loss = tf.reduce_sum(tf.matmul(x, w), axis=1)
  clip, sigma, expected = 2.0, 1.5, 4.0
  clean, _ = private(loss, None, clip, expected_batch_size=expected)
  ref, _ = reference(loss, [w], None, clip)
  np.testing.assert_allclose(clean[0], ref[0] * B / expected, rtol=1e-5,
                             atol=1e-6)
  noised, _ = private(loss, None, clip, noise=sigma,
                      expected_batch_size=expected)
  np.testing.assert_allclose((noised[0] - clean[0]).std(),
                             sigma * clip / expected, rtol=0.05)


def test_seed_makes_the_noise_repeatable_across_graphs():
  values = []
  for _ in range(2):
    with tf.Graph().as_default():
      w = tf1.get_variable("w", initializer=np.zeros((4, 3), np.float32))
      loss = tf.reduce_sum(tf.matmul(tf.ones([2, 4]), w), axis=1)
      (g, _), = gg.GradientPlan(loss).privatize(
          1.0, 1.0, seed=3).compute_gradients()
      with tf1.Session() as s:
        s.run(tf1.global_variables_initializer())
        values.append([s.run(g), s.run(g)])
  np.testing.assert_array_equal(values[0][0], values[1][0])
  np.testing.assert_array_equal(values[0][1], values[1][1])
  assert not np.allclose(values[0][0], values[0][1])


def test_parameter_transforms_act_after_the_noise(graph):
  x = tf.constant(normal(B, 4))
  h = dense(x, 3, "l1")
  loss = tf.reduce_sum(tf.square(h), axis=1)
  variables = tf1.trainable_variables()
  expected, _ = reference(loss, variables, None, 0.7)
  plan = (gg.GradientPlan(loss).privatize(0.7, 0.0)
          .transform_gradients("l1", gg.transforms.scale(3.0)))
  got = [g for g, _ in plan.compute_gradients()]
  with tf1.Session() as s:
    s.run(tf1.global_variables_initializer())
    got = s.run(got)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, 3.0 * e, rtol=1e-5)


@pytest.mark.parametrize("declare, match", [
    (lambda p, l: p.transform_upstream("l2", gg.transforms.clip_by_norm(1.0)),
     "cannot be combined with upstream declarations on 'l2'.*mixes examples"),
    (lambda p, l: p.transform_edge("l1", "l2", gg.transforms.scale(0.5)),
     "cannot be combined with edge declarations"),
    (lambda p, l: p.combine_tasks("l1", l, gg.mtl.upgrad()),
     "combine_tasks mixes examples before the clip: its weights come from "
     "the whole batch"),
])
def test_declarations_that_mix_examples_are_refused(graph, declare, match):
  x = tf.constant(normal(B, 4))
  h = dense(dense(x, 3, "l1"), 2, "l2")
  # Task losses are scalars: a per-example loss vector that holds them.
  tasks = [tf.reduce_sum(h[:, 0] ** 2), tf.reduce_sum(h[:, 1] ** 2)]
  loss = tasks[0] + tasks[1] + 0.0 * h[:, 0]
  plan = declare(gg.GradientPlan(loss).privatize(1.0, 0.0), tasks)
  with pytest.raises(gg.GraphGradError, match=match):
    plan.compute_gradients()


def test_batch_norm_in_training_mode_is_refused(graph):
  x = tf.constant(normal(B, 4, 4, 2))
  k = tf1.get_variable("c/k", initializer=normal(1, 1, 2, 2))
  scale = tf1.get_variable("bn/gamma", initializer=np.ones(2, np.float32))
  offset = tf1.get_variable("bn/beta", initializer=np.zeros(2, np.float32))
  h, _, _ = tf1.nn.fused_batch_norm(tf.nn.conv2d(x, k, 1, "SAME"), scale,
                                    offset, is_training=True)
  plan = gg.GradientPlan(tf.reduce_sum(h, axis=[1, 2, 3])).privatize(1.0, 0.)
  with pytest.raises(gg.UnsupportedGraphError,
                     match="batch normalization .* whole batch"):
    plan.compute_gradients()




def test_recompute_composes(graph):
  x = tf.constant(normal(B, 5))
  h = x
  for i in range(4):
    h = dense(h, 6, f"r{i}", tf.nn.tanh)
  loss = tf.reduce_sum(tf.square(h), axis=1)
  variables = tf1.trainable_variables()
  expected, _ = reference(loss, variables, None, 0.4)
  plan = gg.GradientPlan(loss).recompute().privatize(0.4, 0.0)
  got = [g for g, _ in plan.compute_gradients()]
  with tf1.Session() as s:
    s.run(tf1.global_variables_initializer())
    got = s.run(got)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_sync_replicas_optimizer_without_after_aggregation_is_refused(graph):
  """Under SyncReplicasOptimizer the noise is added after the aggregation,
  by the gg.AfterAggregation it wraps (tests/distributed/
  test_privatize_sync.py); a plain optimizer there would add none."""
  w = tf1.get_variable("w", initializer=np.ones((4, 3), np.float32))
  loss = tf.reduce_sum(tf.matmul(tf.ones([2, 4]), w), axis=1)
  plan = gg.GradientPlan(loss).privatize(1.0, 1.0)
  opt = tf1.train.SyncReplicasOptimizer(
      tf1.train.GradientDescentOptimizer(0.1), replicas_to_aggregate=2)
  with pytest.raises(
      gg.GraphGradError,
      match=r"privatize: the optimizer that `optimizer` \(a "
      r"SyncReplicasOptimizer\) wraps is not a gg.AfterAggregation, so "
      r"nothing adds the plan's noise.*SyncReplicasOptimizer\("
      r"gg.AfterAggregation\("):
    plan.apply_gradients(opt, global_step=tf1.train.get_or_create_global_step())



# -- ops that mix examples ---------------------------------------------------


def _mlp_hidden():
  x = tf.constant(normal(B, 4))
  w = tf1.get_variable("w", initializer=normal(4, 5, seed=1))
  return tf.tanh(x @ w)


def _per_example(h):
  return tf.reduce_sum(tf.square(h), axis=1)


@pytest.mark.parametrize("mix, op", [
    (lambda h: tf.nn.batch_normalization(
        h, *tf.nn.moments(h, axes=[0]), None, None, 1e-3),
     "(Mean|SquaredDifference)"),
    (lambda h: h - tf.reduce_mean(h, axis=0), "Mean"),
    (lambda h: tf.nn.softmax(h, axis=0), "Softmax"),
    (lambda h: h / tf.reduce_max(h), "Max"),
    (lambda h: tf.matmul(h, tf.matmul(h, h, transpose_a=True)), "MatMul"),
    (lambda h: tf.transpose(tf.nn.softmax(tf.transpose(h))), "Softmax"),
    (lambda h: h - h[:1], "StridedSlice"),
    (lambda h: tf.concat([h[1:], h[:1]], axis=0), "ConcatV2"),
    (lambda h: tf.reshape(tf.stack([h, h], axis=0), [-1, 5]), "Pack"),
    (lambda h: tf.split(h, 2, axis=0)[0], "Split"),
    (lambda h: tf.tile(h, [2, 1]), "Tile"),
    (lambda h: tf.slice(h, [1, 0], [-1, -1]), "Slice"),
    (lambda h: h * tf.reduce_sum(
        h, axis=tf1.placeholder_with_default(1, []), keepdims=True), "Sum"),
    # seen through a transposed convolution's data, not its output shape
    (lambda h: tf.reshape(tf.nn.conv2d_transpose(
        tf.reshape(h - tf.reduce_mean(h, axis=0), [-1, 1, 1, 5]),
        tf.ones([1, 1, 5, 5]), tf.stack([tf.shape(h)[0], 1, 1, 5]), 1),
        [-1, 5]), "Mean"),
])
def test_ops_that_mix_examples_are_refused_by_name(graph, mix, op):
  loss = _per_example(mix(_mlp_hidden()))
  plan = gg.GradientPlan(loss).privatize(1.0, 0.0)
  with pytest.raises(gg.UnsupportedGraphError,
                     match=rf"privatize: the {op} op .*\(LayerNormalization"):
    plan.compute_gradients()


def test_a_sort_or_top_k_of_the_losses_is_refused(graph):
  loss = _per_example(_mlp_hidden())
  plan = gg.GradientPlan(tf.sort(loss)).privatize(1.0, 0.0)
  with pytest.raises(gg.UnsupportedGraphError, match=r"the TopKV2 op"):
    plan.compute_gradients()


@pytest.mark.parametrize("per_example", [
    lambda h: tf.nn.batch_normalization(
        h, *tf.nn.moments(h, axes=[1], keepdims=True), None, None, 1e-3),
    lambda h: h - tf.reduce_mean(h, axis=-1, keepdims=True),
    lambda h: tf.nn.softmax(h, axis=-1),
    lambda h: h / tf.reduce_max(h, axis=1, keepdims=True),
    lambda h: tf.reshape(tf.transpose(tf.reshape(h, [-1, 5, 1]),
                                      [0, 2, 1]), [-1, 5]),
    lambda h: h * tf.one_hot(tf.argmax(h, axis=1), 5),
])
def test_per_example_reductions_over_other_axes_pass(graph, per_example):
  loss = _per_example(per_example(_mlp_hidden()))
  variables = tf1.trainable_variables()
  expected, norms = reference(loss, variables, None, 1.0)
  clip = float(np.median(norms))
  expected, _ = reference(loss, variables, None, clip)
  got, _ = private(loss, None, clip)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_conv2d_transpose_with_a_run_time_output_shape(graph):
  x = tf1.placeholder(tf.float32, [None, 3, 3, 2])
  w = tf1.get_variable("deconv/kernel", initializer=normal(2, 2, 4, 2, seed=1))
  # The output shape is built from the batch size: a shape, not examples.
  shape = tf.stack([tf.shape(x)[0], 6, 6, 4])
  y = tf.nn.conv2d_transpose(x, w, shape, strides=2)
  assert y.op.type == "Conv2DBackpropInput"
  loss = tf.reduce_sum(tf.square(tf.tanh(y)), axis=[1, 2, 3])
  check(loss, {x: normal(B, 3, 3, 2, seed=2)})


def test_an_example_of_any_finite_scale_is_clipped_to_c():
  # one example of scale 1e11 (kernel gradient entries near 1e22, squares
  # that overflow float32), one of scale 1e-15 (entries near 1e-30)
  x, t = normal(4, 3, seed=3), normal(4, 2, seed=4)
  x[1] *= 1e11
  t[1] *= 1e11
  x[2] *= 1e-15
  t[2] *= 1e-15
  clip = 0.5

  def reference64(x, t):
    x, t = x.astype(np.float64), t.astype(np.float64)
    kernel, bias = np.zeros((3, 2)), np.zeros(2)
    for xi, ti in zip(x, t):
      gk, gb = np.outer(xi, ti), ti
      c = min(1.0, clip / np.sqrt(np.sum(gk * gk) + np.sum(gb * gb)))
      kernel, bias = kernel + c * gk, bias + c * gb
    return kernel / len(x), bias / len(x)

  def run(x, t):
    with tf.Graph().as_default():
      w = tf1.get_variable("w", initializer=normal(3, 2, seed=5))
      b = tf1.get_variable("b", initializer=np.zeros(2, np.float32))
      loss = tf.reduce_sum((tf.matmul(tf.constant(x), w) + b)
                           * tf.constant(t), axis=1)
      got, _ = private(loss, {}, clip)
      return got

  for rows in ([0, 1, 2, 3], [1], [2]):
    got = run(x[rows], t[rows])
    for g, e in zip(got, reference64(x[rows], t[rows])):
      np.testing.assert_allclose(g, e, rtol=1e-5, atol=0)
    if rows == [1]:  # the 1e22 example alone: a gradient of norm C exactly
      assert np.sqrt(sum(np.sum(np.square(g.astype(np.float64)))
                         for g in got)) == pytest.approx(clip, rel=1e-5)
  x[3, 0] = np.nan  # one NaN example: every gradient NaN, nothing dropped
  for g in run(x, t):
    assert np.isnan(g).all()
