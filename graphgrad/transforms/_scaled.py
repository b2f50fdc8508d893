"""Transforms applied to the unscaled gradient while a loss scale is active.

Mixed-precision training backpropagates ``S * loss`` so that float16
gradients do not underflow. While :func:`active` holds a scale ``S`` (in the
thread that computes the gradients), :mod:`~graphgrad.transforms._checks`
hands every non-linear transform ``g / S`` in float32 and returns ``S *``
its result, cast back to ``g``'s dtype: the transform sees the true
gradient, and whoever unscales afterwards (a loss-scale optimizer, with its
finiteness check) sees what it expects. Linear transforms commute with the
scale and run on ``g`` as it is.
"""

import contextlib
import threading
from typing import Callable

import tensorflow as tf

from graphgrad._types import Gradient

_STATE = threading.local()


@contextlib.contextmanager
def active(scale):
  """Makes ``scale`` (a scalar tensor, or ``None``) the thread's loss scale."""
  previous = getattr(_STATE, "scale", None)
  _STATE.scale = scale
  try:
    yield
  finally:
    _STATE.scale = previous


def current():
  """The loss scale active in this thread, or ``None``."""
  return getattr(_STATE, "scale", None)


def needs_unscaling(fn) -> bool:
  """True unless ``fn`` is linear (then it commutes with the scale)."""
  return current() is not None and fn.linear_factor is None


def _values(g):
  return g.values if isinstance(g, tf.IndexedSlices) else g


def _like(g, values):
  if isinstance(g, tf.IndexedSlices):
    return tf.IndexedSlices(values, g.indices, g.dense_shape)
  return values


def unscale(g: Gradient) -> Gradient:
  """``g / S``, float16 and bfloat16 in float32 (``None`` and non-float
  gradients as they are)."""
  scale = current()
  if g is None or scale is None or not _values(g).dtype.is_floating:
    return g
  dtype = _values(g).dtype
  if dtype in (tf.float16, tf.bfloat16):
    dtype = tf.float32
  return _like(g, tf.cast(_values(g), dtype) / tf.cast(scale, dtype))


def rescale(like: Gradient, out: Gradient) -> Gradient:
  """``S * out``, cast to the dtype of ``like``, the gradient before."""
  scale = current()
  if out is None or like is None or scale is None:
    return out
  dtype = _values(like).dtype
  if not dtype.is_floating:
    return out
  values = tf.convert_to_tensor(_values(out))
  return _like(out, tf.cast(values * tf.cast(scale, values.dtype), dtype))


def around(g: Gradient, inner: Callable[[Gradient], Gradient]) -> Gradient:
  """``rescale(g, inner(unscale(g)))``: ``inner`` sees the true gradient."""
  return rescale(g, inner(unscale(g)))
