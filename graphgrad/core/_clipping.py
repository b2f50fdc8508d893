"""Per-example norms, clip factors and clipped sums: DP-SGD's clip.

The uses of each variable come as forms (:mod:`graphgrad.core._forms`).
From them come the per-example squared norms of each variable
(:func:`combined_sq_norms`), each example's norm over all variables, safe
from overflow (:func:`example_norms`), the clip factors
(:func:`clip_factors`) and each variable's clipped sum from the same
tensors (:func:`clipped_sum`), with no per-example gradient materialized
where a form avoids it. :mod:`graphgrad.core._privacy` runs the algorithm.
"""

from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf

from graphgrad.core._forms import Form, per_example_sq_norms

__all__ = ["clip_factors", "clipped_sum", "combined_sq_norms",
           "example_norms", "unscaled_forms"]


def combined_sq_norms(forms: Sequence[Form], var_shape, batch, dtype
                      ) -> tf.Tensor:
  """``[B]`` squared norms of one variable's per-example gradients.

  ``forms`` are the variable's uses. A variable used several times (a
  shared layer, an unrolled loop) has the sum of its uses' gradients per
  example: uses of one class are taken together by that class
  (:meth:`Form.sq_norms`: a ghost norm then holds the cross terms); uses of
  several classes are each made into per-example gradients
  ``[B, *var_shape]`` and summed.
  """
  kinds = {type(f) for f in forms}
  if len(kinds) == 1:
    return kinds.pop().sq_norms(forms, var_shape, batch, dtype)
  return per_example_sq_norms(tf.add_n(
      [f.per_example(var_shape, batch, dtype) for f in forms]))


def clipped_sum(forms: Sequence[Form], c: tf.Tensor, var_shape, batch, dtype,
                name: Optional[str] = None) -> tf.Tensor:
  """``sum_i c_i grad_i`` of one variable from the forms of its uses.

  Book-keeping (Bu et al. 2023): the clipped sum is linear in each use's
  per-example gradient, so it comes from the boundary tensors the norms were
  taken from, without a second backward pass (:meth:`Form.clipped_sum`).

  Example:
    >>> import tensorflow as tf
    >>> from graphgrad.core._forms import DenseForm
    >>> a = tf.ones([2, 1, 3]); g = tf.ones([2, 1, 1])
    >>> clipped_sum([DenseForm(a, g)], tf.constant([1.0, 0.5]), [3, 1], 2,
    ...             tf.float32).numpy().ravel().tolist()
    [1.5, 1.5, 1.5]
  """
  del batch  # the forms hold it
  with tf.name_scope(name or "clipped_sum"):
    return tf.cast(tf.add_n([f.clipped_sum(c, var_shape) for f in forms]),
                   dtype)


def _scaled(forms: Sequence[Form], batch, dtype):
  """``forms`` divided, example by example, so that their largest entries
  are at most about 1, and ``k`` (``[B]``) with ``grad_i(forms) = k_i
  grad_i(scaled forms)``.

  The input factors (of dense and conv uses) are divided by their largest
  entry ``u_i``, the gradients by ``w_i``, the largest of the gradient
  factors' entries once the forms without an input factor are divided by
  ``u_i`` too (:meth:`Form.divided`): ``k_i = u_i w_i``. A zero example
  keeps a factor 1; a NaN or an infinity stays in the forms.
  """
  ones = tf.ones(tf.reshape(batch, [1]), dtype)
  inputs = [p for p in (f.input_peak(dtype) for f in forms) if p is not None]
  u = tf.reduce_max(tf.stack(inputs), axis=0) if inputs else ones
  rest = [f.gradient_peak(u, dtype) for f in forms]
  w = tf.reduce_max(tf.stack(rest), axis=0) if rest else ones
  return [f.divided(u, w, dtype) for f in forms], u * w


def example_norms(forms: Sequence[Sequence[Form]], shapes, dtypes, batch,
                  l2_norm_clip: float, name: Optional[str] = None
                  ) -> tf.Tensor:
  """``[B]`` norms of each example's whole gradient, over the variables
  whose uses are ``forms`` (one list per variable, of shape ``shapes``).

  The squared norms of the variables are summed as they come. Where that
  sum is not finite (a finite gradient with entries past about ``1e19`` in
  float32 overflows when squared, and would get a clip factor 0 instead of
  norm ``C``), it is taken again with each example's forms scaled to
  entries of about 1 (:func:`_scaled`), each variable's norm multiplied
  back and the variables combined by a scaled hypot: a finite gradient
  gets its norm whatever its scale. So does one whose squares underflow
  (a norm below a tiny ``C``). A NaN or an infinity in an example's
  gradient keeps its norm non-finite.

  Example:
    >>> import tensorflow as tf
    >>> from graphgrad.core._forms import DenseForm
    >>> a, g = tf.fill([1, 1, 4], 1e30), tf.fill([1, 1, 1], 1e-20)
    >>> n = example_norms([[DenseForm(a, g)]], [[4, 1]], [tf.float32], 1, 1.)
    >>> round(float(n[0]) / 2e10, 4)  # ||(1e10, 1e10, 1e10, 1e10)||
    1.0
  """
  with tf.name_scope(name or "example_norms"):
    def scaled():
      norms = []
      for f, shape, dtype in zip(forms, shapes, dtypes):
        small, k = _scaled(f, batch, dtype)
        norms.append(tf.cast(k * tf.sqrt(combined_sq_norms(
            small, shape, batch, dtype)), dtypes[0]))
      top = tf.reduce_max(tf.stack(norms), axis=0)
      safe = tf.where(top > 0, top, tf.ones_like(top))
      return top * tf.sqrt(tf.add_n([tf.square(n / safe) for n in norms]))

    tiny = np.finfo(dtypes[0].as_numpy_dtype).tiny
    if l2_norm_clip < np.sqrt(tiny) * 2.0 ** 12:  # C^2 near underflow
      return scaled()
    total = tf.add_n([tf.cast(combined_sq_norms(f, shape, batch, dtype),
                              dtypes[0])
                      for f, shape, dtype in zip(forms, shapes, dtypes)])
    return tf.cond(tf.reduce_all(tf.math.is_finite(total)),
                   lambda: tf.sqrt(total), scaled)


def clip_factors(norms: tf.Tensor, l2_norm_clip: float, dtype,
                 name: Optional[str] = None) -> tf.Tensor:
  """``c_i = min(1, C / ||g_i||)`` from each example's norm
  (:func:`example_norms`); all NaN when a norm is not finite.

  A NaN or an infinity in one example's gradient makes every clip factor,
  and so every gradient of the step, NaN: visible, never dropped (a factor
  0 would hide it, and ``0 * inf`` in a sum is NaN anyway). The result is a
  constant of the backward pass (``stop_gradient``): the gradient of
  ``sum_i c_i l_i`` is ``sum_i clip_C(grad l_i)``.

  Example:
    >>> import tensorflow as tf
    >>> c = clip_factors(tf.constant([1.0, 5.0]), 1.0, tf.float32)
    >>> [round(float(x), 3) for x in c]
    [1.0, 0.2]
    >>> clip_factors(tf.constant([1.0, float("inf")]), 1.0, tf.float32)
    ... # doctest: +ELLIPSIS
    <tf.Tensor: ... numpy=array([nan, nan], dtype=float32)>
  """
  with tf.name_scope(name or "clip_factors"):
    clip = tf.constant(l2_norm_clip, norms.dtype)
    c = clip / tf.maximum(norms, clip)
    finite = tf.reduce_all(tf.math.is_finite(norms))
    c = tf.where(finite, c, tf.constant(float("nan"), c.dtype))
    return tf.stop_gradient(tf.cast(c, dtype))


def unscaled_forms(forms: Sequence[Form], scale) -> List[Form]:
  """``forms`` with each gradient divided by the loss scale ``S``.

  The division is in float32 (float64 for float64 gradients), never in
  float16: the norms and clipped sums then see the true per-example
  gradients (:meth:`Form.unscaled`).

  Example:
    >>> import tensorflow as tf
    >>> from graphgrad.core._forms import PerExampleForm
    >>> f = unscaled_forms([PerExampleForm(tf.constant([[512.0]],
    ...                                                tf.float16))],
    ...                    tf.constant(256.0))
    >>> f[0].p.dtype.name, float(f[0].p[0, 0])
    ('float32', 2.0)
  """
  return [f.unscaled(scale) for f in forms]
