"""Hyperparameter checks shared by the factories of transforms and methods.

A factory checks its arguments when it is called, so that ``scale('a')`` or
``add_noise(float('nan'))`` fails at the line that wrote it, not at
``sess.run`` with every gradient turned NaN. Each check names the factory and
the argument, says what was expected and what came.

A tensor argument is checked for its dtype and rank; its value is checked
too when TensorFlow knows it before running (a constant).
"""

import math
import numbers
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from graphgrad import _errors

_INT64 = 2**63


def _describe(value: Any) -> str:
  if tf.is_tensor(value):
    return f"tensor of shape {value.shape} {value.dtype.name}"
  return f"{type(value).__name__} {value!r}"


def _check_range(factory: str, arg: str, value: float, what: str,
                 low: Optional[float], low_open: bool, fix: str) -> None:
  if math.isnan(value) or math.isinf(value):
    raise _errors.GraphGradError(
        f"{factory}: `{arg}` must be finite and {what}; got {value}. NaN or "
        f"infinity would turn every gradient it touches into NaN or "
        f"infinity. {fix}".rstrip())
  if low is not None and (value < low or (low_open and value == low)):
    raise _errors.GraphGradError(
        f"{factory}: `{arg}` must be {what}; got {value}. {fix}".rstrip())


def number(factory: str, arg: str, value: Any, *, what: str = "a number",
           low: Optional[float] = None, low_open: bool = False,
           tensor: bool = True, fix: str = "") -> Any:
  """Checks a numeric hyperparameter and returns it unchanged.

  Args:
    factory: the factory's name, for the message.
    arg: the argument's name, for the message.
    value: a Python number (``bool`` is refused), a numpy scalar, or, when
      ``tensor`` is true, a scalar numeric ``tf.Tensor`` or ``tf.Variable``.
    what: the expected value in words, e.g. ``"positive"``.
    low: the smallest value allowed (for numbers and constant tensors).
    low_open: ``low`` itself is refused.
    tensor: a scalar tensor is allowed.
    fix: a sentence saying what to pass instead.

  Returns:
    ``value``.

  Raises:
    GraphGradError: if ``value`` has another type, is not finite, or is out
      of range.

  Example:
    >>> number("scale", "c", 0.5)
    0.5
    >>> number("clip_by_norm", "c", -1.0, what="positive", low=0.0,
    ...        low_open=True)
    Traceback (most recent call last):
    ...
    graphgrad._errors.GraphGradError: clip_by_norm: `c` must be positive; got
    -1.0.
  """
  if isinstance(value, (numbers.Real, np.number)) and not isinstance(
      value, (bool, np.bool_)) and not isinstance(value, np.complexfloating):
    try:
      as_float = float(value)
    except OverflowError:  # an int beyond float range
      as_float = math.inf
    _check_range(factory, arg, as_float, what, low, low_open, fix)
    return value
  if tensor and tf.is_tensor(value) and not isinstance(value, tf.IndexedSlices):
    dtype = tf.as_dtype(value.dtype).base_dtype
    numeric = dtype.is_floating or dtype.is_integer
    if numeric and value.shape.rank in (0, None):
      if isinstance(value, tf.Tensor):
        known = tf.get_static_value(value)
        if known is not None:
          _check_range(factory, arg, float(known), what, low, low_open, fix)
      return value
  kinds = "a Python number or a scalar tensor" if tensor else "a Python number"
  raise _errors.GraphGradError(
      f"{factory}: `{arg}` must be {kinds}, {what}; got {_describe(value)}. "
      f"{fix}".rstrip())


def seed(factory: str, value: Any, arg: str = "seed") -> Optional[int]:
  """Checks an op-level seed: ``None`` or a Python int that fits in int64.

  Example:
    >>> seed("add_noise", 3)
    3
  """
  if value is None:
    return None
  if isinstance(value, (numbers.Integral, np.integer)) and not isinstance(
      value, (bool, np.bool_)) and -_INT64 <= int(value) < _INT64:
    return int(value)
  raise _errors.GraphGradError(
      f"{factory}: `{arg}` must be None or a Python int (a 64-bit integer); "
      f"got {_describe(value)}. Pass e.g. {arg}=0.")


def random_matrix(factory: str, random_seed: Any, stddev: Any) -> None:
  """Checks the ``seed`` (``random_seed``) and ``stddev`` of a method that
  draws random matrices.

  Example:
    >>> random_matrix("feedback_alignment", 0, -1.0)
    Traceback (most recent call last):
    ...
    graphgrad._errors.GraphGradError: feedback_alignment: `stddev` must be
    positive; got -1.0. Pass e.g. stddev=0.1, or None for the default.
  """
  seed(factory, random_seed)
  if stddev is not None:
    number(factory, "stddev", stddev, what="positive", low=0.0,
           low_open=True, tensor=False,
           fix="Pass e.g. stddev=0.1, or None for the default.")
