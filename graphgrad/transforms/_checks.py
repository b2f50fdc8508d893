"""The transform contract: a rewritten gradient keeps shape, dtype, sparsity.

Shared by GradientPlan, KerasPlan and AfterAggregation, which all apply
user transforms and must all refuse the same broken results.
"""

import re
from typing import Any, List, Sequence, Tuple

import tensorflow as tf

from graphgrad import _errors
from graphgrad._types import Gradient
from graphgrad.transforms import _scaled
from graphgrad.transforms._group import GroupTransform
from graphgrad.transforms._transforms import (
  Transform,
  TransformContext,
  _Fn,
)


def checked(fn: Transform, grad: Gradient, ctx: TransformContext,
             where: str, scale: Any = None) -> Gradient:
  """Applies ``fn`` and checks that shape, dtype and tf.Graph are kept.

  Under a loss scale ``scale`` (a tensor; ``None`` for none) a non-linear
  ``fn`` sees ``grad / scale`` and its result is scaled back (``_scaled``).

  An exception the transform raises becomes a ``GraphGradError`` that names
  ``where`` (the declaration and the layer), chained to the original.
  """
  if _scaled.needs_unscaling(fn, scale):  # see _scaled
    return _scaled.around(grad, lambda g: check_result(
        g, _call(fn, (g, ctx), where, "transform"), where), scale)
  return check_result(grad, _call(fn, (grad, ctx), where, "transform"),
                      where, at_run_time=not _keeps_shape(fn),
                      transform=fn)


def _keeps_shape(fn) -> bool:
  """True for graphgrad's own transforms, which keep shape by construction
  (a wrapped callable or a user's subclass is checked at run time)."""
  parts = getattr(fn, "parts", None) or ()
  return bool(parts) and all(
      type(p).__module__.startswith("graphgrad.") and not isinstance(p, _Fn)
      for p in parts)


def _call(fn, args, where: str, kind: str):
  """``fn(*args)``; an exception other than a ``GraphGradError`` becomes one
  naming ``where``, chained to the original."""
  try:
    return fn(*args)
  except _errors.GraphGradError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise raised_error(where, kind, fn, e) from e


def checked_group(fn: GroupTransform,
                  grads_and_vars: Sequence[Tuple[Gradient, tf.Variable]],
                  ctx: TransformContext, where: str,
                  scale: Any = None) -> List[Gradient]:
  """Applies group transform ``fn``; an exception it raises becomes a
  ``GraphGradError`` naming ``where``, chained to the original. The caller
  checks each new gradient with :func:`check_result`. Under a loss scale
  ``scale`` ``fn`` sees the unscaled gradients (``_scaled``)."""
  scaled = _scaled.needs_unscaling(fn, scale)
  before = [g for g, _ in grads_and_vars]
  if scaled:
    grads_and_vars = [(_scaled.unscale(g, scale), v)
                      for g, v in grads_and_vars]
  out = _call(fn, (grads_and_vars, ctx), where, "group transform")
  out = one_per_pair(out, len(grads_and_vars), lambda got: (
      _errors.IncompatibleGradientError(
          f"{where}: the group transform {fn!r} returned {got} for "
          f"{len(grads_and_vars)} (gradient, variable) pairs. Return one "
          f"gradient (or None) per pair, in order.")))
  if not scaled:
    return out
  # The caller checks dtypes against the scaled gradients: check here, on
  # what the transform saw, before the cast back hides a changed dtype.
  return [_scaled.rescale(b, check_result(g, o, where), scale)
          for (g, _), b, o in zip(grads_and_vars, before, out)]


def one_per_pair(out, n: int, error) -> List[Gradient]:
  """``out`` as a list of ``n`` gradients, or raises ``error(got)``, where
  ``got`` describes what came instead."""
  out = list(out) if isinstance(out, (list, tuple)) else out
  if not isinstance(out, list) or len(out) != n:
    raise error(f"{len(out)} gradients" if isinstance(out, list)
                else type(out).__name__)
  return out


def raised_error(where: str, kind: str, fn, e: Exception) -> Exception:
  """The GraphGradError for an exception raised by a user's ``fn``."""
  if "same graph" in str(e):
    return _errors.IncompatibleGradientError(
        f"{where}: the {kind} {fn!r} mixed tensors of two tf.Graphs ({e}). "
        f"Expected only tensors of the gradient's tf.Graph, the loss's: "
        f"create the tensors it uses inside it, e.g. under "
        f"`with loss.graph.as_default():`.")
  return _errors.GraphGradError(
      f"{where}: the {kind} {fn!r} raised {type(e).__name__}: {e}. Fix the "
      f"{kind}; it must map the gradient to one of the same shape and dtype.")


def other_graph(tensor, expected) -> bool:
  """True when ``tensor`` belongs to neither ``expected``'s tf.Graph nor one
  enclosing it (a tf.function's graph may capture an outer graph's tensor)."""
  if not tf.is_symbolic_tensor(tensor):
    return False
  if not tf.is_symbolic_tensor(expected):
    return True  # a graph tensor where eager execution runs
  graph = expected.graph
  while graph is not None:
    if tensor.graph is graph:
      return False
    graph = getattr(graph, "outer_graph", None)
  return True


def graph_error(where: str, kind: str, tensor, expected) -> Exception:
  """The error for a result ``tensor`` of another tf.Graph."""
  if tf.is_symbolic_tensor(expected):
    want = f"a tensor of the gradient's tf.Graph, the one of {expected.name}"
    fix = "e.g. under `with loss.graph.as_default():`"
  else:
    want = "an eager tensor, as the gradient is"
    fix = "outside any `with tf.Graph().as_default():`"
  return _errors.IncompatibleGradientError(
      f"{where}: the {kind} returned {tensor.name}, a tensor of another "
      f"tf.Graph; expected {want}. Create the tensors it returns where the "
      f"gradient lives, {fix}.")


def check_result(grad: Gradient, out: Gradient, where: str,
                 at_run_time: bool = True, transform=None) -> Gradient:
  """Checks that a transform's result ``out`` keeps ``grad``'s shape, dtype
  and tf.Graph: statically, and with ``at_run_time`` also at run time where
  a static shape is not fully known. Messages name ``transform`` if given.
  """
  what = ("the transform" if transform is None
          else f"the transform {transform!r}")
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
  if other_graph(after, before):
    raise graph_error(where, "transform", after, before)
  if after.dtype != before.dtype or not after.shape.is_compatible_with(
      before.shape):
    raise _errors.IncompatibleGradientError(
        f"{where}: {what} changed the gradient from shape "
        f"{before.shape} {before.dtype.name} to shape {after.shape} "
        f"{after.dtype.name}. A transform must keep shape and dtype.")
  if not at_run_time or (before.shape.is_fully_defined()
                         and after.shape.is_fully_defined()):
    return out
  checked_after = _assert_same_shape(before, after, where, what)
  if isinstance(out, tf.IndexedSlices):
    return tf.IndexedSlices(checked_after, out.indices, out.dense_shape)
  return checked_after


def _assert_same_shape(before: tf.Tensor, after: tf.Tensor, where: str,
                       what: str) -> tf.Tensor:
  """``after``, gated by a run-time check that it has ``before``'s shape.

  Added only where a static shape is not fully known. The check gates the
  consumers by data, not by a control dependency that Grappler may reroute
  (``FoldTransposeIntoMatMul`` does): ``after`` is reshaped to a shape read
  through a ``CheckNumerics``, which runs after an ``Assert``. Both fail
  with an ``InvalidArgumentError`` naming ``where`` (the declaration and
  the layer) and ``what`` (the transform); the ``Assert`` also prints both
  run-time shapes. XLA auto-jit clusters neither op. Under ``jit_compile``
  XLA drops both, but knows every shape when it compiles: the shape also
  passes through a ``Fill`` of size -1 when they differ, whose conversion
  fails before any consumer's, in the node
  ``check_shape_<declaration>_on_<layer>/the_transform_changed_the_shape``.
  """
  with tf.name_scope("check_shape_" + _node_name(where)):
    want, got = tf.shape(before), tf.shape(after)
    if before.shape.rank is not None and (
        before.shape.rank == after.shape.rank):
      same = tf.reduce_all(tf.equal(want, got))
    else:
      same = tf.cond(tf.equal(tf.size(want), tf.size(got)),
                     lambda: tf.reduce_all(tf.equal(want, got)),
                     lambda: tf.constant(False))
    message = (f"{where}: {what} returned a gradient of another "
               f"shape (static {after.shape} for {before.shape}); a "
               f"transform must keep the shape.")
    check = tf.debugging.Assert(same, [
        f"{message} Run-time shapes, the gradient's then the transform's:",
        want, got])
    with tf.control_dependencies([check]):  # the shapes' message first
      # 1.0 when the shapes match, else inf, which fails.
      one = tf.debugging.check_numerics(1.0 / tf.cast(same, tf.float32),
                                        message)
    # 0 when they match; -1, a Fill XLA cannot compile, where XLA dropped
    # both checks.
    size = tf.cast(tf.equal(one, 1.0), tf.int32) - 1
    nothing = tf.zeros(size[None], tf.int32,
                       name="the_transform_changed_the_shape")
    return tf.reshape(after, want + tf.size(nothing))


def _node_name(text: str) -> str:
  """``text`` as a TF node name: runs of other characters become ``_``."""
  return re.sub(r"[^A-Za-z0-9_.\-]+", "_", text).strip("_")[:80]
