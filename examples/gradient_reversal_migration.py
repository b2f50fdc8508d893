"""Migrates a tutorial-style gradient-reversal model to a graphgrad plan.

The original is the domain-adversarial network of the TF1 tutorials: unscoped
``tf.Variable`` weights, and the classic ``flip_gradient`` written with
``gradient_override_map`` in front of the domain classifier. The migrated
model is the same code without ``flip_gradient``; one plan line puts the
reversal back. Both train side by side from the same initial weights, and the
script prints how far apart their weights are after each step.

Run it from a checkout::

  python examples/gradient_reversal_migration.py

docs/migration.md shows its parts; tests/test_migration.py runs them.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import graphgrad as gg  # noqa: E402

tf1 = tf.compat.v1
LAMBDA = 0.3


# --8<-- [start:flip_gradient]
class FlipGradientBuilder:
  """The classic flip_gradient: identity forward, -l * grad backward."""

  def __init__(self):
    self.num_calls = 0

  def __call__(self, x, l=1.0):
    grad_name = "FlipGradient%d" % self.num_calls

    @tf.RegisterGradient(grad_name)
    def _flip_gradients(op, grad):
      return [tf.negative(grad) * l]

    g = tf1.get_default_graph()
    with g.gradient_override_map({"Identity": grad_name}):
      y = tf.identity(x)
    self.num_calls += 1
    return y


flip_gradient = FlipGradientBuilder()
# --8<-- [end:flip_gradient]


def data(seed=0, n=64):
  """Source features, class labels and domain labels."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 8)).astype(np.float32)
  y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, n)]
  d = np.eye(2, dtype=np.float32)[rng.integers(0, 2, n)]
  return x, y, d


def _init(seed, *shape):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)


# --8<-- [start:model]
def model(x, y, d, flip=None):
  """Features, a label classifier, and a domain classifier behind ``flip``."""
  W0 = tf1.Variable(_init(0, 8, 16))
  b0 = tf1.Variable(tf.zeros([16]))
  W1 = tf1.Variable(_init(1, 16, 3))
  b1 = tf1.Variable(tf.zeros([3]))
  W2 = tf1.Variable(_init(2, 16, 2))
  b2 = tf1.Variable(tf.zeros([2]))
  feature = tf.nn.relu(tf.matmul(x, W0) + b0)
  label_logits = tf.matmul(feature, W1) + b1
  domain_in = flip(feature, LAMBDA) if flip else feature
  domain_logits = tf.matmul(domain_in, W2) + b2
  label_loss = tf.reduce_mean(tf1.nn.softmax_cross_entropy_with_logits_v2(
      labels=y, logits=label_logits))
  domain_loss = tf.reduce_mean(tf1.nn.softmax_cross_entropy_with_logits_v2(
      labels=d, logits=domain_logits))
  return label_loss + domain_loss
# --8<-- [end:model]


def original(lr=0.1):
  """The tutorial's graph: ``(graph, loss, train_op, placeholders)``."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf1.placeholder(tf.float32, [None, 8])
    y = tf1.placeholder(tf.float32, [None, 3])
    d = tf1.placeholder(tf.float32, [None, 2])
    # --8<-- [start:original]
    loss = model(x, y, d, flip=flip_gradient)
    train_op = tf1.train.GradientDescentOptimizer(lr).minimize(loss)
    # --8<-- [end:original]
  return graph, loss, train_op, (x, y, d)


def migrated(lr=0.1):
  """The same model and one plan line: ``(graph, loss, train_op, ...)``."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf1.placeholder(tf.float32, [None, 8])
    y = tf1.placeholder(tf.float32, [None, 3])
    d = tf1.placeholder(tf.float32, [None, 2])
    # --8<-- [start:migrated]
    loss = model(x, y, d)  # no flip_gradient
    net = gg.analyze(loss)  # layers MatMul, MatMul_1, MatMul_2
    plan = gg.GradientPlan(loss, net).transform_edge(
        "MatMul", "MatMul_2", gg.transforms.reverse(LAMBDA))
    train_op = plan.apply_gradients(tf1.train.GradientDescentOptimizer(lr))
    # --8<-- [end:migrated]
  return graph, loss, train_op, (x, y, d)


def train_side_by_side(steps=5, batch=16):
  """Trains both; returns per step the largest weight difference and losses."""
  runs = [original(), migrated()]
  sessions = []
  for graph, _, _, _ in runs:
    sess = tf1.Session(graph=graph)
    with graph.as_default():
      sess.run(tf1.global_variables_initializer())
    sessions.append(sess)
  x, y, d = data()
  history = []
  for step in range(steps):
    rows = slice(step * batch % len(x), step * batch % len(x) + batch)
    losses, weights = [], []
    for (graph, loss, train_op, phs), sess in zip(runs, sessions):
      feed = dict(zip(phs, (x[rows], y[rows], d[rows])))
      _, value = sess.run([train_op, loss], feed)
      with graph.as_default():
        weights.append(sess.run(tf1.trainable_variables()))
      losses.append(float(value))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(*weights))
    history.append((diff, losses[0], losses[1]))
  for sess in sessions:
    sess.close()
  return history


if __name__ == "__main__":
  for i, (diff, a, b) in enumerate(train_side_by_side(), 1):
    print(f"step {i}: loss original {a:.5f}, plan {b:.5f}; largest weight "
          f"difference {diff:.2e}")
