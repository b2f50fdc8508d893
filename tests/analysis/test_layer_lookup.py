"""A name that is not a layer: the message says exactly why."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense

tf1 = tf.compat.v1


def _net_with_frozen_and_unused():
  x = tf1.placeholder(tf.float32, [None, 3])
  h = dense(x, 3, "stem", tf.tanh)
  with tf1.variable_scope("frozen"):
    f = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32),
                         trainable=False)
    h = h @ f
  with tf1.variable_scope("unused"):
    u = tf1.get_variable("w", initializer=np.eye(3, dtype=np.float32))
  del u
  return tf.reduce_sum(dense(h, 2, "top"))


@pytest.mark.parametrize("declare", [
    lambda plan, n: plan.transform_upstream(n, gg.transforms.scale(2.0)),
    lambda plan, n: plan.transform_gradients(n, gg.transforms.scale(2.0)),
    lambda plan, n: plan.replace_backward(
        n, gg.backward.feedback_alignment(seed=0)),
])
def test_layer_of_non_trainable_variables(graph, declare):
  loss = _net_with_frozen_and_unused()
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.LayerNotFoundError,
                     match=r"`layer` 'frozen' holds only non-trainable "
                           r"variables \(frozen/w:0\), which get no gradient, "
                           r"so it is not a layer of the plan\. Make them "
                           r"trainable \(trainable=True\) to transform them, "
                           r"or transform one of the layers with trainable "
                           r"variables: stem, top"):
    declare(plan, "frozen")


def test_edge_names_the_argument(graph):
  loss = _net_with_frozen_and_unused()
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.LayerNotFoundError,
                     match=r"`upper` 'frozen' holds only non-trainable"):
    plan.transform_edge("stem", "frozen", gg.transforms.scale(2.0))


def test_layer_that_does_not_reach_the_loss(graph):
  loss = _net_with_frozen_and_unused()
  net = gg.analyze(loss)
  with pytest.raises(gg.NotConnectedError,
                     match=r"`layer` 'unused' names variables "
                           r"\(unused/w:0\) that the loss Sum:0 does not "
                           r"depend on, so the layer does not reach the loss"):
    net.lookup("unused", "layer")
  with pytest.raises(gg.NotConnectedError, match=r"does not reach the loss"):
    gg.GradientPlan(loss, net).transform_upstream("unused", lambda g: g)


def test_indexing_the_layer_graph_explains_too(graph):
  net = gg.analyze(_net_with_frozen_and_unused())
  with pytest.raises(gg.LayerNotFoundError,
                     match=r"`name` 'frozen' holds only non-trainable"):
    net["frozen"]  # pylint: disable=pointless-statement
  with pytest.raises(gg.LayerNotFoundError, match=r"no layer named 'nope'"):
    net["nope"]  # pylint: disable=pointless-statement


def test_sub_scope_of_a_depth_grouped_layer(graph):
  x = tf1.placeholder(tf.float32, [None, 3])
  h = dense(dense(x, 3, "net/block/conv1"), 3, "net/block/conv2")
  loss = tf.reduce_sum(dense(h, 1, "head"))
  net = gg.analyze(loss, depth=2)
  with pytest.raises(gg.LayerNotFoundError,
                     match=r"`layer` 'net/block/conv1' lies inside the layer "
                           r"'net/block' \(its variables were grouped, e\.g\. "
                           r"by depth=\)"):
    gg.GradientPlan(loss, net).transform_upstream("net/block/conv1",
                                                  gg.transforms.scale(2.0))
