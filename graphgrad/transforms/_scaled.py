"""Transforms applied to the unscaled gradient under a loss scale.

Mixed-precision training backpropagates ``S * loss`` so that float16
gradients do not underflow. Given the pass's scale ``S`` (core's
``BackwardPass.scale``, which each executor reads from its compiled
``LossScaleRule`` once per step), :mod:`~graphgrad.transforms._checks` hands
every non-linear transform ``g / S`` in float32 and returns ``S *`` its
result, cast back to ``g``'s dtype: the transform sees the true gradient,
and whoever unscales afterwards (a loss-scale optimizer, with its finiteness
check) sees what it expects. Linear transforms commute with the scale and
run on ``g`` as it is. ``None`` is no scale.
"""

from typing import Any, Callable

import tensorflow as tf

from graphgrad._types import Gradient


def needs_unscaling(fn, scale: Any) -> bool:
  """True under a scale unless ``fn`` is linear (it commutes with it)."""
  return scale is not None and fn.linear_factor is None


def _values(g):
  return g.values if isinstance(g, tf.IndexedSlices) else g


def _like(g, values):
  if isinstance(g, tf.IndexedSlices):
    return tf.IndexedSlices(values, g.indices, g.dense_shape)
  return values


def unscale(g: Gradient, scale: Any) -> Gradient:
  """``g / S``, float16 and bfloat16 in float32 (``None`` and non-float
  gradients as they are)."""
  if g is None or scale is None or not _values(g).dtype.is_floating:
    return g
  dtype = _values(g).dtype
  if dtype in (tf.float16, tf.bfloat16):
    dtype = tf.float32
  return _like(g, tf.cast(_values(g), dtype) / tf.cast(scale, dtype))


def rescale(like: Gradient, out: Gradient, scale: Any) -> Gradient:
  """``S * out``, cast to the dtype of ``like``, the gradient before."""
  if out is None or like is None or scale is None:
    return out
  dtype = _values(like).dtype
  if not dtype.is_floating:
    return out
  values = tf.convert_to_tensor(_values(out))
  return _like(out, tf.cast(values * tf.cast(scale, values.dtype), dtype))


def around(g: Gradient, inner: Callable[[Gradient], Gradient],
           scale: Any) -> Gradient:
  """``rescale(g, inner(unscale(g)))``: ``inner`` sees the true gradient."""
  return rescale(g, inner(unscale(g, scale)), scale)
