"""A layer whose one declaration is a linear upstream rewrite, uncut.

A linear rewrite ``f(dy) = c * dy`` commutes with the layer's VJP. When it
is the layer's only declaration and the call reads no variable but its own,
the layer runs as it is, under the user's tape, on inputs that pass through
an identity whose gradient is ``c`` times what reaches it
(:func:`scaled_input`). The layer's own variables then get the plain
gradient, and everything below that is reached through the layer gets ``c``
times its gradient, with no interception of the layer at all: a fused VJP.
Bypass paths never pass the identity. An identity on each output
(:func:`observed`) hands the gradient there to core's layer step, with a
``core._layer_step.FusedSite``, which records it.
"""

import logging
import weakref
from typing import Callable

import tensorflow as tf

from graphgrad.core._gradients import is_zero, weigh

log = logging.getLogger("graphgrad")

# layer -> whether its call reads only the layer's own variables.
_READS_OWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def reads_only_own(layer, call: Callable, args, kwargs, own) -> bool:
  """Whether ``call(*args, **kwargs)`` reads no variable but ``own``.

  Traced once per layer, the first time it is asked, in a graph of its own
  (``tf.function(call).get_concrete_function``): no op runs, and the graph
  being built is untouched, but Python side effects in ``call`` happen once
  more. The answer is kept per layer object: a layer that starts reading
  another layer's variable after that is not traced again. A call that
  cannot be traced alone counts as reading others, so the layer takes the
  general path.
  """
  known = _READS_OWN.get(layer)
  if known is None:
    mine = {v.ref() for v in own}
    try:
      traced = tf.function(call).get_concrete_function(*args, **kwargs)
      known = all(v.ref() in mine for v in traced.variables)
    except Exception as e:  # pylint: disable=broad-except
      log.debug("graphgrad: %s cannot be traced alone (%s); it takes the "
                "general path", getattr(layer, "name", layer), e)
      known = False
    _READS_OWN[layer] = known
  return known


def scaled_input(t: tf.Tensor, factor, plain: Callable[[], bool]):
  """``t``, whose gradient is ``factor`` times what reaches it.

  ``plain()`` is read when the gradient is built: while a plan computes
  task gradients (plain backpropagation) the identity passes them as they
  are. A factor of 0 sends nothing below.
  """
  @tf.custom_gradient
  def scaled(x):
    def grad(dy):
      if plain():
        return dy
      return None if is_zero(factor) else weigh(dy, factor)
    return tf.identity(x), grad
  return scaled(t)


def observed(t: tf.Tensor, record: Callable) -> tf.Tensor:
  """``t`` through an identity whose gradient is what reaches it, handed
  to ``record(t, dy)`` on the way (a Keras mask stays on the output)."""
  @tf.custom_gradient
  def seen(x):
    def grad(dy):
      record(t, dy)
      return dy
    return tf.identity(x), grad
  out = seen(t)
  mask = getattr(t, "_keras_mask", None)
  if mask is not None:
    try:
      out._keras_mask = mask  # pylint: disable=protected-access
    except AttributeError:
      pass
  return out
