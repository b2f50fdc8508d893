"""Substitutions in the gradient lookup of one ``tf.gradients`` call.

Within :func:`hooked`, this thread's gradient-function lookup returns, for an
overridden op, the plan's function instead of the registered one (or of none),
so an override acts in every call that crosses its op and nothing is cut
there; then, for a hooked op, that function followed by ``scale`` (weighting
chosen inputs' gradients) and ``read`` (recording chosen outputs' gradients).
A chain of layers with linear upstream rewrites needs no cut between them:
what layer ``L`` passes below is ``c`` times the plain backpropagation
through ``L``, so one call covers the chain if each gradient ``L``'s ops hand
below ``L`` is multiplied by ``c``. Nothing is registered and no op changes.
The lookup is private (``graphgrad._compat``): where its self-test fails,
:func:`available` is False, the engine cuts at every layer instead (the same
gradients, one call per layer), and a plan with an override is refused.
"""

import contextlib
import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from graphgrad import _compat


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
  """True when ``tf.gradients`` calls a replaced lookup on this TensorFlow.

  This is the self-test of ``_compat.PRIVATE_APIS["gradient_lookup"]``;
  when it fails, one warning is logged and the engine cuts at every layer.
  """
  return _compat.usable("gradient_lookup")


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
def hooked(hooks: Dict[tf.Operation, Hook],
           overrides: Optional[Dict[str, Callable]] = None):
  """Within the block, this thread's ``tf.gradients`` substitutes and hooks.

  Args:
    hooks: op -> what to do around its gradient function.
    overrides: op name -> the gradient function that replaces the
      registered one, ``fn(op, *output_grads) -> input grads``.

  Yields:
    Nothing.

  Raises:
    RuntimeError: if asked for where :func:`available` is False.
  """
  if not hooks and not overrides:
    yield
    return
  if not available():
    raise RuntimeError("gradient hooks need ops.get_gradient_function")
  overrides = overrides or {}

  def wrap(op, fn):
    fn = overrides.get(op.name, fn)
    hook = hooks.get(op)
    return fn if hook is None or fn is None else _wrap(fn, hook)

  with _compat.wrapped_gradients(wrap):
    yield

