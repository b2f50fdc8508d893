"""The convolution rules of DP-SGD: patches and the conv form's clipped sum.

References: ``tf.image.extract_patches`` for the patches, and numpy for the
per-example gradients of a convolution, built from its definition (a loop
over output pixels and kernel offsets), clipped and summed.
"""

import numpy as np
import pytest
import tensorflow as tf

from graphgrad.core import _clipping, _forms


@pytest.mark.parametrize("shape, k, stride, padding", [
    ((2, 7, 6, 1), (3, 3), 1, "SAME"),     # a one-hot convolution (9 values)
    ((2, 7, 6, 3), (3, 2), 2, "SAME"),     # a gather, odd sizes
    ((2, 9, 9, 4), (3, 3), 3, "VALID"),
    ((3, 8, 8, 2), (2, 2), 2, "VALID"),    # a one-hot convolution, strided
    ((1, 5, 5, 5), (5, 5), 1, "SAME"),     # a kernel as large as the image
])
def test_patches_equal_extract_patches(shape, k, stride, padding):
  x = tf.constant(np.random.default_rng(0).normal(size=shape), tf.float32)
  strides = [1, stride, stride, 1]
  got = _forms.patches(x, k[0], k[1], strides, padding)
  ref = tf.image.extract_patches(x, [1, k[0], k[1], 1], strides,
                                 [1, 1, 1, 1], padding)
  np.testing.assert_array_equal(got.numpy(), ref.numpy())


def _per_example_conv_grads(x, g, kh, kw, stride, padding):
  """Per-example filter gradients ``[B, kh, kw, cin, cout]``, by loops."""
  b, h, w, cin = x.shape
  _, ho, wo, cout = g.shape
  if padding == "SAME":
    ph = max((ho - 1) * stride + kh - h, 0)
    pw = max((wo - 1) * stride + kw - w, 0)
    x = np.pad(x, [(0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2),
                   (0, 0)])
  out = np.zeros([b, kh, kw, cin, cout])
  for i in range(kh):
    for j in range(kw):
      window = x[:, i:i + stride * (ho - 1) + 1:stride,
                 j:j + stride * (wo - 1) + 1:stride, :]
      out[:, i, j] = np.einsum("bhwc,bhwo->bco", window, g)
  return out


@pytest.mark.parametrize("cin, cout, k, stride, padding, size, method", [
    (1, 4, 3, 1, "SAME", (9, 8), "patches"),     # 9 values: one-hot unfold
    (1, 3, 5, 2, "SAME", (9, 8), "depthwise"),   # one channel, 25 offsets
    (1, 2, 5, 1, "VALID", (7, 9), "depthwise"),
    (3, 2, 3, 2, "SAME", (9, 8), "patches"),     # 2 to 15 channels
    (2, 3, 3, 2, "VALID", (9, 8), "patches"),
    (16, 3, 3, 2, "SAME", (6, 5), "offsets"),    # 16 channels and more
    (16, 16, 3, 2, "SAME", (4, 4), "patches"),   # 4 positions: ghost norm
])
def test_conv_form_norms_and_clipped_sum(cin, cout, k, stride, padding, size,
                                         method):
  rng = np.random.default_rng(1)
  b, kh, kw = 4, k, k
  h, w = size
  x = rng.normal(size=(b, h, w, cin)).astype(np.float32)
  ho = -(-h // stride) if padding == "SAME" else (h - kh) // stride + 1
  wo = -(-w // stride) if padding == "SAME" else (w - kw) // stride + 1
  g = rng.normal(size=(b, ho, wo, cout)).astype(np.float32)
  per = _per_example_conv_grads(x.astype(np.float64), g.astype(np.float64),
                                kh, kw, stride, padding)
  shape = [kh, kw, cin, cout]
  form = _forms.Conv2DForm(tf.constant(x), tf.constant(g), shape,
                          [1, stride, stride, 1], padding)
  assert _forms.Conv2DForm.method([form, form]) == method
  norms = _clipping.combined_sq_norms([form, form], shape, b, tf.float32)
  # Two uses of one kernel: each example's gradient is twice its own.
  np.testing.assert_allclose(norms.numpy(),
                             4 * (per ** 2).sum(axis=(1, 2, 3, 4)), rtol=1e-5)
  c = np.array([1.0, 0.5, 0.25, 0.0], np.float32)
  got = _clipping.clipped_sum([form], tf.constant(c), shape, b, tf.float32)
  np.testing.assert_allclose(got.numpy(), np.tensordot(c, per, axes=1),
                             rtol=1e-5, atol=1e-6)
