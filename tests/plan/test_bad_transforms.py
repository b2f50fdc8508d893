"""Bad transforms and replacements raise a GraphGradError naming the layer.

The property test draws random declarations, good and bad, in random order,
on a three-layer chain: a plan with a bad one raises an error that names a
bad declaration's layer; a plan of good ones equals the tf.gradients
reference.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

import graphgrad as gg
from helpers import assert_grads_close, dense

tf1 = tf.compat.v1
LAYERS = ("l1", "l2", "l3")


def _chain():
  x = tf.constant(np.random.default_rng(5).normal(size=(4, 3)), tf.float32)
  h = dense(dense(x, 4, "l1", tf.tanh), 3, "l2", tf.tanh)
  return tf.reduce_sum(tf.square(dense(h, 2, "l3")))


def _foreign(shape, dtype):
  """A tensor of the right shape and dtype, in another tf.Graph."""
  with tf.Graph().as_default():
    return tf.zeros([d if d is not None else 1 for d in shape.as_list()],
                    dtype)


def _raise(_):
  raise RuntimeError("boom")


# name -> a bad transform g -> g, and the message it must produce.
BAD = {
    "wrong_shape": (lambda g: tf.reduce_sum(g), r"changed the gradient from "
                    r"shape"),
    "wrong_dtype": (lambda g: tf.cast(g, tf.float64), r"changed the gradient "
                    r"from shape .* float32 to shape .* float64"),
    "none": (lambda g: None, r"the transform returned None"),
    "other_graph": (lambda g: _foreign(g.shape, g.dtype), r"a tensor of "
                    r"another tf.Graph; expected a tensor of the gradient's "
                    r"tf.Graph"),
    "uses_other_graph": (lambda g: g * _foreign(tf.TensorShape([]), g.dtype),
                         r"mixed tensors of two tf.Graphs"),
    "python_number": (lambda g: 0.5, r"changed the gradient from shape .* to "
                      r"shape \(\)"),
    "raising": (_raise, r"raised RuntimeError: boom"),
}

# name -> a bad replacement, and its message.
BAD_BACKWARD = {
    "wrong_shape": (lambda ctx: [tf.zeros([1])], r"returned a gradient of "
                    r"shape \(1,\)"),
    "wrong_dtype": (lambda ctx: [tf.cast(t, tf.float64) for t in ctx.inputs],
                    r"returned a gradient of shape .* float64"),
    "none": (lambda ctx: None, r"returned None for 1 input tensors"),
    "other_graph": (lambda ctx: [_foreign(t.shape, t.dtype)
                                 for t in ctx.inputs],
                    r"the replacement returned .*, a tensor of another "
                    r"tf.Graph; expected a tensor of the gradient's tf.Graph, "
                    r"the one of l1/"),
    "uses_other_graph": (lambda ctx: [t * _foreign(tf.TensorShape([]), t.dtype)
                                      for t in ctx.inputs],
                         r"mixed tensors of two tf.Graphs"),
    "python_number": (lambda ctx: [0.5], r"returned float 0.5 for the input"),
    "raising": (_raise, r"the replacement .* raised RuntimeError: boom"),
}


def _where(kind, target):
  if kind == "edge":
    return rf"transform_edge\('{target[0]}', '{target[1]}'\)"
  name = {"upstream": "transform_upstream", "gradients": "transform_gradients",
          "backward": "replace_backward"}[kind]
  return rf"{name}\('{target}'\)"


def _declare(plan, kind, target, fn):
  if kind == "upstream":
    plan.transform_upstream(target, fn)
  elif kind == "gradients":
    plan.transform_gradients(target, fn)
  elif kind == "edge":
    plan.transform_edge(target[0], target[1], fn)
  else:
    plan.replace_backward(target, fn)


# -- one case each ------------------------------------------------------------

@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("kind,target", [
    ("upstream", "l2"), ("gradients", "l1"), ("edge", ("l1", "l2"))])
def test_bad_transform_names_its_declaration(graph, kind, target, bad):
  fn, pattern = BAD[bad]
  plan = gg.GradientPlan(_chain())
  _declare(plan, kind, target, fn)
  with pytest.raises(gg.GraphGradError, match=rf"{_where(kind, target)}.*"
                     rf"{pattern}"):
    plan.compute_gradients()


@pytest.mark.parametrize("bad", sorted(BAD_BACKWARD))
def test_bad_replacement_names_its_layer(graph, bad):
  fn, pattern = BAD_BACKWARD[bad]
  plan = gg.GradientPlan(_chain()).replace_backward("l2", fn)
  with pytest.raises(gg.GraphGradError,
                     match=rf"replace_backward\('l2'\).*{pattern}"):
    plan.compute_gradients()


def test_a_replacement_returning_one_tensor_not_a_list(graph):
  plan = gg.GradientPlan(_chain()).replace_backward(
      "l2", lambda ctx: ctx.inputs[0])
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"replace_backward\('l2'\): .* returned one tensor, "
                     r"not a list, for 1 input tensors"):
    plan.compute_gradients()


def test_the_original_exception_is_chained(graph):
  plan = gg.GradientPlan(_chain()).transform_upstream("l2", _raise)
  with pytest.raises(gg.GraphGradError) as info:
    plan.compute_gradients()
  assert isinstance(info.value.__cause__, RuntimeError)


def test_var_list_of_another_graph_says_which_graph(graph):
  loss = _chain()
  with tf.Graph().as_default():
    foreign = tf1.get_variable("w", [1])
  with pytest.raises(gg.GraphGradError,
                     match=rf"`var_list` holds w:0 from another tf.Graph than "
                     rf"the loss; expected variables of the tf.Graph of "
                     rf"{loss.name}"):
    gg.GradientPlan(loss, var_list=tf1.trainable_variables() + [foreign])


def test_keras_plan_refuses_a_graph_tensor_in_eager_code():
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="a"),
                            keras.layers.Dense(1, name="b")])
  plan = gg.KerasPlan(model).transform_upstream(
      "b", lambda g: _foreign(g.shape, g.dtype))
  with plan.tape() as tape:
    loss = tf.reduce_sum(model(tf.ones((2, 3))))
  with pytest.raises(gg.IncompatibleGradientError,
                     match=r"transform_upstream\('b'\) on an output of shape "
                     r".*another tf.Graph; expected an eager tensor"):
    tape.gradient(loss)


# -- the property -------------------------------------------------------------

TARGETS = {
    # Upstream and backward on l2, l3 only: l1's input is a constant, so
    # nothing lies below it to run them on.
    "upstream": ["l2", "l3"],
    "gradients": list(LAYERS),
    "edge": [("l1", "l2"), ("l2", "l3")],
    "backward": ["l2", "l3"],
}

declaration = st.sampled_from(sorted(TARGETS)).flatmap(
    lambda kind: st.tuples(
        st.just(kind), st.sampled_from(TARGETS[kind]),
        st.one_of(st.sampled_from([0.5, 2.0, -1.0]).map(lambda c: ("scale", c)),
                  st.sampled_from(sorted(BAD)).map(lambda b: ("bad", b)))))


def _factors(decls):
  """Per layer, the factor a chain of scales puts on its parameter grads."""
  factor = {name: 1.0 for name in LAYERS}
  for kind, target, (what, c) in decls:
    if what != "scale" or kind == "backward":
      continue
    if kind == "gradients":
      factor[target] *= c
      continue
    # An upstream scale on L or an edge scale into L scales all below L.
    top = target if kind == "upstream" else target[1]
    for name in LAYERS[:LAYERS.index(top)]:
      factor[name] *= c
  return factor


# As many examples as the hypothesis profile asks for (tests/conftest.py).
@given(st.lists(declaration, min_size=1, max_size=4), st.randoms())
def test_random_bad_and_good_declarations(decls, random):
  random.shuffle(decls)
  seen_backward = set()
  decls = [d for d in decls if d[0] != "backward" or not (
      d[1] in seen_backward or seen_backward.add(d[1]))]
  with tf.Graph().as_default():
    loss = _chain()
    plan = gg.GradientPlan(loss)
    for kind, target, (what, arg) in decls:
      if kind == "backward":
        fn = (lambda ctx: ctx.chain_rule()) if what == "scale" else (
            BAD_BACKWARD[arg][0])
      else:
        fn = gg.transforms.scale(arg) if what == "scale" else BAD[arg][0]
      _declare(plan, kind, target, fn)
    bad = [(kind, target) for kind, target, (what, _) in decls
           if what == "bad"]
    if bad:
      with pytest.raises(gg.GraphGradError) as info:
        plan.compute_gradients()
      assert any(_where_matches(info.value, k, t) for k, t in bad), (
          str(info.value), bad)
      return
    variables = tf1.trainable_variables()
    got = [g for g, _ in plan.compute_gradients()]
    factor = _factors(decls)
    want = [factor[v.op.name.split("/")[0]] * g
            for g, v in zip(tf.gradients(loss, variables), variables)]
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      assert_grads_close(*sess.run([got, want]), rtol=1e-5, atol=1e-6)


def _where_matches(error, kind, target) -> bool:
  return re.search(_where(kind, target), str(error)) is not None
