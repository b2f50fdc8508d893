"""GradientPlan.recompute(keep=...) with tensors, and plan.kept_tensors().

A kept tensor is named (``"l1/Tanh:0"``, or an op with one output), or
passed as the ``tf.Tensor``; the gradients equal ``tf.gradients``, and the
backward pass reads the forward tensor itself, not a copy.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from helpers import dense, feed

tf1 = tf.compat.v1


def _chain(depth=4):
  x = tf1.placeholder(tf.float32, [None, 6])
  h, outs = x, []
  for i in range(depth):
    h = dense(h, 6, f"l{i}", tf.tanh)
    outs.append(h)
  return x, outs, tf.reduce_sum(tf.square(h))


def _check_equal(loss, gv, fd):
  ref = tf.gradients(loss, [v for _, v in gv])
  with tf1.Session() as sess:
    sess.run(tf1.global_variables_initializer())
    got, want = sess.run(([g for g, _ in gv], ref), fd)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _copies_reading(t):
  """Recomputed (copied) forward ops that read ``t`` itself."""
  return [re.sub(r".*recompute_\d+/", "", c.name) for c in t.consumers()
          if re.search(r"recompute_\d+/", c.name) and "gradients" not in c.name]


def test_keep_by_name_and_by_tensor_equals_tf_gradients(graph):
  x, outs, loss = _chain()
  fd = feed(x)
  by_name = gg.GradientPlan(loss).recompute(keep=["l1/Tanh:0"])
  _check_equal(loss, by_name.compute_gradients(), fd)
  assert [t.name for t in by_name.kept_tensors()] == ["l1/Tanh:0"]
  by_tensor = gg.GradientPlan(loss).recompute(keep=[outs[2]])
  _check_equal(loss, by_tensor.compute_gradients(), fd)
  assert by_tensor.kept_tensors() == [outs[2]]


def test_kept_tensor_is_read_by_the_backward_pass(graph):
  _, outs, loss = _chain()
  gg.GradientPlan(loss).recompute(keep=[]).compute_gradients()
  # Nothing kept: the piece above l1 reads its own copy of l1's output.
  assert not _copies_reading(outs[1])
  gg.GradientPlan(loss).recompute(keep=["l1/Tanh:0"]).compute_gradients()
  # Kept: the recomputed l2 starts from the forward l1/Tanh:0 itself.
  assert _copies_reading(outs[1]) == ["l2/MatMul"]


def test_mixed_keep_and_op_names_in_forward_order(graph):
  x, outs, loss = _chain()
  plan = gg.GradientPlan(loss).recompute(
      keep=[outs[2], "l0", "l1/Tanh", "l2/Tanh:0"])
  _check_equal(loss, plan.compute_gradients(), feed(x))
  assert [t.name for t in plan.kept_tensors()] == [
      "l0/Tanh:0", "l1/Tanh:0", "l2/Tanh:0"]


def test_keep_none_lists_the_chosen_tensors(graph):
  _, _, loss = _chain(9)
  plan = gg.GradientPlan(loss).recompute()
  plan.compute_gradients()
  assert [t.name for t in plan.kept_tensors()] == [
      "l3/MatMul:0", "l6/BiasAdd:0"]


def test_kept_tensors_before_build_and_without_recompute(graph):
  _, _, loss = _chain(2)
  plan = gg.GradientPlan(loss)
  with pytest.raises(gg.GraphGradError, match=r"does not recompute, so it "
                     r"keeps every activation\. Declare plan\.recompute"):
    plan.kept_tensors()
  plan.recompute(keep=["l0"])
  with pytest.raises(gg.GraphGradError,
                     match=r"not built yet.*Call plan\.compute_gradients"):
    plan.kept_tensors()


def test_unknown_names(graph):
  _, _, loss = _chain(2)
  with pytest.raises(gg.LayerNotFoundError, match=r"`keep` got 'l9/Tanh:0', "
                     r"which names no layer, tensor or op .* l0, l1\. Pass"):
    gg.GradientPlan(loss).recompute(keep=["l9/Tanh:0"])
  with pytest.raises(gg.LayerNotFoundError,
                     match=r"`keep` got 'nope', which names no layer"):
    gg.GradientPlan(loss).recompute(keep=["nope"])


def test_op_name_with_several_outputs(graph):
  _, outs, _ = _chain(1)
  a, b = tf.split(outs[0], 2, axis=1, name="halves")
  loss = tf.reduce_sum(dense(a * b, 2, "top"))
  with pytest.raises(gg.GraphGradError, match=r"op name 'halves', whose op "
                     r"\(Split\) has 2 outputs.*halves:0, halves:1"):
    gg.GradientPlan(loss).recompute(keep=["halves"])


def test_tensor_of_another_graph(graph):
  _, _, loss = _chain(2)
  with tf.Graph().as_default():
    other = tf.tanh(tf.ones([2]), name="l0/Tanh")
  with pytest.raises(gg.GraphGradError, match=r"a tensor of another "
                     r"tf\.Graph than the loss's\. Pass a tensor"):
    gg.GradientPlan(loss).recompute(keep=[other])


def test_tensor_off_the_forward_path(graph):
  x, outs, loss = _chain(2)
  side = tf.tanh(outs[0] * 2.0, name="side")  # the loss never reads it
  for bad in [x, side, "side:0"]:
    with pytest.raises(gg.NotConnectedError, match=r"is not on the loss's "
                       r"forward path .* Keep an activation"):
      gg.GradientPlan(loss).recompute(keep=[bad])


def _loop_loss():
  """(a tensor of a while loop's body, a loss after the loop)."""
  _, outs, _ = _chain(1)
  inside = []

  def body(i, a):
    a = tf.tanh(a * 0.5)
    inside.append(a)
    return i + 1, a

  _, h = tf.while_loop(lambda i, a: i < 2, body, [0, outs[0]])
  return inside[0], tf.reduce_sum(dense(h, 2, "top"))


def test_tensor_inside_a_while_loop(graph):
  inside, loss = _loop_loss()
  with pytest.raises(gg.UnsupportedGraphError, match=r"a tensor inside the "
                     r"body of a loop or function .* Keep a tensor before"):
    gg.GradientPlan(loss).recompute(keep=[inside])


def test_eager_tensor():
  eager = tf.constant([1.0, 2.0])
  with tf.Graph().as_default():
    _, _, loss = _chain(2)
    with pytest.raises(gg.GraphGradError, match=r"`keep` got an eager "
                       r"tensor \(shape \(2,\)\).*Pass the tf\.Tensor"):
      gg.GradientPlan(loss).recompute(keep=[eager])


def test_tensor_inside_a_v1_while_loop():
  from tensorflow.python.ops import control_flow_util  # pylint: disable=g-import-not-at-top
  was_enabled = control_flow_util.ENABLE_CONTROL_FLOW_V2
  tf1.disable_control_flow_v2()
  try:
    with tf.Graph().as_default():
      inside, loss = _loop_loss()
      with pytest.raises(gg.UnsupportedGraphError, match=r"a tensor inside "
                         r"a loop or cond of the tf\.Graph.*Keep a tensor "
                         r"before or after the loop"):
        gg.GradientPlan(loss).recompute(keep=[inside.name])
  finally:
    if was_enabled:
      tf1.enable_control_flow_v2()
