"""The seed problem: a two-layer network on a fixed synthetic dataset.

Used by ``graphgrad demo`` and the notebooks, so that both show the same
numbers. Built from ``tf.compat.v1.get_variable`` under ``variable_scope``,
which needs no tf-keras.
"""

import dataclasses
from typing import Tuple

import numpy as np
import tensorflow as tf


@dataclasses.dataclass
class Problem:
  """A fixed-seed classification problem: train and test splits."""
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray

  def batches(self, batch_size: int, seed: int):
    """Yields ``(x, y)`` minibatches forever, reshuffled each epoch."""
    rng = np.random.default_rng(seed)
    n = len(self.x_train)
    while True:
      order = rng.permutation(n)
      for i in range(0, n - batch_size + 1, batch_size):
        idx = order[i:i + batch_size]
        yield self.x_train[idx], self.y_train[idx]


def seed_problem(seed: int = 0, n_train: int = 2048, n_test: int = 1024,
                 dims: int = 10, classes: int = 2) -> Problem:
  """Labels from a random teacher network: learnable, not linearly trivial.

  Example:
    >>> p = seed_problem(0)
    >>> p.x_train.shape, p.y_train.shape
    ((2048, 10), (2048, 2))
  """
  rng = np.random.default_rng(seed)
  w1 = rng.normal(size=(dims, 16))
  w2 = rng.normal(size=(16, classes))
  x = rng.normal(size=(n_train + n_test, dims)).astype(np.float32)
  labels = np.argmax(np.tanh(x @ w1) @ w2, axis=1)
  y = np.eye(classes, dtype=np.float32)[labels]
  return Problem(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def dense(x: tf.Tensor, units: int, name: str) -> tf.Tensor:
  """A dense layer from ``get_variable``: ``name/kernel`` and ``name/bias``."""
  with tf.compat.v1.variable_scope(name):
    w = tf.compat.v1.get_variable(
        "kernel", [x.shape[-1], units],
        initializer=tf.compat.v1.glorot_uniform_initializer())
    b = tf.compat.v1.get_variable("bias", [units],
                                  initializer=tf.compat.v1.zeros_initializer())
    return tf.nn.bias_add(tf.matmul(x, w), b)


def seed_network(dims: int = 10, classes: int = 2, hidden: int = 20
                 ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
  """The seed's ``x -> l1_dense -> l2_dense -> loss`` in the default graph.

  Returns:
    ``(x, y, logits, loss)``: the two placeholders, the logits and the mean
    softmax cross-entropy.
  """
  x = tf.compat.v1.placeholder(tf.float32, [None, dims], name="x")
  y = tf.compat.v1.placeholder(tf.float32, [None, classes], name="y")
  h = dense(x, hidden, "l1_dense")
  logits = dense(h, classes, "l2_dense")
  loss = tf.reduce_mean(
      tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits),
      name="loss")
  return x, y, logits, loss
