"""One model description, built as a Keras model and as a TF1 graph.

A case's ``forward(ops, x)`` is written once against a tiny ops interface;
``KerasOps`` builds a functional Keras model (Keras 3 or tf-keras) and
``TF1Ops`` builds the same network from ``get_variable`` with the Keras
model's weights, so that the TF1 plan and the TF2 plan see equal numbers.
"""

import zlib

import keras
import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1

# The two Keras flavours every KerasPlan test runs on: tf-keras (tf.keras
# under TF_USE_LEGACY_KERAS=1) and Keras 3. On TensorFlow 2.15 both are the
# Keras 2 it bundles as keras (is_keras3 tells them apart).
FLAVOURS = {"tf_keras": tf.keras, "keras3": keras}


def is_keras3(K) -> bool:
  """True when the Keras module ``K`` is Keras 3; False for tf-keras and for
  TensorFlow 2.15's Keras 2."""
  return (K.__name__.split(".", 1)[0] == "keras"
          and keras.__version__.startswith("3."))

_ACT = {None: None, "tanh": tf.tanh, "relu": tf.nn.relu}


class KerasOps:
  """Builds layers of Keras module ``K`` on symbolic Keras inputs."""

  def __init__(self, K):
    self.K = K

  def dense(self, x, units, name, act=None):
    seed = zlib.crc32(name.encode()) % 10000
    init = self.K.initializers.RandomNormal
    return self.K.layers.Dense(
        units, activation=act, name=name,
        kernel_initializer=init(stddev=0.6, seed=seed),
        bias_initializer=init(stddev=0.2, seed=seed + 1))(x)

  def add(self, a, b):
    return self.K.layers.Add()([a, b])

  def concat(self, a, b):
    return self.K.layers.Concatenate()([a, b])

  def relu(self, a):
    return self.K.layers.Activation("relu")(a)


class TF1Ops:
  """Builds the same layers in the default tf.Graph from given weights."""

  def __init__(self, weights):
    self.weights = weights  # layer name -> [kernel, bias]

  def dense(self, x, units, name, act=None):
    kernel, bias = self.weights[name]
    with tf1.variable_scope(name):
      w = tf1.get_variable("kernel", initializer=kernel)
      b = tf1.get_variable("bias", initializer=bias)
      out = tf.nn.bias_add(tf.matmul(x, w), b)
      # Inside the scope: a Keras Dense's output is after its activation.
      return _ACT[act](out) if act else out

  def add(self, a, b):
    return a + b

  def concat(self, a, b):
    return tf.concat([a, b], -1)

  def relu(self, a):
    return tf.nn.relu(a)


def _ce(labels, logits):
  return tf.reduce_mean(
      tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def nonlinear(g):
  """A transform whose position in the backward pass changes the result."""
  return 3.0 * g - 0.05 * tf.sign(g)


class Chain:
  """x -> l1 -> l2 -> l3; two upstream transforms compose top-down."""
  inputs, classes = 6, (3,)

  @staticmethod
  def forward(ops, x):
    h = ops.dense(x, 8, "l1", "tanh")
    h = ops.dense(h, 5, "l2", "tanh")
    return [ops.dense(h, 3, "l3")]

  @staticmethod
  def loss(outputs, labels):
    return _ce(labels[0], outputs[0])

  @staticmethod
  def declare(plan, gg):
    return (plan.transform_upstream("l3", gg.transforms.scale(2.0))
            .transform_upstream("l2", nonlinear)
            .transform_gradients("l1", gg.transforms.scale(0.5)))


class Skip:
  """A skip connection around l2: its bypass gradient stays unchanged."""
  inputs, classes = 6, (3,)

  @staticmethod
  def forward(ops, x):
    h1 = ops.dense(x, 5, "l1", "tanh")
    h2 = ops.dense(h1, 5, "l2", "tanh")
    return [ops.dense(ops.add(h1, h2), 3, "l3")]

  @staticmethod
  def loss(outputs, labels):
    return _ce(labels[0], outputs[0])

  @staticmethod
  def declare(plan, gg):
    return (plan.transform_upstream("l2", gg.transforms.clip_by_norm(0.05))
            .transform_upstream("l3", gg.transforms.scale(-0.5)))


class TwoHeads:
  """Features feed a class head and a domain head; the edge is reversed."""
  inputs, classes = 6, (3, 2)

  @staticmethod
  def forward(ops, x):
    base = ops.dense(x, 8, "base", "tanh")
    feats = ops.dense(base, 6, "features", "tanh")
    return [ops.dense(feats, 3, "head"), ops.dense(feats, 2, "domain_head")]

  @staticmethod
  def loss(outputs, labels):
    return _ce(labels[0], outputs[0]) + _ce(labels[1], outputs[1])

  @staticmethod
  def declare(plan, gg):
    return (plan.transform_upstream("domain_head", gg.transforms.scale(2.0))
            .transform_edge("features", "domain_head",
                            gg.transforms.reverse(0.3))
            .transform_upstream("features", nonlinear))


class GlueEdge:
  """The edge runs through glue (relu, concat) beside a layer (mid)."""
  inputs, classes = 6, (3, 2)

  @staticmethod
  def forward(ops, x):
    feats = ops.dense(x, 6, "features", "tanh")
    mid = ops.dense(feats, 4, "mid", "tanh")
    dom = ops.dense(ops.concat(ops.relu(feats), mid), 2, "domain_head")
    return [ops.dense(feats, 3, "head"), dom]

  @staticmethod
  def loss(outputs, labels):
    return _ce(labels[0], outputs[0]) + _ce(labels[1], outputs[1])

  @staticmethod
  def declare(plan, gg):
    return plan.transform_edge(
        "features", "domain_head",
        lambda g: -0.5 * g + 0.01 * tf.sign(g))  # nonlinear on purpose


CASES = {"chain": Chain, "skip": Skip, "two_heads": TwoHeads,
         "glue_edge": GlueEdge}


class ReluChain:
  """fc0 -> fc1 -> ... with ReLU between and a squared error, He-initialised
  (normal kernels of variance 2 / fan-in, biases of scale 0.1); ``scaled``
  maps a layer to the factors of its kernel and bias."""
  inputs = 8

  def __init__(self, depth, scaled=None, width=16, seed=0):
    rng = np.random.default_rng(seed)
    widths = [self.inputs] + [width] * (depth - 1) + [4]
    self.classes = (widths[-1],)
    self.weights = {}
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
      kernel, bias = (rng.normal(size=(a, b)) * np.sqrt(2 / a),
                      rng.normal(size=b) * 0.1)
      k, c = (scaled or {}).get(f"fc{i}", (1, 1))
      self.weights[f"fc{i}"] = [(kernel * k).astype(np.float32),
                                (bias * c).astype(np.float32)]

  def forward(self, ops, x):
    last = len(self.weights) - 1
    for i, (name, (kernel, _)) in enumerate(self.weights.items()):
      x = ops.dense(x, kernel.shape[1], name, "relu" if i < last else None)
    return [x]

  @staticmethod
  def loss(outputs, labels):
    return tf.reduce_mean(tf.square(outputs[0] - labels[0]))

  def keras_model(self, K):
    model = keras_model(self, K)
    for name, values in self.weights.items():
      model.get_layer(name).set_weights(values)
    return model


# Chains whose gradient flow is known by construction, and the flags a
# person reading their gradient norms would set.
FLAGGED_CHAINS = {
    # fc3's kernel is 1e-4 of its initial value: every gradient below it
    # passes through that kernel and shrinks 1e4-fold; fc3's own gradient
    # depends on its input, not on its weights, and stays normal.
    "tiny_top": (ReluChain(4, {"fc3": (1e-4, 1)}),
                 {"fc0": "vanishing", "fc1": "vanishing",
                  "fc2": "vanishing"}),
    # fc4's kernel 1e4 times larger, fc3's kernel and bias 1e4 times
    # smaller: ReLU is positively homogeneous, so the forward pass and the
    # loss stay the same, but the gradient grows 1e4-fold through fc4's
    # kernel into fc3 (and shrinks back through fc3's kernel). fc3's
    # gradient jumps by four orders of magnitude; fc4's own is then mostly
    # its bias's, and every other layer's is unchanged.
    "exploding_middle": (ReluChain(8, {"fc4": (1e4, 1), "fc3": (1e-4, 1e-4)}),
                         {"fc3": "exploding"}),
    # He initialisation, eight layers: nothing to flag.
    "he_init": (ReluChain(8), {}),
    # fc1's kernel is 1e-4 of its initial value; its bias carries the
    # forward pass, so its own gradient is normal (and its gradient to
    # weight ratio huge). Only fc0's gradient passes through the kernel.
    "small_middle": (ReluChain(4, {"fc1": (1e-4, 1)}), {"fc0": "vanishing"}),
}


def keras_model(case, K):
  inp = K.Input((case.inputs,))
  return K.Model(inp, case.forward(KerasOps(K), inp))


def batch(case, rows=16, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, case.inputs)).astype(np.float32)
  labels = tuple(np.eye(c, dtype=np.float32)[rng.integers(0, c, rows)]
                 for c in case.classes)
  return x, labels


def layer_weights(model):
  return {l.name: [np.asarray(w) for w in l.get_weights()]
          for l in model.layers if l.weights}


def chain_by_hand(model, x, labels):
  """Chain's declarations (l3's upstream scaled by 2, l2's by
  ``nonlinear``) applied by hand with ``GradientTape``, as the seed recipe
  does: the gradients at the outputs of l3 (``out``) and l2 (``h2`` before
  ``nonlinear``, ``h2_after`` after), the plain one at l1's (``h1_plain``),
  and per layer its variables' gradients before its own transforms
  (``l1``, ``l2``, ``l3``; ``l1_plain`` by the plain chain rule)."""
  l1, l2, l3 = (model.get_layer(n) for n in ("l1", "l2", "l3"))
  with tf.GradientTape(persistent=True) as tape:
    h1 = l1(tf.constant(x))
    h2 = l2(h1)
    out = l3(h2)
    loss = Chain.loss([out], [tf.constant(labels[0])])
  g3 = tape.gradient(loss, out)
  g2 = tape.gradient(out, h2, output_gradients=2.0 * g3)
  g2_after = nonlinear(g2)
  return {
      "out": g3, "h2": g2, "h2_after": g2_after,
      "h1_plain": tape.gradient(loss, h1),
      "l1": tape.gradient(h2, l1.trainable_variables,
                          output_gradients=g2_after),
      "l1_plain": tape.gradient(loss, l1.trainable_variables),
      "l2": tape.gradient(out, l2.trainable_variables,
                          output_gradients=2.0 * g3),
      "l3": tape.gradient(loss, l3.trainable_variables),
  }


def two_dense(K, seed):
  """``l1`` (3 -> 4) and ``l2`` (4 -> 2), Dense, normal initial weights."""
  init = K.initializers.RandomNormal(stddev=0.5, seed=seed)
  return K.Sequential([K.Input((3,)),
                       K.layers.Dense(4, name="l1", kernel_initializer=init),
                       K.layers.Dense(2, name="l2", kernel_initializer=init)])


def tanh_chain(K, x):
  """``l1``, ``l2``, ``l3``: Dense(5, tanh) with normal initial weights
  (seeded by layer), built on ``x``."""
  model = K.Sequential([K.layers.Dense(
      5, activation="tanh", name=f"l{i}",
      kernel_initializer=K.initializers.RandomNormal(stddev=0.6, seed=i))
      for i in (1, 2, 3)])
  model(x)
  return model


def normal_rows(seed, shape=(5, 3)):
  """A float32 constant of standard normal values."""
  return tf.constant(np.random.default_rng(seed).normal(size=shape),
                     tf.float32)
