"""gaussian: Box-Muller of Philox words in one XLA kernel, the same values
in eager mode, a tf.function and a TF1 Session, normal to float32."""

import math

import numpy as np
import tensorflow as tf

from graphgrad.core._privacy import gaussian

tf1 = tf.compat.v1


def _by_hand(n, seed, stddev):
  """The kernel's values in float64 from the Philox words that
  ``stateless_uniform`` draws, with the kernel's float32 uniforms."""
  half = (n + 1) // 2
  w = tf.random.stateless_uniform(
      [2, half], tf.constant(seed, tf.int64), minval=None, maxval=None,
      dtype=tf.uint32, alg="philox").numpy()
  u = ((w[0].astype(np.float32) + np.float32(0.5))
       * np.float32(2.0**-32)).astype(np.float64)
  x = (((w[1] >> 9).astype(np.float32) + np.float32(0.5))
       * np.float32(math.pi / 4 * 2.0**-23)).astype(np.float64)
  r = stddev * np.sqrt(-2.0 * np.log(u))
  c, s = np.cos(x), np.sin(x)
  swap = (w[1] & 1) != 0
  c, s = np.where(swap, s, c), np.where(swap, c, s)
  c = np.where((w[1] & 2) != 0, -c, c)
  s = np.where((w[1] & 4) != 0, -s, s)
  return np.concatenate([r * c, r * s])[:n]


def test_gaussian_is_box_muller_of_the_philox_words():
  for n in (1, 6, 513, 100001):
    z = gaussian([n], tf.constant([5, 9], tf.int64), stddev=1.5).numpy()
    assert z.dtype == np.float32 and z.shape == (n,)
    np.testing.assert_allclose(z, _by_hand(n, [5, 9], 1.5), rtol=1e-6)


def test_gaussian_is_the_same_in_eager_a_function_and_a_session():
  seed = [11, 5]
  eager = gaussian([64, 33], tf.constant(seed, tf.int64), stddev=0.7).numpy()
  traced = tf.function(lambda s: gaussian([64, 33], s, stddev=0.7))(
      tf.constant(seed, tf.int64)).numpy()
  graph = tf.Graph()
  with graph.as_default():
    fed = tf1.placeholder(tf.int64, [2])
    x = tf1.placeholder(tf.float32, None)
    static = gaussian([64, 33], fed, stddev=0.7)
    dynamic = gaussian(tf.shape(x), fed, stddev=0.7)  # XLA sizes it at run
    with tf1.Session() as sess:
      ran, ran_dynamic = sess.run([static, dynamic],
                                  {fed: seed, x: np.zeros([64, 33])})
  np.testing.assert_array_equal(traced, eager)
  np.testing.assert_array_equal(ran, eager)
  np.testing.assert_array_equal(ran_dynamic, eager)


def test_gaussian_is_normal_to_five_sigma():
  n = 4_000_000
  z = gaussian([n], tf.constant([1, 2], tf.int64)).numpy().astype(np.float64)
  assert abs(z.mean()) < 5 / math.sqrt(n)
  assert abs(z.std() - 1) < 5 / math.sqrt(2 * n)
  for k in (1, 2, 3, 4, 5):
    expected = n * math.erfc(k / math.sqrt(2))
    beyond = np.sum(np.abs(z) > k)
    assert abs(beyond - expected) < 5 * math.sqrt(expected) + 1, k
  # the angle of the pairs is uniform: no octant of the circle is favored
  half = n // 2
  octant = np.floor(np.arctan2(z[half:], z[:half]) / (math.pi / 4)) % 8
  counts = np.bincount(octant.astype(int), minlength=8)
  assert np.all(np.abs(counts - half / 8) < 5 * math.sqrt(half / 8))


def test_gaussian_float64_keeps_its_dtype():
  z = gaussian([10000], tf.constant([3, 4], tf.int64), tf.float64, 2.0)
  assert z.dtype == tf.float64
  assert abs(float(tf.math.reduce_std(z)) - 2.0) < 0.1
