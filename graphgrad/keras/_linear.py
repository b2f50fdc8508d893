"""One VJP for a layer whose upstream rewrite is linear, in the TF2 tape.

A linear rewrite ``f(dy) = c * dy`` commutes with the layer's VJP, so the
layer's custom gradient computes one VJP of ``dy`` and weights by ``c`` what
it sends below, instead of a second VJP of ``f(dy)``.
"""

import tensorflow as tf

# False: a linear upstream rewrite takes the general path (a second VJP with
# ``fn(dy)``), as a nonlinear one does. Exactness tests compare both paths.
FUSE_LINEAR = True


def _weigh(g, factor):
  if g is None:
    return None
  if isinstance(g, tf.IndexedSlices):
    return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype),
                            g.indices, g.dense_shape)
  return g * tf.cast(factor, g.dtype)


def backward(inner, outs, dys, xs, variables, own, factor):
  """One VJP for a linear upstream rewrite ``factor * dy``.

  The layer's own variables get the VJP of ``dy``; its inputs and the other
  layers' variables it reads get ``factor`` times theirs, which is the VJP
  of ``factor * dy``. A factor of 0 computes the own variables' VJP alone and
  sends nothing below.
  """
  n = len(xs)
  if isinstance(factor, (int, float)) and factor == 0:
    mine = [variables[i] for i in sorted(own)]
    grads = dict(zip(sorted(own), inner.gradient(
        outs, mine, output_gradients=dys))) if mine else {}
    return [None] * n, [grads.get(i) for i in range(len(variables))]
  g = inner.gradient(outs, xs + variables, output_gradients=dys)
  dv = [gv if i in own else _weigh(gv, factor)
        for i, gv in enumerate(g[n:])]
  return [_weigh(d, factor) for d in g[:n]], dv
