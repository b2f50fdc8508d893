"""One VJP for a layer whose upstream rewrite is linear, in the TF2 tape.

A linear rewrite ``f(dy) = c * dy`` commutes with the layer's VJP. Two ways
use that:

* :func:`scaled_input`: when the layer's only declaration is the linear
  upstream rewrite and its call reads no variable but its own, the layer
  runs as it is, under the user's tape, on inputs that pass through an
  identity whose gradient is ``c`` times what reaches it. The layer's own
  variables then get the plain gradient, and everything below that is
  reached through the layer gets ``c`` times its share: the rewrite, with no
  interception of the layer at all. Bypass paths never pass the identity.
* :func:`backward`: inside the layer's ``tf.custom_gradient`` (where other
  declarations need it), one VJP of ``dy``, with what it sends below
  weighted by ``c``, instead of a second VJP of ``f(dy)``.
"""

import logging
import weakref
from typing import Callable

import tensorflow as tf

log = logging.getLogger("graphgrad")

# False: a linear upstream rewrite takes the general path (a second VJP with
# ``fn(dy)``), as a nonlinear one does. Exactness tests compare both paths.
FUSE_LINEAR = True

# layer -> whether its call reads only the layer's own variables.
_READS_OWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _weigh(g, factor):
  if g is None:
    return None
  if isinstance(g, tf.IndexedSlices):
    return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype),
                            g.indices, g.dense_shape)
  return g * tf.cast(factor, g.dtype)


def _is_zero(factor) -> bool:
  return isinstance(factor, (int, float)) and factor == 0


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
      return None if _is_zero(factor) else _weigh(dy, factor)
    return tf.identity(x), grad
  return scaled(t)


def backward(inner, outs, dys, xs, variables, own, factor):
  """One VJP for a linear upstream rewrite ``factor * dy``.

  The layer's own variables get the VJP of ``dy``; its inputs and the other
  layers' variables it reads get ``factor`` times theirs, which is the VJP
  of ``factor * dy``. A factor of 0 computes the own variables' VJP alone and
  sends nothing below.
  """
  n = len(xs)
  if _is_zero(factor):
    mine = [variables[i] for i in sorted(own)]
    grads = dict(zip(sorted(own), inner.gradient(
        outs, mine, output_gradients=dys))) if mine else {}
    return [None] * n, [grads.get(i) for i in range(len(variables))]
  g = inner.gradient(outs, xs + variables, output_gradients=dys)
  dv = [gv if i in own else _weigh(gv, factor)
        for i, gv in enumerate(g[n:])]
  return [_weigh(d, factor) for d in g[:n]], dv
