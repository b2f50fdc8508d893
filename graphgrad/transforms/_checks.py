"""The transform contract: a rewritten gradient keeps shape, dtype, sparsity.

Shared by GradientPlan, KerasPlan and AfterAggregation, which all apply
user transforms and must all refuse the same broken results.
"""

from typing import Sequence

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.transforms._group import GroupTransform
from graphgrad.transforms._transforms import Transform, TransformContext, chain


def compose(fns: Sequence[Transform]) -> Transform:
  """One transform applying ``fns`` in order."""
  return fns[0] if len(fns) == 1 else chain(*fns)


def not_group(fn, method: str) -> None:
  """Refuses a group transform where one gradient is rewritten."""
  if isinstance(fn, GroupTransform):
    raise _errors.GraphGradError(
        f"{method}: {fn!r} is a group transform, which rewrites a layer's "
        f"parameter gradients together; it has no meaning for one boundary "
        f"gradient. Use plan.transform_gradients(layer, {fn!r}).")


def checked(fn: Transform, grad: Gradient, ctx: TransformContext,
             where: str) -> Gradient:
  """Applies ``fn`` and checks that shape and dtype are kept."""
  return check_result(grad, fn(grad, ctx), where)


def check_result(grad: Gradient, out: Gradient, where: str) -> Gradient:
  """Checks that a transform's result ``out`` keeps ``grad``'s shape, dtype."""
  if grad is None:
    return out
  before = grad.values if isinstance(grad, tf.IndexedSlices) else grad
  after = out.values if isinstance(out, tf.IndexedSlices) else out
  if after is None:
    raise _errors.IncompatibleGradientError(
        f"{where}: the transform returned None for a gradient of shape "
        f"{before.shape} {before.dtype.name}. Return a tensor; use "
        f"gg.transforms.zero() to drop a gradient.")
  if isinstance(grad, tf.IndexedSlices) != isinstance(out, tf.IndexedSlices):
    raise _errors.IncompatibleGradientError(
        f"{where}: the transform turned a "
        f"{type(grad).__name__} gradient into a {type(out).__name__}. Keep "
        f"sparse gradients sparse: act on .values, as gg.transforms do.")
  try:
    after = tf.convert_to_tensor(after)
  except (TypeError, ValueError):
    raise _errors.IncompatibleGradientError(
        f"{where}: the transform returned {type(after).__name__}, not a "
        f"tensor. Return a tensor of the same shape and dtype.") from None
  if after.dtype != before.dtype or not after.shape.is_compatible_with(
      before.shape):
    raise _errors.IncompatibleGradientError(
        f"{where}: the transform changed the gradient from shape "
        f"{before.shape} {before.dtype.name} to shape {after.shape} "
        f"{after.dtype.name}. A transform must keep shape and dtype.")
  return out
