"""The privacy suite's models, each twice: a tf.compat.v1 graph and Keras 3.

One list of initial weights per model (:func:`weights`) for both plans, a
fixed batch (:func:`data`), a batch size (``BATCH``). Beside the MLP and
the 3x3 conv net:

* ``tutorial_convnet``: TensorFlow Privacy's MNIST tutorial convnet (8x8x16
  stride 2 SAME, max pool 2/1, 4x4x32 stride 2 VALID, max pool 2/1, dense
  32, dense 10 on 28x28x1), batch 128;
* ``bert_small``: a BERT encoder of keras_hub's small sizes (2 post-LN
  layers, hidden 64, 2 heads, intermediate 128 gelu, sequence 16,
  vocabulary 1000; token embedding plus a position embedding added by
  broadcast, then a LayerNorm), a dense 2-class classifier on the first
  token, batch 128; ``einsum`` projections in the graph."""

from typing import Dict, Iterator, List, Tuple

import numpy as np

MODELS = ("mlp6x512", "convnet", "tutorial_convnet", "bert_small")
BATCH: Dict[str, int] = {"mlp6x512": 256, "convnet": 256,
                         "tutorial_convnet": 128, "bert_small": 128}
VOCAB, SEQ, HIDDEN, HEADS, INTER, LAYERS, CLASSES = 1000, 16, 64, 2, 128, 2, 2
LN_EPS = 1e-12  # BERT's


def _bert_spec() -> List[Tuple[Tuple[int, ...], str]]:
  """``(shape, init)`` of each weight, in order; init ``normal`` (BERT's
  N(0, 0.02)), ``zeros`` or ``ones``."""
  h = HIDDEN
  ln = [((h,), "ones"), ((h,), "zeros")]
  spec = [((VOCAB, h), "normal"), ((SEQ, h), "normal")] + ln
  for _ in range(LAYERS):
    spec += [((h, h), "normal"), ((h,), "zeros")] * 4  # q, k, v, output
    spec += ln + [((h, INTER), "normal"), ((INTER,), "zeros"),
                  ((INTER, h), "normal"), ((h,), "zeros")] + ln
  return spec + [((h, CLASSES), "normal"), ((CLASSES,), "zeros")]


def weights(model: str) -> List[np.ndarray]:
  """The model's initial weights, in layer order, in the graph's shapes."""
  rng = np.random.default_rng(0)
  if model == "bert_small":
    return [(rng.normal(size=s) * 0.02).astype(np.float32) if init == "normal"
            else getattr(np, init)(s, np.float32) for s, init in _bert_spec()]
  shapes = {
      "mlp6x512": [(512, 512)] * 5 + [(512, 10)],
      "convnet": [(3, 3, 1, 16), (3, 3, 16, 32), (14 * 14 * 32, 10)],
      "tutorial_convnet": [(8, 8, 1, 16), (4, 4, 16, 32), (4 * 4 * 32, 32),
                           (32, 10)],
  }[model]
  out = []
  for s in shapes:
    fan_in = int(np.prod(s[:-1]))
    out += [(rng.normal(size=s) * np.sqrt(2.0 / fan_in)).astype(np.float32),
            np.zeros(s[-1], np.float32)]
  return out


def data(model: str, batch: int) -> Tuple[np.ndarray, np.ndarray]:
  """A fixed batch: inputs (token ids for BERT) and integer labels."""
  rng = np.random.default_rng(1)
  if model == "bert_small":
    return (rng.integers(0, VOCAB, (batch, SEQ)).astype(np.int32),
            rng.integers(0, CLASSES, batch).astype(np.int32))
  shape = (batch, 512) if model == "mlp6x512" else (batch, 28, 28, 1)
  return (rng.normal(size=shape).astype(np.float32),
          rng.integers(0, 10, batch).astype(np.int32))


# -- tf.compat.v1 -------------------------------------------------------------


def graph_loss(model: str, batch: int):
  """(per-example loss, x, y) in the default tf.Graph."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  ws = iter(weights(model))

  def layer(name):
    with tf1.variable_scope(name):
      return (tf1.get_variable("kernel", initializer=next(ws)),
              tf1.get_variable("bias", initializer=next(ws)))

  y = tf1.placeholder(tf.int32, [batch])
  if model == "bert_small":
    x = tf1.placeholder(tf.int32, [batch, SEQ])
    h = _graph_bert(x, ws, batch)
  elif model == "mlp6x512":
    x = tf1.placeholder(tf.float32, [batch, 512])
    h = x
    for i in range(6):
      k, b = layer(f"l{i}")
      h = tf.nn.bias_add(tf.matmul(h, k), b)
      h = tf.nn.relu(h) if i < 5 else h
  elif model == "convnet":
    x = tf1.placeholder(tf.float32, [batch, 28, 28, 1])
    h = x
    for name, stride in (("c1", 1), ("c2", 2)):
      k, b = layer(name)
      h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, k, stride, "SAME"), b))
    k, b = layer("out")
    h = tf.nn.bias_add(tf.matmul(tf.reshape(h, [batch, -1]), k), b)
  else:
    x = tf1.placeholder(tf.float32, [batch, 28, 28, 1])
    h = x
    for name, stride, padding in (("c1", 2, "SAME"), ("c2", 2, "VALID")):
      k, b = layer(name)
      h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, k, stride, padding), b))
      h = tf.nn.max_pool2d(h, 2, 1, "VALID")
    h = tf.reshape(h, [batch, -1])
    for name in ("d1", "out"):
      k, b = layer(name)
      h = tf.nn.bias_add(tf.matmul(h, k), b)
      h = tf.nn.relu(h) if name == "d1" else h
  loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h)
  return loss, x, y


def _graph_bert(ids, ws: Iterator[np.ndarray], batch: int):
  """BERT's forward pass in tf.compat.v1 ops: the logits ``[B, 2]``."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf1 = tf.compat.v1
  h, n, d = HIDDEN, HEADS, HIDDEN // HEADS

  def var(name):
    return tf1.get_variable(name, initializer=next(ws))

  def dense(x, name):  # x: [B, T, p]
    with tf1.variable_scope(name):
      return tf.nn.bias_add(tf.einsum("btp,pq->btq", x, var("kernel")),
                            var("bias"))

  def layer_norm(x, name):
    with tf1.variable_scope(name):
      gamma, beta = var("gamma"), var("beta")
      mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
      return (x - mean) * tf.math.rsqrt(variance + LN_EPS) * gamma + beta

  def heads(x):  # [B, T, H] -> [B, n, T, d]
    return tf.transpose(tf.reshape(x, [batch, SEQ, n, d]), [0, 2, 1, 3])

  with tf1.variable_scope("embeddings"):
    x = tf.gather(var("token"), ids) + var("position")  # [B, T, H]
    x = layer_norm(x, "layer_norm")
  for i in range(LAYERS):
    with tf1.variable_scope(f"layer{i}"):
      q, k, v = (heads(dense(x, name)) for name in ("query", "key", "value"))
      probs = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / np.sqrt(d))
      ctx = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]),
                       [batch, SEQ, h])
      x = layer_norm(x + dense(ctx, "attention_output"), "attention_norm")
      f = tf.nn.gelu(dense(x, "intermediate"), approximate=False)
      x = layer_norm(x + dense(f, "output"), "output_norm")
  with tf1.variable_scope("classifier"):
    return tf.nn.bias_add(tf.matmul(x[:, 0], var("kernel")), var("bias"))


# -- Keras 3 ------------------------------------------------------------------


def keras_model(model: str):
  """The Keras 3 model, with :func:`weights`."""
  import keras  # pylint: disable=g-import-not-at-top
  if model == "bert_small":
    return _keras_bert()
  L = keras.layers
  if model == "mlp6x512":
    layers = [keras.Input((512,))] + [
        L.Dense(512, activation="relu") for _ in range(5)] + [L.Dense(10)]
  elif model == "convnet":
    layers = [keras.Input((28, 28, 1)),
              L.Conv2D(16, 3, padding="same", activation="relu"),
              L.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
              L.Flatten(), L.Dense(10)]
  else:
    layers = [keras.Input((28, 28, 1)),
              L.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
              L.MaxPool2D(2, 1),
              L.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
              L.MaxPool2D(2, 1),
              L.Flatten(), L.Dense(32, activation="relu"), L.Dense(10)]
  net = keras.Sequential(layers)
  net.set_weights(weights(model))
  return net


def _keras_bert():
  """BERT from keras.layers, and a layer of its own for the position
  embedding (a ``[T, H]`` variable added by broadcast, as keras_hub's
  ``PositionEmbedding``)."""
  import keras  # pylint: disable=g-import-not-at-top
  L = keras.layers
  h, n = HIDDEN, HEADS

  class PositionEmbedding(L.Layer):

    def build(self, input_shape):
      self.embeddings = self.add_weight(
          shape=(SEQ, h), initializer="zeros", name="embeddings")

    def call(self, x):
      return x + self.embeddings

  def norm():
    return L.LayerNormalization(epsilon=LN_EPS)

  ids = keras.Input((SEQ,), dtype="int32")
  order = [L.Embedding(VOCAB, h), PositionEmbedding(), norm()]
  x = order[2](order[1](order[0](ids)))
  for _ in range(LAYERS):
    attention = L.MultiHeadAttention(n, h // n)
    attention_norm, output_norm = norm(), norm()
    intermediate = L.Dense(INTER, activation="gelu")
    output = L.Dense(h)
    x = attention_norm(x + attention(x, x))
    x = output_norm(x + output(intermediate(x)))
    order += [attention, attention_norm, intermediate, output, output_norm]
  classifier = L.Dense(CLASSES)
  net = keras.Model(ids, classifier(x[:, 0]))
  ws = iter(weights("bert_small"))
  for layer in order + [classifier]:
    layer.set_weights([next(ws).reshape(v.shape) for v in layer.weights])
  return net
