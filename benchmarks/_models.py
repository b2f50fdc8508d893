"""The benchmark models, built in the default graph from ``get_variable``.

Every builder returns a :class:`Built`: the loss, a fixed random feed, and
the layers in order from the input side with each layer's output tensor (the
hand recipe needs them; graphgrad finds them itself). No tf-keras needed.
"""

import dataclasses
import sys
from typing import Callable, Dict, List, Tuple

import numpy as np
import tensorflow as tf

from graphgrad import demo as _demo

tf1 = tf.compat.v1


@dataclasses.dataclass
class Built:
  loss: tf.Tensor
  feed: Dict[tf.Tensor, np.ndarray]
  layers: List[Tuple[str, tf.Tensor]]  # (scope, output), input side first


@dataclasses.dataclass(frozen=True)
class Model:
  name: str
  build: Callable[[], Built]
  depth: int = 0  # number of layers, for the depth sweep (0: not in it)
  description: str = ""


def _dense(x, units, name, seed):
  rng = np.random.default_rng(seed)
  fan_in = int(x.shape[-1])
  with tf1.variable_scope(name):
    w = tf1.get_variable("kernel", initializer=(
        rng.normal(size=(fan_in, units)) * np.sqrt(2.0 / fan_in)
    ).astype(np.float32))
    b = tf1.get_variable("bias", [units], initializer=tf1.zeros_initializer())
    return tf.nn.bias_add(tf.matmul(x, w), b)


def _xent(logits, labels):
  return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
      labels=labels, logits=logits), name="loss")


def _onehot(rng, rows, classes):
  return np.eye(classes, dtype=np.float32)[rng.integers(0, classes, rows)]


def seed_net(batch: int = 128) -> Built:
  x, y, logits, loss = _demo.seed_network()
  p = _demo.seed_problem(0)
  g = tf1.get_default_graph()
  h = g.get_tensor_by_name("l1_dense/BiasAdd:0")
  return Built(loss, {x: p.x_train[:batch], y: p.y_train[:batch]},
               [("l1_dense", h), ("l2_dense", logits)])


def mlp(depth: int, width: int = 256, batch: int = 128,
        classes: int = 10) -> Built:
  rng = np.random.default_rng(depth)
  x = tf1.placeholder(tf.float32, [batch, width], name="x")
  y = tf1.placeholder(tf.float32, [batch, classes], name="y")
  h, layers = x, []
  for i in range(depth):
    last = i == depth - 1
    out = _dense(h, classes if last else width, f"l{i:03d}", seed=i)
    layers.append((f"l{i:03d}", out))
    h = out if last else tf.nn.relu(out)
  feed = {x: rng.normal(size=(batch, width)).astype(np.float32),
          y: _onehot(rng, batch, classes)}
  return Built(_xent(h, y), feed, layers)


def _conv(x, channels, name, seed):
  rng = np.random.default_rng(seed)
  cin = int(x.shape[-1])
  with tf1.variable_scope(name):
    k = tf1.get_variable("kernel", initializer=(
        rng.normal(size=(3, 3, cin, channels)) * np.sqrt(2.0 / (9 * cin))
    ).astype(np.float32))
    return tf.nn.conv2d(x, k, strides=1, padding="SAME")


def _batch_norm(x, name, momentum=0.99):
  """Training-mode batch norm; moving averages go to UPDATE_OPS."""
  c = int(x.shape[-1])
  with tf1.variable_scope(name):
    gamma = tf1.get_variable("gamma", [c], initializer=tf1.ones_initializer())
    beta = tf1.get_variable("beta", [c], initializer=tf1.zeros_initializer())
    mm = tf1.get_variable("moving_mean", [c], trainable=False,
                          initializer=tf1.zeros_initializer())
    mv = tf1.get_variable("moving_variance", [c], trainable=False,
                          initializer=tf1.ones_initializer())
    mean, var = tf.nn.moments(x, [0, 1, 2])
    for avg, value in ((mm, mean), (mv, var)):
      tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, tf1.assign(
          avg, momentum * avg + (1.0 - momentum) * value))
    return tf.nn.batch_normalization(x, mean, var, beta, gamma, 1e-3)


def cnn(batch: int = 32, size: int = 16, channels: int = 16, blocks: int = 3,
        classes: int = 10) -> Built:
  """A small ResNet: stem, residual blocks with batch norm, dense head."""
  rng = np.random.default_rng(5)
  x = tf1.placeholder(tf.float32, [batch, size, size, 3], name="x")
  y = tf1.placeholder(tf.float32, [batch, classes], name="y")
  layers = []

  def conv_bn(h, name, seed):
    c = _conv(h, channels, f"{name}_conv", seed)
    layers.append((f"{name}_conv", c))
    b = _batch_norm(c, f"{name}_bn")
    layers.append((f"{name}_bn", b))
    return b

  h = tf.nn.relu(conv_bn(x, "stem", 0))
  for i in range(blocks):
    r = tf.nn.relu(conv_bn(h, f"block{i}_a", 10 * i + 1))
    h = tf.nn.relu(conv_bn(r, f"block{i}_b", 10 * i + 2) + h)
  pooled = tf.reduce_mean(h, [1, 2])
  logits = _dense(pooled, classes, "head", 99)
  layers.append(("head", logits))
  feed = {x: rng.normal(size=(batch, size, size, 3)).astype(np.float32),
          y: _onehot(rng, batch, classes)}
  return Built(_xent(logits, y), feed, layers)


def rnn(batch: int = 64, steps: int = 32, features: int = 32,
        hidden: int = 128, classes: int = 10) -> Built:
  """An Elman RNN in a ``tf.compat.v1.while_loop`` between two dense layers."""
  rng = np.random.default_rng(6)
  x = tf1.placeholder(tf.float32, [batch, steps, features], name="x")
  y = tf1.placeholder(tf.float32, [batch, classes], name="y")
  proj = tf.reshape(_dense(tf.reshape(x, [-1, features]), hidden, "rnn_in", 1),
                    [batch, steps, hidden])
  seq = tf.transpose(proj, [1, 0, 2])
  with tf1.variable_scope("rnn_cell"):
    wh = tf1.get_variable("recurrent_kernel", initializer=(
        rng.normal(size=(hidden, hidden)) / np.sqrt(hidden)).astype(np.float32))
    b = tf1.get_variable("bias", [hidden], initializer=tf1.zeros_initializer())

    def body(t, h):
      return t + 1, tf.tanh(tf.gather(seq, t) + tf.matmul(h, wh) + b)

    _, last = tf1.while_loop(lambda t, h: t < steps, body,
                             [tf.constant(0), tf.zeros([batch, hidden])])
  logits = _dense(last, classes, "head", 2)
  feed = {x: rng.normal(size=(batch, steps, features)).astype(np.float32),
          y: _onehot(rng, batch, classes)}
  return Built(_xent(logits, y), feed,
               [("rnn_in", proj), ("rnn_cell", last), ("head", logits)])


def lstm(batch: int = 64, steps: int = 40, features: int = 32,
         hidden: int = 128, classes: int = 10) -> Built:
  """``dynamic_rnn`` with ``LSTMCell(hidden)`` between two dense layers.

  The recurrent layer is scope ``rnn`` (analyse with ``layers=LSTM_LAYERS``
  so that its ``While`` op belongs to it, not to glue).
  """
  rng = np.random.default_rng(7)
  x = tf1.placeholder(tf.float32, [batch, steps, features], name="x")
  y = tf1.placeholder(tf.float32, [batch, classes], name="y")
  proj = tf.reshape(_dense(tf.reshape(x, [-1, features]), hidden, "rnn_in", 1),
                    [batch, steps, hidden])
  with tf1.variable_scope("rnn"):
    cell = _lstm_cell_class()(
        hidden, initializer=tf1.initializers.glorot_uniform(seed=7))
    outputs, _ = tf1.nn.dynamic_rnn(cell, tf.nn.relu(proj), dtype=tf.float32)
  logits = _dense(outputs[:, -1], classes, "head", 2)
  feed = {x: rng.normal(size=(batch, steps, features)).astype(np.float32),
          y: _onehot(rng, batch, classes)}
  return Built(_xent(logits, y), feed,
               [("rnn_in", proj), ("rnn", outputs), ("head", logits)])


LSTM_LAYERS = {"rnn": "rnn"}


def _lstm_cell_class():
  """``tf.compat.v1.nn.rnn_cell.LSTMCell``, also when Keras 3 is the default.

  That name resolves only under ``TF_USE_LEGACY_KERAS=1``; the TF2 suites of
  this process use Keras 3, so the class is taken from tf-keras itself.
  """
  try:
    return tf1.nn.rnn_cell.LSTMCell
  except AttributeError:
    from tf_keras.src.layers.rnn import legacy_cells  # pylint: disable=g-import-not-at-top
    return legacy_cells.LSTMCell


def embedding(batch: int = 128, length: int = 16, vocab: int = 20000,
              dims: int = 64, hidden: int = 256, classes: int = 10) -> Built:
  """Bag of embeddings: the embedding table gets a sparse gradient."""
  rng = np.random.default_rng(7)
  ids = tf1.placeholder(tf.int32, [batch, length], name="ids")
  y = tf1.placeholder(tf.float32, [batch, classes], name="y")
  with tf1.variable_scope("embedding"):
    table = tf1.get_variable("table", initializer=(
        rng.normal(size=(vocab, dims)) * 0.05).astype(np.float32))
    pooled = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), 1)
  h1 = _dense(pooled, hidden, "fc1", 1)
  logits = _dense(tf.nn.relu(h1), classes, "fc2", 2)
  feed = {ids: rng.integers(0, vocab, (batch, length)).astype(np.int32),
          y: _onehot(rng, batch, classes)}
  return Built(_xent(logits, y), feed,
               [("embedding", pooled), ("fc1", h1), ("fc2", logits)])


MLP_DEPTHS = (8, 32, 64, 128)


def alias_legacy_layers() -> None:
  """tf_slim 1.1 imports tf_keras.legacy_tf_layers, which tf-keras 2.16+
  keeps under tf_keras.src."""
  import importlib  # pylint: disable=g-import-not-at-top
  prefix = "tf_keras.src.legacy_tf_layers"
  sys.modules["tf_keras.legacy_tf_layers"] = importlib.import_module(prefix)
  for sub in ("base", "core", "convolutional", "normalization", "pooling"):
    sys.modules[f"tf_keras.legacy_tf_layers.{sub}"] = importlib.import_module(
        f"{prefix}.{sub}")


def slim_resnet(depth: int, batch: int = 2, size: int = 64) -> Built:
  """tf-slim's ``resnet_v1_<depth>`` in training mode, softmax loss, in the
  default tf.Graph."""
  alias_legacy_layers()
  import tf_slim as slim  # pylint: disable=g-import-not-at-top
  from tf_slim.nets import resnet_v1  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  x = tf1.placeholder(tf.float32, [batch, size, size, 3])
  y = tf1.placeholder(tf.int32, [batch])
  with slim.arg_scope(resnet_v1.resnet_arg_scope()):
    logits, _ = getattr(resnet_v1, f"resnet_v1_{depth}")(
        x, num_classes=10, is_training=True, global_pool=True)
  logits = tf.reshape(logits, [batch, 10])
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))
  rng = np.random.default_rng(0)
  feed = {x: rng.normal(size=(batch, size, size, 3)).astype(np.float32),
          y: rng.integers(0, 10, batch).astype(np.int32)}
  return Built(loss, feed, [])


def models(tiny: bool = False) -> List[Model]:
  """The model list of a full run, or of the smoke-test run."""
  if tiny:
    return [Model("seed", seed_net, 0, "seed two-layer net, batch 128"),
            Model("mlp2", lambda: mlp(2, width=32, batch=16), 2,
                  "MLP depth 2, width 32, batch 16"),
            Model("mlp4", lambda: mlp(4, width=32, batch=16), 4,
                  "MLP depth 4, width 32, batch 16")]
  out = [Model("seed", seed_net, 0, "seed two-layer net (10-20-2), batch 128")]
  for d in MLP_DEPTHS:
    out.append(Model(f"mlp{d}", lambda d=d: mlp(d), d,
                     f"MLP depth {d}, width 256, batch 128"))
  out += [
      Model("cnn", cnn, 0, "ResNet: stem + 3 residual blocks, batch norm, "
            "16x16x3, batch 32"),
      Model("rnn", rnn, 0, "Elman RNN in a while_loop, 32 steps, batch 64"),
      Model("embedding", embedding, 0, "20k x 64 embedding (sparse "
            "gradient) + 2 dense, batch 128"),
  ]
  return out
