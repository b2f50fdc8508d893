"""Per-op gradient hooks for one ``tf.gradients`` call of the engine.

A chain of layers with linear upstream rewrites (``scale`` on every boundary)
needs no cut between them: what layer ``L`` passes below is ``c`` times the
plain backpropagation through ``L``, so one ``tf.gradients`` call can cover
the whole chain if, inside it, the gradient each of ``L``'s ops hands to a
tensor below ``L`` is multiplied by ``c``. :func:`hooked` does this for one
call: ``tf.gradients`` looks up every op's gradient function through
``ops.get_gradient_function``, and within the block this thread's lookup
returns, for the hooked ops only, the registered function followed by

* ``scale``: multiplying the gradient of chosen inputs by a factor;
* ``read``: recording the gradient of chosen outputs (the complete gradient
  at a layer's outputs, which the plan's trace keeps).

Nothing is registered and no op is changed. The module's function is
replaced once, on first use, by one that returns TensorFlow's own function
unless this thread is inside :func:`hooked`: other calls, other threads and
ops without a hook see exactly what they saw before. When a TensorFlow
release drops ``ops.get_gradient_function``, :func:`available` is False and
the engine cuts the chain at every layer instead (same gradients, one call
per layer).
"""

import contextlib
import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from graphgrad import _compat

try:
  from tensorflow.python.framework import ops as _tf_ops  # pylint: disable=g-direct-tensorflow-import
except ImportError:  # a TensorFlow that moved it: no hooks
  _tf_ops = None

_ORIGINAL = getattr(_tf_ops, "get_gradient_function", None)


@dataclasses.dataclass
class Hook:
  """What to do around one op's gradient function.

  Attributes:
    scale: ``(input index, weigh)`` pairs: ``weigh(grad)`` replaces the
      gradient of that input.
    read: ``(output index, record)`` pairs: ``record(grad)`` receives the
      gradient of that output (``None`` when it has none).
  """
  scale: List[Tuple[int, Callable]] = dataclasses.field(default_factory=list)
  read: List[Tuple[int, Callable]] = dataclasses.field(default_factory=list)


def available() -> bool:
  """True when this TensorFlow looks gradient functions up where we hook.

  Logs once when it does not: the engine then cuts at every layer.
  """
  if callable(_ORIGINAL):
    return True
  _compat.warn_fallback("ops.get_gradient_function",
                        "one tf.gradients call per rewritten layer (the "
                        "same gradients, one more op per boundary)")
  return False


def registered(op: tf.Operation) -> Optional[Callable]:
  """``op``'s own gradient function, or ``None`` (none, or not found)."""
  if not callable(_ORIGINAL):
    return None
  try:
    return _ORIGINAL(op)  # type: ignore[misc]
  except LookupError:
    return None


def _lookup(op):
  hooks = _PATCH.value()
  hook = hooks.get(op) if hooks else None
  fn = _ORIGINAL(op)  # type: ignore[misc]
  if hook is None or fn is None:
    return fn
  return _wrap(fn, hook)


# Installed by hooked(); hooks the lookups of this thread's calls only.
_PATCH = _compat.ThreadPatch("get_gradient_function", _lookup)


def _wrap(fn: Callable, hook: Hook) -> Callable:
  def hooked_grad(op, *out_grads):
    for i, record in hook.read:
      record(out_grads[i])
    grads = fn(op, *out_grads)
    if not hook.scale:
      return grads
    single = not isinstance(grads, (list, tuple))
    grads = [grads] if single else list(grads)
    for i, weigh in hook.scale:
      grads[i] = weigh(grads[i])
    return grads[0] if single else grads
  return hooked_grad


@contextlib.contextmanager
def hooked(hooks: Dict[tf.Operation, Hook]):
  """Within the block, this thread's ``tf.gradients`` runs ``hooks``.

  Args:
    hooks: op -> what to do around its registered gradient function.

  Yields:
    Nothing.

  Raises:
    RuntimeError: if hooks are asked for where :func:`available` is False.
  """
  if not hooks:
    yield
    return
  if not available():
    raise RuntimeError("gradient hooks need ops.get_gradient_function")
  with _PATCH.active(_tf_ops, hooks):
    yield
