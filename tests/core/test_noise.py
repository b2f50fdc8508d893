"""gaussian: Box-Muller of Philox words in XLA kernels, the same values in
eager mode, a tf.function and a TF1 Session, normal to float32; the words
are TensorFlow's Philox stream, bit for bit."""

import math

import numpy as np
import tensorflow as tf

from graphgrad.core._privacy import (
  _box_muller,
  gaussian,
  philox_words,
)

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


def _tf_words(shape, seed):
  return tf.random.stateless_uniform(
      shape, tf.constant(seed, tf.int64), minval=None, maxval=None,
      dtype=tf.uint32, alg="philox")


# Negative and extreme int64 seeds, and a 62-bit key + j with a step, as
# Noise draws them.
_SEEDS = [[0, 0], [5, 9], [-1, -7], [-(2**63), 2**63 - 1],
          [2**62 - 1 + 3, 17], [123456789, -(2**40)]]


def test_philox_words_are_tensorflows_bit_for_bit():
  for seed in _SEEDS:
    for n in (1, 2, 3, 4, 5, 7, 8, 9, 513, 4099):
      np.testing.assert_array_equal(
          philox_words(n, tf.constant(seed, tf.int64)).numpy(),
          _tf_words([n], seed).numpy(), err_msg=f"{seed} {n}")
  seed = _SEEDS[4]  # a shape's words are the stream's in row-major order
  for shape in ([2, 513], [3, 5, 7], [1, 1], [6, 1, 2]):
    n = int(np.prod(shape))
    np.testing.assert_array_equal(
        tf.reshape(philox_words(n, tf.constant(seed, tf.int64)),
                   shape).numpy(), _tf_words(shape, seed).numpy())


def test_philox_words_are_the_same_in_a_function_and_a_session():
  seed, n = [-3, 2**40], 1001
  expected = _tf_words([n], seed).numpy()
  traced = tf.function(lambda s: philox_words(n, s))(
      tf.constant(seed, tf.int64)).numpy()
  graph = tf.Graph()
  with graph.as_default():
    fed = tf1.placeholder(tf.int64, [2])
    size = tf1.placeholder(tf.int64, [])
    words = philox_words(size, fed)
    with tf1.Session() as sess:
      ran = sess.run(words, {fed: seed, size: n})
  np.testing.assert_array_equal(traced, expected)
  np.testing.assert_array_equal(ran, expected)


def test_gaussian_is_box_muller_of_tensorflows_words():
  # the same kernel fed TensorFlow's own words gives the same bits
  for n, seed in ((1, [5, 9]), (6, [-1, 2]), (1001, _SEEDS[4])):
    half = (n + 1) // 2
    z = _box_muller(_tf_words([2 * half], seed), tf.constant(half, tf.int64),
                    tf.constant(1.5))
    np.testing.assert_array_equal(
        gaussian([n], tf.constant(seed, tf.int64), stddev=1.5).numpy(),
        z.numpy()[:n])


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


def _kernels(fn, seed):
  """The draw's kernels (calls) and random ops in ``fn``'s graph."""
  ops = fn.get_concrete_function(seed).graph.get_operations()
  calls = [op.get_attr("f").name for op in ops
           if op.type == "PartitionedCall"]
  return sorted({k for k in ("_philox_blocks", "_box_muller")
                 for c in calls if k in c}
                | {op.type for op in ops if "StatelessRandom" in op.type})


def test_gaussian_inside_an_xla_step_takes_xlas_philox():
  # XLA would inline _philox_blocks and fuse its rounds into the transform,
  # once per value; the step takes XLA's own Philox there, the same words.
  seed = tf.constant([11, 5], tf.int64)
  eager = gaussian([64, 33], seed, stddev=0.7).numpy()
  plain = tf.function(lambda s: gaussian([64, 33], s, stddev=0.7))
  step = tf.function(lambda s: gaussian([64, 33], s, stddev=0.7),
                     jit_compile=True)
  np.testing.assert_array_equal(plain(seed).numpy(), eager)
  np.testing.assert_array_equal(step(seed).numpy(), eager)
  assert _kernels(plain, seed) == ["_box_muller", "_philox_blocks"]
  assert _kernels(step, seed) == ["StatelessRandomUniformFullIntV2",
                                  "_box_muller"]


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
