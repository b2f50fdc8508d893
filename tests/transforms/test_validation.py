"""Every factory checks its hyperparameters when it is called."""

import math

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.transforms import _validate
from helpers import evaluate

T = gg.transforms
B = gg.backward
tf1 = tf.compat.v1
NAN, INF = float("nan"), float("inf")

# (factory call, message pattern): each names the factory and the argument.
BAD = [
    (lambda: T.scale("a"), r"scale: `c` must be a Python number or a scalar "
     r"tensor, a finite factor; got str 'a'"),
    (lambda: T.scale(None),
     r"scale: `c` must be a Python number.*got NoneType"),
    (lambda: T.scale(True), r"scale: `c` must be .*got bool True"),
    (lambda: T.scale(NAN), r"scale: `c` must be finite and a finite factor; "
     r"got nan"),
    (lambda: T.scale(INF), r"scale: `c` must be finite.*got inf"),
    (lambda: T.scale([0.5]), r"scale: `c` must be .*got list \[0.5\]"),
    (lambda: T.scale(tf.constant([0.5, 1.0])),
     r"scale: `c` must be .*got tensor of shape \(2,\) float32"),
    (lambda: T.scale(tf.constant("x")), r"scale: `c` .*got tensor .* string"),
    (lambda: T.scale(tf.constant(NAN)), r"scale: `c` must be finite"),
    (lambda: T.reverse(None), r"reverse: `lam` must be .*got NoneType"),
    (lambda: T.scale(10**400), r"scale: `c` must be finite.*got inf"),
    (lambda: T.reverse(NAN), r"reverse: `lam` must be finite"),
    (lambda: T.add_noise("0.1"), r"add_noise: `stddev` must be a Python "
     r"number or a scalar tensor, non-negative; got str '0.1'"),
    (lambda: T.add_noise(NAN), r"add_noise: `stddev` must be finite"),
    (lambda: T.add_noise(INF), r"add_noise: `stddev` must be finite"),
    (lambda: T.add_noise(-0.1), r"add_noise: `stddev` must be non-negative; "
     r"got -0.1"),
    (lambda: T.add_noise(eta=NAN), r"add_noise: `eta` must be finite"),
    (lambda: T.add_noise(eta=-1.0), r"add_noise: `eta` must be non-negative"),
    (lambda: T.add_noise(eta=0.3, gamma=None),
     r"add_noise: `gamma` must be .*got NoneType"),
    (lambda: T.add_noise(eta=0.3, gamma=INF), r"add_noise: `gamma` must be "
     r"finite"),
    (lambda: T.add_noise(0.1, seed=1.5), r"add_noise: `seed` must be None or "
     r"a Python int.*got float 1.5"),
    (lambda: T.add_noise(0.1, seed="1"), r"add_noise: `seed` must be None"),
    (lambda: T.add_noise(0.1, seed=2**64), r"add_noise: `seed` must be None"),
    (lambda: T.clip_by_value("a", 1.0), r"clip_by_value: `lo` must be .*got "
     r"str 'a'"),
    (lambda: T.clip_by_value(-1.0, NAN), r"clip_by_value: `hi` must be finite"),
    (lambda: T.clip_by_value(-INF, 1.0), r"clip_by_value: `lo` must be finite"),
    (lambda: T.clip_by_value(1.0, -1.0), r"clip_by_value: `lo` must not "
     r"exceed `hi`"),
    (lambda: T.clip_by_norm(NAN), r"clip_by_norm: `c` must be finite and a "
     r"positive norm bound; got nan"),
    (lambda: T.clip_by_norm(0.0), r"clip_by_norm: `c` must be a positive "
     r"norm bound; got 0.0"),
    (lambda: T.clip_by_norm(None), r"clip_by_norm: `c` must be .*NoneType"),
    (lambda: T.clip_by_norm(tf.constant(-1.0)), r"clip_by_norm: `c` must be "
     r"a positive norm bound; got -1.0"),
    (lambda: T.chain(T.scale(2.0), 3.0), r"chain: argument 1: `fn` must be a "
     r"callable"),
    (lambda: T.chain(T.clip_by_global_norm(1.0)), r"chain: argument 0: `fn` "
     r"is the group transform clip_by_global_norm\(1.0\)"),
    (lambda: T.as_transform(T.trust_ratio(0.001)), r"`fn` is the group "
     r"transform trust_ratio"),
    (lambda: T.as_transform(None), r"`fn` must be a callable"),
    (lambda: T.clip_by_global_norm("1"), r"clip_by_global_norm: `clip_norm` "
     r"must be .*got str '1'"),
    (lambda: T.clip_by_global_norm(NAN), r"clip_by_global_norm: `clip_norm` "
     r"must be finite"),
    (lambda: T.clip_by_global_norm(-1.0), r"clip_by_global_norm: "
     r"`clip_norm` must be positive"),
    (lambda: T.trust_ratio(None), r"trust_ratio: `eta` must be .*NoneType"),
    (lambda: T.trust_ratio(INF), r"trust_ratio: `eta` must be finite"),
    (lambda: T.trust_ratio(0.0), r"trust_ratio: `eta` must be positive"),
    (lambda: T.trust_ratio(0.001, epsilon=NAN), r"trust_ratio: `epsilon` "
     r"must be finite"),
    (lambda: T.trust_ratio(0.001, epsilon="0"), r"trust_ratio: `epsilon` "
     r"must be .*got str '0'"),
    (lambda: B.feedback_alignment(seed="0"), r"feedback_alignment: `seed` "
     r"must be None or a Python int"),
    (lambda: B.feedback_alignment(stddev=NAN), r"feedback_alignment: "
     r"`stddev` must be finite"),
    (lambda: B.feedback_alignment(stddev=0.0), r"feedback_alignment: "
     r"`stddev` must be positive; got 0.0"),
    (lambda: B.feedback_alignment(stddev=tf.constant(0.1)),
     r"feedback_alignment: `stddev` must be a Python number, positive; got "
     r"tensor"),
    (lambda: B.direct_feedback_alignment(seed=True),
     r"direct_feedback_alignment: `seed` must be None or a Python int.*bool"),
    (lambda: B.direct_feedback_alignment(stddev=-1.0),
     r"direct_feedback_alignment: `stddev` must be positive"),
    (lambda: B.direct_feedback_alignment(error_layer=3),
     r"direct_feedback_alignment: `error_layer` must be a layer name"),
    (lambda: B.synthetic(hidden=64), r"synthetic: `hidden` must hold positive "
     r"layer sizes, as a tuple or list; got int 64"),
    (lambda: B.synthetic(hidden=(64, True)), r"synthetic: `hidden` must hold "
     r"positive"),
    (lambda: B.synthetic(loss_weight=NAN), r"synthetic: `loss_weight` must be "
     r"finite"),
    (lambda: B.synthetic(loss_weight=-1.0), r"synthetic: `loss_weight` must "
     r"be non-negative"),
    (lambda: B.synthetic(loss_weight="1"), r"synthetic: `loss_weight` must be "
     r"a Python number, non-negative; got str"),
    (lambda: B.synthetic(seed=0.5), r"synthetic: `seed` must be None or a "
     r"Python int"),
]


@pytest.mark.parametrize("call,pattern", BAD,
                         ids=[str(i) for i in range(len(BAD))])
def test_bad_hyperparameter_is_refused_at_the_factory(call, pattern):
  with pytest.raises(gg.GraphGradError, match=pattern):
    call()


def test_the_message_says_what_to_pass_instead():
  with pytest.raises(gg.GraphGradError, match=r"Pass e.g. scale\(0.5\)\.$"):
    T.scale("a")
  with pytest.raises(gg.GraphGradError, match=r"NaN or infinity would turn"):
    T.add_noise(NAN)


def test_a_placeholder_hyperparameter_is_checked_for_dtype_and_rank_only(
    graph):
  c = tf1.placeholder(tf.float32, [])
  g = tf.constant([1.0, -2.0])
  out = T.scale(c)(g)
  with tf1.Session() as sess:
    np.testing.assert_allclose(sess.run(out, {c: 0.25}), [0.25, -0.5])
  with pytest.raises(gg.GraphGradError, match=r"scale: `c` .*shape \(3,\)"):
    T.scale(tf1.placeholder(tf.float32, [3]))


@pytest.mark.parametrize("value", [0.5, 2, np.float32(0.5), np.float64(0.5),
                                   np.int32(2)])
def test_numbers_of_every_kind_scale_like_the_python_float(graph, value):
  g = tf.constant([[1.0, -3.0]], tf.float64)
  got = evaluate([T.scale(value)(g), T.reverse(value)(g)])
  want = float(value) * np.array([[1.0, -3.0]])
  np.testing.assert_allclose(got[0], want)
  np.testing.assert_allclose(got[1], -want)


def test_valid_tensor_hyperparameters_are_kept(graph):
  g = tf.constant([3.0, 4.0])
  lam = tf.constant(0.5)
  got = evaluate([T.reverse(lam)(g), T.clip_by_norm(tf.constant(1.0))(g),
                  T.clip_by_value(tf.constant(-1.0), 3.5)(g)])
  np.testing.assert_allclose(got[0], [-1.5, -2.0])
  np.testing.assert_allclose(got[1], [0.6, 0.8], rtol=1e-6)
  np.testing.assert_allclose(got[2], [3.0, 3.5])


def test_edge_values_that_are_in_range_are_accepted():
  assert repr(T.add_noise(0.0)) == "add_noise(0.0, seed=None)"
  assert (repr(T.trust_ratio(0.001, epsilon=0))
          == "trust_ratio(0.001, epsilon=0)")
  assert repr(T.clip_by_value(1.0, 1.0)) == "clip_by_value(1.0, 1.0)"
  assert repr(T.add_noise(0.1, seed=np.int64(3))) == "add_noise(0.1, seed=3)"
  assert repr(B.synthetic(hidden=[8], loss_weight=0.0)).startswith(
      "synthetic(hidden=(8,)")


def test_number_helper_returns_the_value_unchanged():
  c = np.float32(0.25)
  assert _validate.number("scale", "c", c) is c
  assert _validate.seed("f", None) is None
  assert math.isclose(_validate.number("f", "x", 1e300), 1e300)
