"""Layer.call_sites counts applications to inputs, not disconnected pieces."""

import importlib
import sys

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import assert_grads_close, dense, evaluate, feed

tf1 = tf.compat.v1


def test_in_scope_regulariser_is_not_a_call_site(graph):
  x = tf1.placeholder(tf.float32, [None, 3])
  with tf1.variable_scope("l1"):
    w = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
    h = tf.matmul(x, w)
    decay = 1e-3 * tf.nn.l2_loss(w)  # in the scope, reads w only
  loss = tf.reduce_sum(dense(h, 2, "top")) + decay
  net = gg.analyze(loss)
  assert net["l1"].call_sites == 1


def test_towers_sharing_a_scope_are_two_call_sites(graph):
  x1 = tf1.placeholder(tf.float32, [None, 3])
  x2 = tf1.placeholder(tf.float32, [None, 3])
  t1 = dense(x1, 3, "tower")
  with tf1.variable_scope("tower", reuse=True):
    t2 = tf.matmul(x2, tf1.get_variable("kernel")) + tf1.get_variable("bias")
    reg = tf.nn.l2_loss(tf1.get_variable("kernel"))
  loss = tf.reduce_sum(dense(t1 * t2, 1, "head")) + reg
  assert gg.analyze(loss)["tower"].call_sites == 2


def _conv_bn_relu():
  """tf-slim's pattern: conv, a BatchNorm sub-scope, relu in conv's scope."""
  x = tf1.placeholder(tf.float32, [None, 3])
  with tf1.variable_scope("block/conv") as scope:
    w = tf1.get_variable("weights", initializer=np.eye(3, dtype=np.float32))
    h = tf.matmul(x, w)
    with tf1.variable_scope("BatchNorm"):
      gamma = tf1.get_variable("gamma", initializer=np.ones(3, np.float32))
      hb = h * gamma
    with tf.name_scope(scope.original_name_scope):
      out = tf.nn.relu(hb)
  loss = tf.reduce_sum(tf.square(dense(out, 2, "top")))
  return x, out, loss


def test_activation_after_an_in_scope_batch_norm_is_not_a_call_site(graph):
  _, out, loss = _conv_bn_relu()
  net = gg.analyze(loss)
  assert net.layer_of(out.op) == "block/conv"
  assert net["block/conv"].call_sites == 1
  assert net["block/conv/BatchNorm"].call_sites == 1


def test_layers_feeding_each_other_suggest_their_scope(graph):
  x, out, loss = _conv_bn_relu()
  plan = gg.GradientPlan(loss).transform_upstream(
      "block/conv", gg.transforms.scale(0.5))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"The layers feed each other: one layer's scope "
                           r"holds ops on both sides of the other, as a conv "
                           r"and the BatchNorm in its sub-scope do under the "
                           r"default grouping\. Analyse with net = "
                           r"gg.analyze\(loss, layers=\{'block/conv': "
                           r"'block/conv'\}\) and pass it, "
                           r"gg.GradientPlan\(loss, net\): that makes "
                           r"'block/conv', 'block/conv/BatchNorm' one layer "
                           r"'block/conv' and leaves every other layer as it "
                           r"is\."):
    plan.compute_gradients()
  # The suggestion resolves it: one layer, its upstream rewritten.
  net = gg.analyze(loss, layers={"block/conv": "block/conv"})
  assert net.names == ("block/conv", "top")
  plan = gg.GradientPlan(loss, net).transform_upstream(
      "block/conv", gg.transforms.scale(0.5))
  got = {v.name: g for g, v in plan.compute_gradients()}
  variables = list(net["block/conv"].variables)
  want = tf.gradients(loss, variables)
  actual, expected = evaluate([[got[v.name] for v in variables], want],
                              feed(x, rows=4))
  assert_grads_close(actual, expected)  # nothing below: its own gradients


def test_tf_slim_resnet_blocks_are_called_once(graph, monkeypatch):
  if importlib.util.find_spec("tf_slim") is None:
    pytest.skip("tf_slim is not installed")
  if importlib.util.find_spec("tf_keras") is None:
    pytest.skip("tf_slim 1.1 on TensorFlow 2.16+ needs tf-keras")
  # tf_slim 1.1 imports tf_keras.legacy_tf_layers, which tf-keras 2.16+
  # keeps under tf_keras.src.
  legacy = importlib.import_module("tf_keras.src.legacy_tf_layers")
  monkeypatch.setitem(sys.modules, "tf_keras.legacy_tf_layers", legacy)
  for sub in ("base", "core", "convolutional", "normalization", "pooling"):
    monkeypatch.setitem(sys.modules, f"tf_keras.legacy_tf_layers.{sub}",
                        importlib.import_module(
                            f"tf_keras.src.legacy_tf_layers.{sub}"))
  slim = importlib.import_module("tf_slim")
  from tf_slim.nets import resnet_v1  # pylint: disable=g-import-not-at-top
  images = tf1.placeholder(tf.float32, [2, 32, 32, 3])
  with slim.arg_scope(resnet_v1.resnet_arg_scope()):
    logits, _ = resnet_v1.resnet_v1_50(images, num_classes=3,
                                       is_training=True, global_pool=True)
  loss = tf.reduce_sum(tf.square(logits)) + tf.add_n(
      tf1.losses.get_regularization_losses())
  # Each conv, its BatchNorm and each block is applied once (the weight
  # decay terms and the relu after each BatchNorm used to count as 11-20).
  for depth in (None, 4):
    sites = {l.name: l.call_sites for l in gg.analyze(loss, depth=depth)
             if "/block" in l.name}
    assert sites and set(sites.values()) == {1}, sites


def _bert_embeddings():
  """BERT's embedding_postprocessor: the tables in bert/embeddings, its
  LayerNorm in a sub-scope, its dropout back in bert/embeddings; then two
  encoder layers."""
  ids = tf.constant([[1, 2, 0], [3, 1, 2]])
  rng = np.random.default_rng(0)
  with tf1.variable_scope("bert"):
    with tf1.variable_scope("embeddings"):
      table = tf1.get_variable("word_embeddings", initializer=rng.normal(
          size=(5, 4)).astype(np.float32))
      pos = tf1.get_variable("position_embeddings", initializer=rng.normal(
          size=(3, 4)).astype(np.float32))
      out = tf.gather(table, ids) + pos
      with tf1.variable_scope("LayerNorm"):
        gamma = tf1.get_variable("gamma", initializer=np.full(4, 1.5,
                                                              np.float32))
        mean, var = tf.nn.moments(out, [-1], keepdims=True)
        out = (out - mean) * tf.math.rsqrt(var + 1e-6) * gamma
      out = out * 0.9  # dropout's scaling, in bert/embeddings
    h = out
    for i in range(2):
      with tf1.variable_scope(f"encoder/layer_{i}/dense"):
        w = tf1.get_variable("kernel", initializer=rng.normal(
            size=(4, 4)).astype(np.float32) * 0.5)
        h = tf.tanh(tf.einsum("bsd,de->bse", h, w))
  return out, h, tf.reduce_sum(tf.square(h))


def test_bert_embeddings_cycle_advice_keeps_the_encoder_layers(graph):
  """depth=2 would make the whole encoder one layer; the advice's layers=
  entry joins only the embeddings, and the plan it gives works."""
  emb, h, loss = _bert_embeddings()
  plan = (gg.GradientPlan(loss)
          .transform_upstream("bert/embeddings", gg.transforms.scale(0.5))
          .transform_upstream("bert/encoder/layer_1/dense",
                              gg.transforms.scale(0.25)))
  with pytest.raises(gg.UnsupportedGraphError,
                     match=r"layers=\{'bert/embeddings': 'bert/embeddings'\}"
                     ) as e:
    plan.compute_gradients()
  assert "depth=" not in str(e.value)
  net = gg.analyze(loss, layers={"bert/embeddings": "bert/embeddings"})
  assert net.names == ("bert/embeddings", "bert/encoder/layer_0/dense",
                       "bert/encoder/layer_1/dense")
  plan = (gg.GradientPlan(loss, net)
          .transform_upstream("bert/embeddings", gg.transforms.scale(0.5))
          .transform_upstream("bert/encoder/layer_1/dense",
                              gg.transforms.scale(0.25)))
  got = {v.name: g for g, v in plan.compute_gradients()}
  # By hand: layer_1's upstream transform scales everything below it.
  below = [v for v in tf1.trainable_variables()
           if not v.name.startswith("bert/encoder/layer_1")]
  top = [v for v in tf1.trainable_variables() if v not in below]
  want = ([0.25 * tf.convert_to_tensor(g) for g in tf.gradients(loss, below)]
          + tf.gradients(loss, top))
  actual, expected = evaluate([[got[v.name] for v in below + top], want])
  assert_grads_close(actual, expected)
