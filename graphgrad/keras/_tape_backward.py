"""The backward pass of one rewritten layer call, and the edges into it.

:func:`backward_of_call` is what a rewritten layer's ``tf.custom_gradient``
runs: it receives ``dy``, the gradient at the call's outputs summed over all
consumers, and applies the layer's declarations through the per-layer
policy (:func:`graphgrad.core._layer_policy.layer_backward`), with the
call's inner tape as the VJP provider. An override is the call's gradient
function, so task gradients (plain backpropagation) use it too.

:func:`edge_grads` then hands the part of the inputs' gradient that reaches
a lower layer's outputs through glue to the lower layer, rewritten by the
edge transform.
"""

import collections
import functools
from typing import Any, List, NamedTuple, Tuple

import tensorflow as tf

from graphgrad.core._gradients import (
  add_dense,
  completed_upstream,
  dense,
  input_grads,
  is_float,
  weigh,
)
from graphgrad.core._layer_policy import layer_backward
from graphgrad.core._rules import LayerRule, Mode
from graphgrad.keras import _methods
from graphgrad.methods import _replacement
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


class _CallSteps:
  """The steps of one rewritten layer call (``core._layer_policy.
  OverrideSteps``): the layer VJP of the call (``_tape_vjp.TapeVJP``) is its
  VJP."""

  def __init__(self, run, step, rule: LayerRule, inner, outs, own, other):
    self.run, self.step, self.rule = run, step, rule
    self.inner, self.outs, self.xs = inner, outs, inner.inputs
    self.own, self.other = own, other

  def vjp(self, grads, inputs: bool, own: bool, other: bool):
    xs = list(self.xs) if inputs else []
    vs = (self.own if own else []) + (self.other if other else [])
    res = self.inner.vjp(self.outs, grads, xs + vs)
    n, m = len(xs), len(self.own) if own else 0
    return list(res[:n]), list(res[n:n + m]), list(res[n + m:])

  def weigh(self, grad, factor):
    return weigh(grad, factor)

  def arrived(self, grads):
    # Tasks were combined before (over every output of the call); the
    # complete gradient is what replacements below read.
    if not self.step.plain:
      self.step.done[self.rule.layer] = grads
    return grads

  def transform(self, grads):
    path, fn = self.rule.layer, self.rule.upstream
    out = []
    for o, dy in zip(self.outs, grads):
      ctx = self.run.context(path, "upstream", tensor=o)
      new = _checks.checked(fn, dy, ctx,
                            f"transform_upstream({path!r}) on {describe(o)}")
      self.step.record(ctx, dy, new)
      out.append(new)
    return out

  def observe(self, grads):
    """Records ``g`` where the rule weights its inputs' gradient instead
    of calling its transform."""
    for o, dy in zip(self.outs, grads):
      observe_upstream(self.run, self.step, self.rule, o, dy)

  def replace(self, grads, chain_rule):
    """Runs the replacement on the call; its pairs go to the step.

    The replacement gets a ``BackwardContext`` whose executor is a
    ``_methods.TapeBackward`` and runs through ``gg.backward``'s
    ``run_replacement``, as on the TF1 plan: an exception it raises names
    the layer, and its result is checked (one gradient like each input,
    alone or in a ``BackwardResult``).
    """
    path, plan, inner = self.rule.layer, self.run.plan, self.inner

    def unrecorded_chain_rule():
      with inner.paused():
        return chain_rule()

    with tf.name_scope(f"replace_backward_{path}".replace("/", "_")):
      layer = plan.layer(path)
      ctx = _replacement.BackwardContext(
          layer=layer, name=path, net=plan.layers, inputs=tuple(self.xs),
          outputs=tuple(self.outs), upstream=tuple(grads),
          upstream_of=functools.partial(completed_upstream, self.step.done),
          chain_rule=unrecorded_chain_rule, resources=plan.resources,
          executor=_methods.TapeBackward(inner, layer, path, self.xs,
                                         plan.method_variables),
          labels=self.run.labels)
      with inner.recording():  # the replacement's ops, for context.vjp
        result = _replacement.run_replacement(
            self.rule.replacement, ctx, f"replace_backward({path!r})")
    self.step.extra += list(result.extra_grads_and_vars)
    return list(result.input_grads)

  def override(self, grads):
    """The gradients the override gives the call's inputs."""
    layer = self.run.plan.layer(self.rule.layer)
    call = LayerCall(self.rule.layer, type(layer).__name__, tuple(self.xs),
                     tuple(self.outs), layer)
    return list(input_grads(call, self.rule.override, list(grads)))


def observe_upstream(run, step, rule: LayerRule, output, dy) -> None:
  """Records ``dy``, the gradient at ``output`` of a layer whose linear
  upstream rewrite is weighted in, not called: the trace's ``after`` calls
  the rewrite when it is first read (summaries, a report)."""
  path, fn = rule.layer, rule.upstream
  assert fn is not None  # asked only for a rule with a linear rewrite
  ctx = run.context(path, "upstream", tensor=output)
  where = f"transform_upstream({path!r}) on {describe(output)}"
  step.record(ctx, dy, later=functools.partial(
      _checks.checked, fn, dy, ctx, where))


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
  if not step.plain:
    dys = step.combine_tasks(path, call, dys)
  pairs = [(o, dy) for o, dy in zip(tf.nest.flatten(out), dys)
           if is_float(o) and dy is not None]
  outs = [o for o, _ in pairs]
  g = [dy for _, dy in pairs]
  n = len(inner.inputs)
  if not outs:
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
  result = layer_backward(rule, g, _CallSteps(
      run, step, rule, inner, outs, [variables[i] for i in own],
      [variables[i] for i in other]))
  dv: list = [None] * len(variables)
  for i, grad in zip(own + other, result.own + result.other):
    dv[i] = grad
  dx = [None] * n if result.inputs is None else list(result.inputs)
  return dx, dv


def edge_grads(run, step, entries, xs, dx) -> List:
  """Gradients for the lower layers' outputs, the extra inputs of an edge.

  ``dx`` is rewritten in place: an input that *is* a lower layer's output
  passes its whole gradient through the extra input instead.
  """
  extra, direct_inputs = [], set()
  for lo, upper, fn, outs, glue in entries:
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
    through_glue = glue.vjp([xs[i] for i in glued],
                            [dense(dx[i]) for i in glued], outs)
    for j, t in enumerate(outs):
      via_glue = through_glue[j]
      total = add_dense([dx[i] for i in direct[j]] + [via_glue])
      if total is None:
        extra.append(None)
        continue
      ctx = run.context(lo, "edge", tensor=t, edge=(lo, upper))
      new = _checks.checked(
          fn, total, ctx,
          f"transform_edge({lo!r}, {upper!r}) on {describe(t)}")
      step.record(ctx, total, new)
      extra.append(new if via_glue is None else dense(new) - via_glue)
      direct_inputs.update(direct[j])
      step.edges_fed.add((lo, upper))
  for i in direct_inputs:
    dx[i] = None
  return extra

