"""gg.transforms against values computed by hand in numpy."""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad import transforms as T

tf1 = tf.compat.v1

G = np.array([[0.5, -2.0, 3.0], [-0.1, 0.0, 4.0]], np.float32)


def _run(t):
  with tf1.Session() as sess:
    return sess.run(t)


@pytest.mark.parametrize("transform, expected", [
    (T.scale(0.5), 0.5 * G),
    (T.scale(1), G),
    (T.scale(0), np.zeros_like(G)),
    (T.clip_by_value(-1.0, 2.0), np.clip(G, -1.0, 2.0)),
    (T.clip_by_norm(1.0), G / np.linalg.norm(G)),
    (T.clip_by_norm(100.0), G),
    (T.reverse(), -G),
    (T.reverse(0.3), -0.3 * G),
    (T.zero(), np.zeros_like(G)),
    (T.identity(), G),
    (T.chain(T.scale(4.0), T.clip_by_value(-3.0, 3.0)),
     np.clip(4.0 * G, -3.0, 3.0)),
    (T.chain(T.clip_by_value(-3.0, 3.0), T.scale(4.0)),
     4.0 * np.clip(G, -3.0, 3.0)),
    (T.as_transform(lambda g: g * g), G * G),
])
def test_dense_values(graph, transform, expected):
  out = transform(tf.constant(G))
  np.testing.assert_allclose(_run(out), expected, rtol=1e-6)


def test_add_noise_statistics_and_seed(graph):
  tf1.set_random_seed(1)
  g = tf.zeros([200, 200])
  ctx = T.TransformContext(tensor=g)
  a, b = T.add_noise(0.3, seed=5)(g, ctx), T.add_noise(0.3, seed=5)(g, ctx)
  va, vb = _run([a, b])
  np.testing.assert_array_equal(va, vb)  # same seed, same tensor: same noise
  assert abs(va.std() - 0.3) < 0.01  # 40,000 draws: std error ~0.001
  assert abs(va.mean()) < 0.01
  other = T.add_noise(0.3, seed=5)(g, T.TransformContext(tensor=tf.ones([1])))
  assert not np.allclose(_run(other), va)  # another tensor: another stream


def test_none_passes_through(graph):
  for t in (T.scale(2.0), T.add_noise(1.0), T.clip_by_norm(1.0), T.zero(),
            T.chain(T.scale(2.0), T.reverse())):
    assert t(None) is None


def test_indexed_slices_stay_sparse(graph):
  values = tf.constant([[1.0, 2.0], [3.0, 4.0]])
  grad = tf.IndexedSlices(values, tf.constant([0, 3]), tf.constant([5, 2]))
  out = T.chain(T.scale(2.0), T.clip_by_value(0.0, 5.0))(grad)
  assert isinstance(out, tf.IndexedSlices)
  v, i, s = _run([out.values, out.indices, out.dense_shape])
  np.testing.assert_allclose(v, [[2.0, 4.0], [5.0, 5.0]])
  np.testing.assert_array_equal(i, [0, 3])
  np.testing.assert_array_equal(s, [5, 2])


@pytest.mark.parametrize("dtype", [tf.float16, tf.float64])
def test_shape_and_dtype_are_kept(graph, dtype):
  g = tf.constant(G, dtype=dtype)
  for t in (T.scale(0.5), T.add_noise(0.1), T.clip_by_value(-1, 1),
            T.clip_by_norm(1.0), T.reverse(2.0), T.zero()):
    out = t(g)
    assert out.dtype == dtype and out.shape == g.shape


def test_transforms_open_a_name_scope(graph):
  out = T.scale(0.5)(tf.constant(G))
  assert out.op.name.startswith("scale/")
  out = T.clip_by_norm(1.0)(tf.constant(G))
  assert out.op.name.startswith("clip_by_norm/")


def test_scale_accepts_a_tensor(graph):
  c = tf1.placeholder(tf.float32, [])
  out = T.scale(c)(tf.constant(G))
  with tf1.Session() as sess:
    np.testing.assert_allclose(sess.run(out, {c: 3.0}), 3.0 * G)


def test_bad_arguments_raise():
  with pytest.raises(gg.GraphGradError, match=r"`lo` must not exceed `hi`"):
    T.clip_by_value(2.0, 1.0)
  with pytest.raises(gg.GraphGradError, match=r"`c` must be a positive norm"):
    T.clip_by_norm(0.0)
  with pytest.raises(gg.GraphGradError, match=r"`fn` must be a callable"):
    T.as_transform(3.0)
  with pytest.raises(gg.GraphGradError, match=r"`fn` must be a callable"):
    T.chain(T.scale(1.0), "scale")


def test_reprs_read_like_the_factories():
  assert repr(T.chain(T.scale(2.0), T.clip_by_norm(1.0))) == (
      "chain(scale(2.0), clip_by_norm(1.0))")
  assert repr(T.reverse()) == "scale(-1.0)"
