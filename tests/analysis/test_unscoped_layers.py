"""Layers of variables with no scope of their own, by the op that uses them.

Each parametric op type (embedding lookup, depthwise and 1-d convolutions,
fused batch norm), reference variables, and the name a user tries first.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import evaluate

tf1 = tf.compat.v1


def _v(*shape, seed=0):
  rng = np.random.default_rng(seed)
  return tf1.Variable(rng.normal(size=shape).astype(np.float32) * 0.3)


def test_embedding_lookup_and_dense(graph):
  table = _v(10, 4)
  ids = tf.constant([[1, 2], [3, 9]])
  e = tf.reshape(tf.nn.embedding_lookup(table, ids), [2, 8])
  w, b = _v(8, 3, seed=1), _v(3, seed=2)
  loss = tf.reduce_sum(tf.square(tf.matmul(e, w) + b))
  net = gg.analyze(loss)
  lookup = [op for op in net.layers[0].ops if op.type == "ResourceGather"]
  assert net.names == (lookup[0].name, "MatMul")
  assert net.layer_of_variable(table) == lookup[0].name
  assert list(net.graph.edges) == [(lookup[0].name, "MatMul")]
  # The edge's boundary is the looked-up rows; a reversed edge is exact.
  (rows,) = net.boundary(lookup[0].name, "MatMul")
  plan = gg.GradientPlan(loss, net).transform_edge(
      lookup[0].name, "MatMul", gg.transforms.scale(-2.0))
  got = dict((v.name, g) for g, v in plan.compute_gradients())[table.name]
  want = tf1.gradients(rows, table, grad_ys=-2.0 * tf1.gradients(loss, rows)[0])
  got, want = evaluate([tf.convert_to_tensor(got), tf.convert_to_tensor(
      want[0])])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_depthwise_conv1d_and_fused_batch_norm(graph):
  x = tf.constant(np.random.default_rng(0).normal(size=(2, 5, 5, 2)),
                  tf.float32)
  dw = tf.nn.depthwise_conv2d(x, _v(3, 3, 2, 1), [1, 1, 1, 1], "SAME")
  gamma, beta = _v(2, seed=3), _v(2, seed=4)
  bn, _, _ = tf1.nn.fused_batch_norm(tf.nn.relu(dw), gamma, beta)
  seq = tf.reshape(bn, [2, 25, 2])
  c1 = tf.nn.conv1d(seq, _v(3, 2, 4, seed=5), 1, "SAME")
  loss = tf.reduce_sum(tf.square(c1))
  net = gg.analyze(loss)
  kinds = [sorted({op.type for op in l.ops} & {
      "DepthwiseConv2dNative", "FusedBatchNormV3", "Conv2D"})
           for l in net.layers]
  assert kinds == [["DepthwiseConv2dNative"], ["FusedBatchNormV3"],
                   ["Conv2D"]]
  assert net.names[0] == "depthwise"
  assert net[net.names[1]].variables == (gamma, beta)
  assert len(net.graph.edges) == 2


def test_reference_variables(graph):
  x = tf.constant(np.ones((3, 4), np.float32))
  rng = np.random.default_rng(0)
  w0 = tf1.get_variable("w0", initializer=rng.normal(size=(4, 5)).astype(
      np.float32), use_resource=False)
  b0 = tf1.get_variable("b0", initializer=np.zeros(5, np.float32),
                        use_resource=False)
  w1 = tf1.get_variable("w1", initializer=rng.normal(size=(5, 2)).astype(
      np.float32), use_resource=False)
  h = tf.nn.bias_add(tf.matmul(x, w0), b0)
  loss = tf.reduce_sum(tf.square(tf.matmul(tf.tanh(h), w1)))
  net = gg.analyze(loss)
  assert net.names == ("MatMul", "MatMul_1")
  assert net["MatMul"].variables == (w0, b0)
  assert net.boundary("MatMul", "MatMul_1") == (h,)
  plan = gg.GradientPlan(loss, net).transform_upstream(
      "MatMul_1", gg.transforms.scale(0.5))
  want = tf1.gradients(h, [w0, b0], grad_ys=0.5 * tf1.gradients(loss, h)[0])
  got = [g for g, _ in plan.compute_gradients()][:2]
  for a, e in zip(*evaluate([got, want])):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7)


def test_a_variable_name_points_to_its_layer(graph):
  x = tf.constant(np.ones((3, 4), np.float32))
  w = tf1.get_variable("w1", [4, 2])
  loss = tf.reduce_sum(tf.matmul(x, w))
  with pytest.raises(gg.LayerNotFoundError,
                     match=r"`layer` 'w1' is a variable of the layer 'MatMul', "
                           r"not a layer: a variable with no scope of its own "
                           r"belongs to the layer of the op that uses it.*"
                           r"Declare on 'MatMul'"):
    gg.GradientPlan(loss).transform_gradients("w1", gg.transforms.scale(2.0))


def test_a_mapped_name_is_never_taken_by_an_automatic_layer(graph):
  x = tf.constant(np.ones((3, 4), np.float32))
  w0, b0, w1 = _v(4, 5), _v(5, seed=1), _v(5, 2, seed=2)
  loss = tf.reduce_sum(tf.matmul(tf.nn.relu(tf.matmul(x, w0) + b0), w1))
  net = gg.analyze(loss, layers={"MatMul": [w1]})
  assert net.names == ("MatMul_layer", "MatMul")
  assert net["MatMul_layer"].variables == (w0, b0)
  assert [op.type for op in net["MatMul"].ops if op.type == "MatMul"] == [
      "MatMul"]
  assert list(net.graph.edges) == [("MatMul_layer", "MatMul")]
