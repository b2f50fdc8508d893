"""Multi-task methods of ``gg.mtl`` that act on ``J`` itself: ConFIG, GradDrop.

Both match TorchJD 0.18's aggregators on the same ``k x n`` matrix ``J``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from graphgrad import _errors
from graphgrad.methods._mtl_base import (
  TaskMethod,
  check_pref,
  pref_weights,
  static_k,
)

_F64 = tf.float64


class _ConFIG(TaskMethod):
  homogeneous = True  # combine(S J) = S combine(J): tests/methods
  name = "config"

  def __init__(self, pref):
    self.pref = pref

  def _combine(self, mat, state=None):
    k = static_k(mat)
    gram = tf.cast(tf.matmul(mat, mat, transpose_b=True), _F64)
    norms = tf.sqrt(tf.maximum(tf.linalg.diag_part(gram), 0.))
    safe = tf.where(norms > 0, norms, tf.ones_like(norms))
    inv = tf.where(norms > 0, 1. / safe, tf.zeros_like(norms))
    unit_gram = gram * inv[:, None] * inv[None]
    # pinv(U) u = U^T pinv(U U^T) u: the n-dimensional pseudo-inverse via
    # the k x k Gram of the unit rows U.
    # U U^T carries the gradients' rounding (eps), not its square: cut its
    # eigenvalues below 10 k eps of the largest, as tf.linalg.pinv would in
    # the gradients' precision (TorchJD's pinv(U) cuts at max(k, n) eps).
    rcond = 10. * k * float(np.finfo(mat.dtype.as_numpy_dtype).eps)
    coef = tf.linalg.matvec(tf.linalg.pinv(unit_gram, rcond=rcond),
                            pref_weights(self.name, self.pref, k, 1.)) * inv
    sq = tf.reduce_sum(coef * tf.linalg.matvec(gram, coef))
    coef = coef / tf.maximum(tf.sqrt(tf.maximum(sq, 0.)), 1e-12)
    length = tf.reduce_sum(tf.linalg.matvec(gram, coef))
    return tf.linalg.matvec(mat, tf.cast(length * coef, mat.dtype),
                            transpose_a=True)

  def _args(self):
    return f"pref_vector={self.pref}"


def config(pref_vector: Sequence[float] | None = None) -> TaskMethod:
  """ConFIG (Liu et al., 2024, "ConFIG: Towards Conflict-free Training of
  Physics Informed Neural Networks").

  With ``U`` the unit task gradients, the direction ``d = pinv(U) w``
  (``w = 1`` each) has an equal positive dot product with every unit
  gradient; the result is ``(sum_i g_i . d_hat) d_hat``, ``d_hat = d /
  ||d||``. As TorchJD's ``ConFIG`` (Eq. 2 of the paper).

  Args:
    pref_vector: one weight per task, or ``None`` for 1 each.

  Example:
    >>> import graphgrad as gg
    >>> g = [tf.constant([1., 0.]), tf.constant([0., 2.])]
    >>> gg.mtl.config().combine(g).numpy().round(4)
    array([1.5, 1.5], dtype=float32)
  """
  return _ConFIG(check_pref("config", pref_vector))


class _GradDrop(TaskMethod):
  homogeneous = True  # combine(S J) = S combine(J): tests/methods
  name = "graddrop"

  def __init__(self, f, leak, seed):
    self.f, self.leak, self.seed = f, leak, seed

  def _combine(self, mat, state=None):
    k = static_k(mat)
    noise = tf.random.uniform(tf.shape(mat)[1:], dtype=mat.dtype,
                              seed=self.seed)
    return graddrop_with_noise(mat, noise, self.f, self.leak, self.name, k)

  def _args(self):
    return f"leak={self.leak}, seed={self.seed}"


def graddrop_with_noise(mat, noise, f, leak, method, k):
  """GradDrop's combination of ``J`` given the uniform draws ``noise``."""
  purity = 0.5 * (1. + tf.reduce_sum(mat, 0) / tf.reduce_sum(tf.abs(mat), 0))
  fp = purity if f is None else f(purity)
  leak = pref_weights(method, leak, k, 0.)
  leak = tf.cast(leak, mat.dtype)[:, None]
  keep = tf.logical_or(tf.logical_and(fp > noise, mat > 0),
                       tf.logical_and(fp < noise, mat < 0))
  return tf.reduce_sum((leak + (1 - leak) * tf.cast(keep, mat.dtype)) * mat, 0)


def graddrop(f: Callable | None = None,
             leak: Sequence[float] | None = None,
             seed: int | None = None) -> TaskMethod:
  """GradDrop (Chen et al., 2020, "Just Pick a Sign: Optimizing Deep
  Multitask Models with Gradient Sign Dropout").

  Per element, the positive sign purity ``P = (1 + sum_i g_i / sum_i
  |g_i|) / 2`` and a uniform draw ``U``: task ``i`` keeps its element when
  ``f(P) > U`` and ``g_i > 0``, or ``f(P) < U`` and ``g_i < 0``; the result
  sums the kept elements, plus ``leak_i`` of the dropped ones. As TorchJD's
  ``GradDrop`` (lines 10-15 of Algorithm 1), over the flattened tensor:
  the paper's sum over the batch before ``P`` is not taken.

  Args:
    f: a monotonically increasing function of ``P``; identity by default.
    leak: one leak in [0, 1] per task, or ``None`` for no leak.
    seed: op-level seed of the draws.

  Example:
    >>> import graphgrad as gg
    >>> g = [tf.constant([1., 2.]), tf.constant([1., -1.])]
    >>> gg.mtl.graddrop(leak=[1., 1.]).combine(g).numpy()  # all leak: sum
    array([2., 1.], dtype=float32)
  """
  if f is not None and not callable(f):
    raise _errors.GraphGradError(
        f"graddrop: `f` must be None or a callable of the sign purity; got "
        f"{f!r}.")
  leak = check_pref("graddrop", leak)
  return _GradDrop(f, leak, seed)
