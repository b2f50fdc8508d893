"""The backward pass of one rewritten layer call, and the edges into it.

:func:`backward_of_call` is what a rewritten layer's ``tf.custom_gradient``
runs: it receives ``dy``, the gradient at the call's outputs summed over all
consumers, and applies the plan's declarations for that layer in the order
the TF1 engine does:

1. a task combination rewrites ``dy`` (the layer's parameters and
   everything below see the result);
2. the layer's own variables get their gradients from that ``g``;
3. the upstream transform maps ``g`` to ``fn(g)``;
4. the inputs get what backpropagating ``fn(g)`` through the call gives, or
   what the backward replacement returns instead, or what the layer's
   override (``override_gradient``, ``straight_through``) returns: an
   override is the call's gradient function, so task gradients use it too.

A linear upstream transform ``fn(g) = c * g`` on a layer with neither a
replacement nor an override takes steps 2 to 4 in one VJP of ``g``, whose
share below is weighted by ``c`` (:mod:`graphgrad.keras._linear`).

:func:`edge_grads` then hands the share of the inputs' gradient that reaches
a lower layer's outputs through glue to the lower layer, rewritten by the
edge transform.
"""

import collections
from typing import Any, List, NamedTuple, Tuple

import tensorflow as tf

from graphgrad.core._gradients import add_dense, dense, input_grads, is_float
from graphgrad.keras import _linear
from graphgrad.transforms import _checks


def describe(t) -> str:
  return t.name if tf.is_symbolic_tensor(t) else f"an output of shape {t.shape}"


class LayerCall(NamedTuple):
  """One call of an overridden layer, as its override ``fn`` sees it.

  It has the ``name``, ``type``, ``inputs`` and ``outputs`` of a
  ``tf.Operation``, so that ``fn(call, *output_grads)`` is written like a
  registered gradient function (and ``straight_through`` serves both).

  Attributes:
    name: the layer's path in the model.
    type: the layer's class name.
    inputs: the call's floating-point input tensors.
    outputs: the call's floating-point output tensors that get a gradient.
    layer: the Keras layer.
  """
  name: str
  type: str
  inputs: Tuple[Any, ...]
  outputs: Tuple[Any, ...]
  layer: Any


def _chain(run, path, inner, outs, xs, variables, g):
  """Plain backpropagation through the call, or its override's for xs."""
  n = len(xs)
  override = run.plan.declarations.overrides.get(("layer", path))
  if override is None:
    res = inner.gradient(outs, xs + variables, output_gradients=g)
    return list(res[:n]), list(res[n:])
  dv = inner.gradient(outs, variables, output_gradients=g) if variables else []
  return overridden(run, path, override, xs, outs, g), list(dv)


def overridden(run, path: str, fn, xs, outs, g) -> list:
  """The gradients ``fn`` gives the inputs of one call of layer ``path``."""
  layer = run.plan.layer(path)
  call = LayerCall(path, type(layer).__name__, tuple(xs), tuple(outs), layer)
  return list(input_grads(call, fn, list(g)))


def backward_of_call(run, path: str, call: int, inner, out, xs, dys,
                     variables):
  """Input and variable gradients of one call of a rewritten layer.

  Args:
    run: the tape's :class:`~graphgrad.keras._intercept.Interceptor`.
    path: the layer's path.
    call: which call of the layer this is (0 for the first).
    inner: a persistent tape that recorded the call.
    out: what the call returned.
    xs: the call's floating-point input tensors.
    dys: the gradients at ``out``'s tensors.
    variables: the variables the call read.

  Returns:
    ``(gradients for xs, gradients for variables)``.
  """
  if not run.plain:  # task gradients are plain backpropagation
    dys = run.combine_tasks(path, call, dys)
  pairs = [(o, dy) for o, dy in zip(tf.nest.flatten(out), dys)
           if is_float(o) and dy is not None]
  outs = [o for o, _ in pairs]
  g = [dy for _, dy in pairs]
  n = len(xs)
  if not outs:
    return [None] * n, [None] * len(variables)
  plan = run.plan
  if run.plain:
    return _chain(run, path, inner, outs, xs, variables, g)
  run.done[path] = g
  fn = plan.declarations.upstream.get(path)
  replace = plan.declarations.backward.get(path)
  override = plan.declarations.overrides.get(("layer", path))
  if fn is None and replace is None:
    return _chain(run, path, inner, outs, xs, variables, g)
  own_refs = {v.ref() for v in plan.own_variables(path)}
  own = [i for i, v in enumerate(variables) if v.ref() in own_refs]
  if (_linear.FUSE_LINEAR and replace is None and override is None
      and fn is not None and fn.linear_factor is not None):
    return _linear.backward(inner, outs, g, xs, variables, set(own),
                            fn.linear_factor)
  other = [i for i in range(len(variables)) if i not in set(own)]
  dv = _own_grads(inner, outs, g, variables, own)
  if fn is not None:
    g = [_checks.checked(fn, dy, run.context(path, "upstream", tensor=o),
                         f"transform_upstream({path!r}) on {describe(o)}")
         for o, dy in zip(outs, g)]
  below = xs if replace is None and override is None else []
  res = inner.gradient(outs, below + [variables[i] for i in other],
                       output_gradients=g) if below or other else []
  for i, grad in zip(other, res[len(below):]):
    dv[i] = grad
  if override is not None:
    return overridden(run, path, override, xs, outs, g), dv
  if replace is None:
    return list(res[:n]), dv
  dx = run.replace(path, replace, xs, outs, g,
                   lambda: list(inner.gradient(outs, xs, output_gradients=g)))
  return dx, dv


def _own_grads(inner, outs, g, variables, own) -> list:
  """True gradients of ``variables[i]`` for ``i`` in ``own``; None elsewhere.

  A layer's own parameters take the chain rule from the gradient at its
  outputs before any upstream transform or replacement.
  """
  dv = [None] * len(variables)
  for i, grad in zip(own, inner.gradient(
      outs, [variables[i] for i in own], output_gradients=g) if own else []):
    dv[i] = grad
  return dv


def edge_grads(run, entries, xs, dx) -> List:
  """Gradients for the lower layers' outputs, the extra inputs of an edge.

  ``dx`` is rewritten in place: an input that *is* a lower layer's output
  passes its whole gradient through the extra input instead.
  """
  extra, direct_inputs = [], set()
  for lo, upper, fn, outs, glue in entries:
    if run.plain:
      extra += [None] * len(outs)
      continue
    direct = collections.defaultdict(list)
    glued = []
    for i, x in enumerate(xs):
      js = [j for j, t in enumerate(outs) if t is x]
      if js:
        direct[js[0]].append(i)
      elif dx[i] is not None:
        glued.append(i)
    shares = (glue.gradient([xs[i] for i in glued], outs,
                            output_gradients=[dense(dx[i]) for i in glued])
              if glued else [None] * len(outs))
    for j, t in enumerate(outs):
      via_glue = shares[j]
      total = add_dense([dx[i] for i in direct[j]] + [via_glue])
      if total is None:
        extra.append(None)
        continue
      new = _checks.checked(
          fn, total, run.context(lo, "edge", tensor=t, edge=(lo, upper)),
          f"transform_edge({lo!r}, {upper!r}) on {describe(t)}")
      extra.append(new if via_glue is None else dense(new) - via_glue)
      direct_inputs.update(direct[j])
      run.edges_fed.add((lo, upper))
  for i in direct_inputs:
    dx[i] = None
  return extra

