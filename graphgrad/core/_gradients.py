"""Helpers on gradient values that both executors use.

Sums of contributions (:func:`aggregate`), known factors (:func:`is_zero`,
:func:`weigh`), the checked result of an override's gradient function
(:func:`input_grads`, :func:`straight_through`), and the complete upstream
gradient of a layer above (:func:`completed_upstream`).
"""

from typing import Callable, List, Mapping, Optional, Sequence

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient

GradFn = Callable[..., object]


def is_float(t) -> bool:
  """Whether ``t`` is a tensor that can carry a gradient."""
  return tf.is_tensor(t) and (t.dtype.is_floating or t.dtype.is_complex)


def dense(g):
  """``g`` as a dense tensor when it is ``IndexedSlices``, else as it is."""
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def add_dense(parts):
  """The dense sum of ``parts`` (``None`` entries skipped), or ``None``."""
  parts = [dense(p) for p in parts if p is not None]
  if not parts:
    return None
  return parts[0] if len(parts) == 1 else tf.add_n(parts)


def aggregate(grads: Sequence, like: Optional[tf.Tensor] = None):
  """Sums gradient contributions, keeping them sparse when all are sparse."""
  grads = [g for g in grads if g is not None]
  if not grads:
    return None
  if len(grads) == 1:
    return grads[0]
  sparse = [g for g in grads if isinstance(g, tf.IndexedSlices)]
  if len(sparse) == len(grads):
    return tf.IndexedSlices(
        tf.concat([g.values for g in sparse], 0),
        tf.concat([g.indices for g in sparse], 0),
        sparse[0].dense_shape)
  dense_parts = [g for g in grads if not isinstance(g, tf.IndexedSlices)]
  for g in sparse:
    rows = (g.dense_shape[0] if g.dense_shape is not None
            else tf.shape(like if like is not None else dense_parts[0])[0])
    dense_parts.append(tf.math.unsorted_segment_sum(g.values, g.indices, rows))
  return tf.add_n(dense_parts)


def _number(factor) -> bool:
  return isinstance(factor, (int, float)) and not isinstance(factor, bool)


def is_zero(factor: Optional[float]) -> bool:
  """True for a factor known, when building, to be 0."""
  return _number(factor) and factor == 0


def is_one(factor: Optional[float]) -> bool:
  """True for no factor, or a factor known, when building, to be 1."""
  return factor is None or (_number(factor) and factor == 1)


def weigh(grad, factor, constant: Optional[Callable] = None):
  """``factor * grad``, sparse kept sparse; ``grad`` itself for a factor of 1.

  Args:
    grad: a gradient, or ``None``.
    factor: a Python number.
    constant: optional ``(factor, dtype) -> tensor``, so that one tf.Graph
      holds one constant per factor; else ``tf.cast`` makes it.
  """
  if grad is None or is_one(factor):
    return grad
  values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
  c = (constant(factor, values.dtype) if constant is not None
       else tf.cast(factor, values.dtype))
  scaled = values * c
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(scaled, grad.indices, grad.dense_shape)
  return scaled


def straight_through(op, *grads):
  """The straight-through estimator: input ``i`` gets output ``i``'s gradient.

  Inputs with no output of the same index, dtype and compatible shape (a
  ``FakeQuant`` op's ``min``/``max``) get ``None``: the identity backward of
  ``gradient_override_map({"Round": "Identity"})``.
  """
  out = []
  for i, t in enumerate(op.inputs):
    g = grads[i] if i < len(grads) else None
    ok = (g is not None and t.dtype == op.outputs[i].dtype
          and t.shape.is_compatible_with(op.outputs[i].shape))
    out.append(g if ok else None)
  return out


def _describe(t) -> str:
  return t.name if tf.is_symbolic_tensor(t) else "of shape " + str(t.shape)


def input_grads(op, fn: GradFn, grads) -> List:
  """Calls an override's ``fn`` and checks one gradient per input, like it.

  ``op`` is a ``tf.Operation``, or anything with its ``name``, ``type``,
  ``inputs`` and ``outputs`` (a KerasPlan's layer call).

  Raises:
    IncompatibleGradientError: for a wrong number of gradients, or one of
      another shape or dtype than its input.
    GraphGradError: for ``straight_through`` with no matching input.
  """
  with tf.name_scope(op.name.replace("/", "_") + "_override"):
    out = fn(op, *grads)
  if not isinstance(out, (list, tuple)):
    out = [out]
  name = "straight_through" if fn is straight_through else "override_gradient"
  if len(out) != len(op.inputs):
    raise _errors.IncompatibleGradientError(
        f"{name}: fn returned {len(out)} gradient(s) for {op.name}, which has "
        f"{len(op.inputs)} input(s). Return one gradient (or None) per "
        f"input, in order.")
  checked = []
  for t, g in zip(op.inputs, out):
    if g is not None:
      values = g.values if isinstance(g, tf.IndexedSlices) else g
      values = tf.convert_to_tensor(values)
      if values.dtype != t.dtype or (not isinstance(g, tf.IndexedSlices)
                                     and not values.shape.is_compatible_with(
                                         t.shape)):
        raise _errors.IncompatibleGradientError(
            f"{name}: the gradient fn returned for the input {_describe(t)} "
            f"of {op.name} has shape {values.shape} {values.dtype.name}; the "
            f"input has shape {t.shape} {t.dtype.name}. Return a gradient of "
            f"each input's shape and dtype.")
      g = values if not isinstance(g, tf.IndexedSlices) else g
    checked.append(g)
  if fn is straight_through and not any(g is not None for g in checked):
    raise _errors.GraphGradError(
        f"straight_through: no input of {op.name} (type {op.type}) matches an "
        f"output of the same index in dtype and shape, so the identity has "
        f"nowhere to send the gradient. Use plan.override_gradient(op, fn).")
  return checked


def completed_upstream(done: Mapping[str, List[Gradient]],
                       layer: str) -> List[Gradient]:
  """``context.upstream_of(layer)``: ``done[layer]``, once it is complete.

  ``done`` maps each rewritten layer whose backward pass already ran to the
  gradient at its outputs; both executors fill it from the loss downwards.

  Raises:
    UnsupportedGraphError: if ``layer``'s gradient is not complete yet.
  """
  if layer not in done:
    raise _errors.UnsupportedGraphError(
        f"the gradient at layer {layer!r}'s outputs is needed before it "
        f"is complete: {layer!r} is not a rewritten layer above the one "
        f"being processed. Read the gradient of a layer nearer the loss.")
  return list(done[layer])
