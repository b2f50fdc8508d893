"""Small problems for examples and notebooks: data and the seed network.

The seed problem is a two-layer network on a fixed synthetic dataset, used by
``graphgrad demo`` and the notebooks so that both show the same numbers. It
is built from ``tf.compat.v1.get_variable`` under ``variable_scope``, which
needs no tf-keras.

Example:
  >>> from graphgrad import demo
  >>> demo.seed_problem(0).x_train.shape
  (2048, 10)
"""

import dataclasses
from typing import Tuple

import numpy as np
import tensorflow as tf

from graphgrad import _errors

__all__ = ["DomainShiftProblem", "Problem", "dense", "domain_shift_problem",
           "multi_digits_problem", "seed_network", "seed_problem",
           "two_layer_loss"]


@dataclasses.dataclass
class Problem:
  """A fixed-seed classification problem: train and test splits."""
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray

  def batches(self, batch_size: int, seed: int):
    """An endless iterator of ``(x, y)`` minibatches, reshuffled each epoch.

    Raises:
      GraphGradError: unless ``1 <= batch_size <= len(x_train)``: a larger
        batch never fills, and the iterator would loop without yielding.
    """
    n = len(self.x_train)
    if (not isinstance(batch_size, (int, np.integer))
        or isinstance(batch_size, bool) or not 1 <= batch_size <= n):
      raise _errors.GraphGradError(
          f"`batch_size` must be an int from 1 to the {n} training examples; "
          f"got {batch_size!r}. Pass a smaller batch.")
    return self._batches(int(batch_size), seed)

  def _batches(self, batch_size: int, seed: int):
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


@dataclasses.dataclass
class DomainShiftProblem:
  """Two domains with one labelling: ``source`` is labelled, ``target`` is not.

  ``target`` holds labels too, for evaluation only. The domains differ by a
  shift along ``direction``, which the labels do not depend on.
  """
  source: Problem
  target: Problem
  direction: np.ndarray


def domain_shift_problem(seed: int = 0, n_train: int = 2048,
                         n_test: int = 1024, dims: int = 10,
                         classes: int = 2, shift: float = 3.0
                         ) -> DomainShiftProblem:
  """A source and a shifted target domain for domain adaptation.

  Both domains draw ``x ~ N(0, I)`` and label it with the same random teacher
  network, which looks only at the first ``dims - 2`` coordinates. The target
  adds ``shift`` times a unit vector in the last two coordinates, so a domain
  classifier separates the domains easily unless the features ignore that
  direction, and ignoring it costs the labels nothing.

  Example:
    >>> p = domain_shift_problem(0)
    >>> p.source.x_train.shape, p.target.y_test.shape
    ((2048, 10), (1024, 2))
    >>> float(np.round(p.target.x_train.mean(0) @ p.direction, 0))
    3.0
  """
  rng = np.random.default_rng(seed)
  informative = dims - 2
  w1 = rng.normal(size=(informative, 16))
  w2 = rng.normal(size=(16, classes))
  direction = np.zeros(dims, np.float32)
  angle = rng.uniform(0, 2 * np.pi)
  direction[-2:] = np.cos(angle), np.sin(angle)

  def domain(offset):
    x = rng.normal(size=(n_train + n_test, dims)).astype(np.float32)
    labels = np.argmax(np.tanh(x[:, :informative] @ w1) @ w2, axis=1)
    y = np.eye(classes, dtype=np.float32)[labels]
    x = x + offset * direction
    return Problem(x[:n_train], y[:n_train], x[n_train:], y[n_train:])

  return DomainShiftProblem(domain(0.0), domain(shift), direction)


MULTI_DIGITS_TASKS = ("left", "right", "parity")


def multi_digits_problem(seed: int = 0, n_train: int = 4096,
                         n_test: int = 1024) -> Problem:
  """MultiDigits: two of scikit-learn's 8x8 digits side by side, three tasks.

  Like MultiMNIST (Sener & Koltun, 2018), from the digits bundled with
  scikit-learn (1,797 images, no download; needs scikit-learn). The digits
  are split 80/20 once (stratified, ``random_state=0``), so no test image is
  seen in training; each example pastes a random left and right digit of
  its split into an 8 x 16 image (pixels / 16), flattened to 128 values.
  ``y`` holds one integer label per task of ``MULTI_DIGITS_TASKS``: the
  left digit, the right digit, and the parity of their sum.

  Example:
    >>> p = multi_digits_problem(0, n_train=256, n_test=64)
    >>> p.x_train.shape, p.y_test.shape
    ((256, 128), (64, 3))
    >>> bool(((p.y_train[:, 0] + p.y_train[:, 1]) % 2 == p.y_train[:, 2]).all())
    True
  """
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  from sklearn.model_selection import train_test_split  # pylint: disable=g-import-not-at-top
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)
  split = train_test_split(images, digits.target, test_size=0.2,
                           random_state=0, stratify=digits.target)
  rng = np.random.default_rng(seed)

  def pairs(pool, labels, n):
    left, right = rng.integers(len(pool), size=(2, n))
    x = np.concatenate([pool[left], pool[right]], axis=2).reshape(n, -1)
    y = np.stack([labels[left], labels[right],
                  (labels[left] + labels[right]) % 2], axis=1)
    return x, y.astype(np.int64)

  x_train, y_train = pairs(split[0], split[2], n_train)
  x_test, y_test = pairs(split[1], split[3], n_test)
  return Problem(x_train, y_train, x_test, y_test)


def two_layer_loss() -> tf.Tensor:
  """The two-layer loss of the docstring examples, in the default tf.Graph.

  ``x = [[1, 2]]``, layer ``l1``: ``h = x @ w`` with ``w = [[1], [1]]``;
  layer ``l2``: ``y = h * w`` with ``w = 3``; the loss is ``sum(y)``. Its
  plain gradients are ``[[3], [6]]`` for ``l1/w`` and ``3`` for ``l2/w``, and
  the upstream gradient at ``h`` is 3.

  Example:
    >>> with tf.Graph().as_default():
    ...   loss = two_layer_loss()
    ...   print(sorted(v.op.name for v in tf.compat.v1.trainable_variables()))
    ['l1/w', 'l2/w']
  """
  x = tf.constant([[1.0, 2.0]])
  with tf.compat.v1.variable_scope("l1"):
    h = x @ tf.compat.v1.get_variable("w", initializer=[[1.0], [1.0]])
  with tf.compat.v1.variable_scope("l2"):
    y = h * tf.compat.v1.get_variable("w", initializer=3.0)
  return tf.reduce_sum(y)
