"""The Keras tape's side of one rewritten layer call, and the edges into it.

:func:`backward_of_call` is what a rewritten layer's ``tf.custom_gradient``
runs: it receives ``dy``, the gradient at the call's outputs summed over all
consumers, and hands it to core's backward step
(:meth:`graphgrad.core._layer_step.BackwardPass.layer_backward`) with the
call as a :class:`_CallSite`: the call's inner tape is its VJP. An override
is the call's gradient function, so task gradients (plain backpropagation)
use it too.

:func:`edge_grads` then hands the part of the inputs' gradient that reaches
a lower layer's outputs through glue to the lower layer, rewritten by core's
edge step.
"""

import collections
from typing import List

import tensorflow as tf

from graphgrad.core._gradients import add_dense, dense, is_float
from graphgrad.core._layer_step import split_vjp
from graphgrad.core._rules import LayerRule, Mode
from graphgrad.keras import _methods


class _CallSite:
  """One rewritten layer call (``core._layer_step.Site``): the layer VJP of
  the call (``_tape_vjp.TapeVJP``) is its VJP."""

  def __init__(self, run, rule: LayerRule, inner, outs, own, other, deltas):
    self.run, self.rule, self.inner = run, rule, inner
    self.outputs, self.inputs = outs, inner.inputs
    self.own, self.other, self.deltas = own, other, deltas

  @property
  def layer(self):
    return self.run.plan.layer(self.rule.layer)

  @property
  def net(self):
    return self.run.plan.layers

  def vjp(self, grads, inputs: bool, own: bool, other: bool):
    return split_vjp(
        lambda xs, vs: self.inner.vjp(self.outputs, xs + vs, grads),
        self.inputs, self.own, self.other, inputs, own, other)

  def task_deltas(self, grads):
    # Combined over every call of the layer before the step (_tape).
    return self.deltas

  def methods(self):
    path = self.rule.layer
    return _methods.TapeBackward(self.inner, self.layer, path, self.inputs,
                                 self.run.plan.method_variables)

  def recording(self):
    return self.inner.recording()

  def paused(self):
    return self.inner.paused()


def backward_of_call(run, step, path: str, call: int, inner, out, dys,
                     variables):
  """Input and variable gradients of one call of a rewritten layer.

  Args:
    run: the tape's :class:`~graphgrad.keras._intercept.Interceptor`.
    step: the :class:`~graphgrad.keras._intercept.BackwardStep` under way.
    path: the layer's path.
    call: which call of the layer this is (0 for the first).
    inner: the call's layer VJP (``_tape_vjp.TapeVJP.record``), whose
      ``inputs`` are the call's floating-point input tensors.
    out: what the call returned.
    dys: the gradients at ``out``'s tensors.
    variables: the variables the call read.

  Returns:
    ``(gradients for xs, gradients for variables)``.
  """
  deltas = step.task_deltas.get(path)
  deltas = [None] * len(dys) if deltas is None else deltas[call]
  kept = [(o, dy, d) for o, dy, d in zip(tf.nest.flatten(out), dys, deltas)
          if is_float(o) and (dy is not None or d is not None)]
  n = len(inner.inputs)
  if not kept:
    return [None] * n, [None] * len(variables)
  plan = run.plan
  rule = plan.rules.rule(path)
  if step.plain:  # task gradients: plain backpropagation, or the override
    rule = (LayerRule(path, Mode.OVERRIDDEN, override=rule.override)
            if rule.override is not None else LayerRule(path))
    own = list(range(len(variables)))
  else:
    own_refs = {v.ref() for v in plan.own_variables(path)}
    own = [i for i, v in enumerate(variables) if v.ref() in own_refs]
  other = [i for i in range(len(variables)) if i not in set(own)]
  site = _CallSite(run, rule, inner, [o for o, _, _ in kept],
                   [variables[i] for i in own], [variables[i] for i in other],
                   [d for _, _, d in kept])
  result = step.layer_backward(rule, site, [dy for _, dy, _ in kept])
  dv: list = [None] * len(variables)
  for i, grad in zip(own + other, result.own + result.other):
    dv[i] = grad
  dx = [None] * n if result.inputs is None else list(result.inputs)
  return dx, dv


def edge_grads(step, entries, xs, dx) -> List:
  """Gradients for the lower layers' outputs, the extra inputs of an edge.

  ``dx`` is rewritten in place: an input that *is* a lower layer's output
  passes its whole gradient through the extra input instead.
  """
  extra, direct_inputs = [], set()
  for rule, outs, glue in entries:
    if step.plain:
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
    through_glue = glue.vjp([xs[i] for i in glued], outs,
                            [dense(dx[i]) for i in glued])
    for j, t in enumerate(outs):
      via_glue = through_glue[j]
      total = add_dense([dx[i] for i in direct[j]] + [via_glue])
      if total is None:
        extra.append(None)
        continue
      new = step.edge_backward(rule, t, total)
      if new is None:  # a zero factor: nothing reaches the lower layer
        extra.append(None if via_glue is None else -via_glue)
      else:
        extra.append(new if via_glue is None else dense(new) - via_glue)
      direct_inputs.update(direct[j])
      step.edges_fed.add((rule.lower, rule.upper))
  for i in direct_inputs:
    dx[i] = None
  return extra

