"""Small problems for examples and notebooks: data and the seed network.

Example:
  >>> from graphgrad import demo
  >>> demo.seed_problem(0).x_train.shape
  (2048, 10)
"""

from graphgrad.cli._demo import (
                             DomainShiftProblem,
                             Problem,
                             dense,
                             domain_shift_problem,
                             seed_network,
                             seed_problem,
)

import tensorflow as tf

__all__ = ["DomainShiftProblem", "Problem", "dense", "domain_shift_problem",
           "seed_network", "seed_problem", "two_layer_loss"]


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
