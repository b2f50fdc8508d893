"""Per-example norms that cannot overflow: ``_clipping.example_norms``.

References: each example's gradient built in float64 numpy from the forms'
definitions (a dense use ``sum_t a_t g_t^T``, an embedding's rows summed at
their ids, a convolution's filter gradient of one example), its norm over
all the variables together.
"""

import numpy as np
import pytest
import tensorflow as tf

from graphgrad.core import _clipping, _forms


def normal(*shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape)


def conv_grad(x, g, shape):
  """The filter gradient of one example, from its definition (SAME, 1)."""
  kh, kw = shape[:2]
  pad = np.pad(x, [(kh // 2, kh - 1 - kh // 2), (kw // 2, kw - 1 - kw // 2),
                   (0, 0)])
  out = np.zeros(shape)
  for i in range(kh):
    for j in range(kw):
      window = pad[i:i + x.shape[0], j:j + x.shape[1]]
      out[i, j] = np.einsum("hwc,hwo->co", window, g)
  return out


@pytest.mark.parametrize("scale", [1e15, 1.0, 1e-17])
def test_norms_of_every_form_at_any_scale_equal_float64(scale):
  # Four variables of two examples, the first at `scale`: gradients near
  # scale^2 (1e30: squares overflow float32; 1e-34: squares underflow).
  b, s = 2, np.array([scale, 1.0])
  a, g = normal(b, 3, 4, seed=1), normal(b, 3, 5, seed=2)  # ghost: T = 3
  ids, rows = np.array([[1, 1, 0], [2, 0, 2]]), normal(b, 3, 4, seed=3)
  per = normal(b, 6, seed=4)
  x, gc = normal(b, 5, 5, 2, seed=5), normal(b, 5, 5, 3, seed=6)
  a, x = a * s[:, None, None], x * s[:, None, None, None]
  g, gc = g * s[:, None, None], gc * s[:, None, None, None]
  rows, per = rows * s[:, None, None] ** 2, per * s[:, None] ** 2
  forms = [
      [_forms.DenseForm(tf.constant(a, tf.float32),
                        tf.constant(g, tf.float32))],
      [_forms.EmbeddingForm(tf.constant(ids), tf.constant(rows, tf.float32))],
      [_forms.PerExampleForm(tf.constant(per, tf.float32))],
      [_forms.Conv2DForm(tf.constant(x, tf.float32),
                         tf.constant(gc, tf.float32), [3, 3, 2, 3],
                         [1, 1, 1, 1], "SAME")]]
  shapes = [[4, 5], [3, 4], [6], [3, 3, 2, 3]]
  # Norms below C need no precision (their factor is 1) unless C itself is
  # tiny: the underflow case clips at 1e-30.
  clip = 1.0 if scale >= 1.0 else 1e-30
  got = _clipping.example_norms(forms, shapes, [tf.float32] * 4, b, clip)
  expected = []
  for i in range(b):
    table = np.zeros([3, 4])
    np.add.at(table, ids[i], rows[i])
    parts = [np.einsum("tp,tq->pq", a[i], g[i]), table, per[i],
             conv_grad(x[i], gc[i], [3, 3, 2, 3])]
    expected.append(np.sqrt(sum(np.sum(p * p) for p in parts)))
  np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)


def test_a_non_finite_example_makes_every_clip_factor_nan():
  for bad in (np.nan, np.inf):
    a = np.ones([2, 1, 3], np.float32)
    a[1, 0, 0] = bad
    forms = [[_forms.DenseForm(tf.constant(a), tf.ones([2, 1, 2]))]]
    norms = _clipping.example_norms(forms, [[3, 2]], [tf.float32], 2, 1.0)
    assert not np.isfinite(norms.numpy()[1])
    c = _clipping.clip_factors(norms, 1.0, tf.float32)
    assert np.isnan(c.numpy()).all()


def test_a_clip_whose_square_underflows_still_clips():
  # C = 1e-25: C^2 underflows float32; an example of norm 4e-25 gets c = 1/4
  forms = [[_forms.PerExampleForm(tf.constant([[4e-25], [1e-26]],
                                        tf.float32))]]
  norms = _clipping.example_norms(forms, [[1]], [tf.float32], 2, 1e-25)
  c = _clipping.clip_factors(norms, 1e-25, tf.float32)
  np.testing.assert_allclose(c.numpy(), [0.25, 1.0], rtol=1e-6)
