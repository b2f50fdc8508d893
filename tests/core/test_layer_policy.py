"""The per-layer policy against hand-computed VJPs of one dense layer.

Each mode of a compiled ``LayerRule`` is applied to ``y = x @ W + V`` with
the upstream gradient ``G``; the VJPs are ``g @ W^T``, ``x^T @ g`` and
``sum(g)``, computed by hand in numpy.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.core._gradients import weigh
from graphgrad.core._layer_policy import layer_backward
from graphgrad.core._rules import LayerRule, Mode, TaskRule

RNG = np.random.default_rng(0)
X = RNG.normal(size=(4, 3)).astype(np.float32)
W = RNG.normal(size=(3, 2)).astype(np.float32)  # the layer's own variable
V = RNG.normal(size=(2,)).astype(np.float32)  # another layer's, read here
G = RNG.normal(size=(4, 2)).astype(np.float32)  # the upstream gradient


class DenseSteps:
  """The executor's steps at ``y = x @ W + V``, with the rule's callables
  given by the test."""

  def __init__(self, tasks=None, upstream=None, replace=None, override=None):
    self.calls, self.seen = [], []
    self._tasks, self._upstream = tasks, upstream
    self._replace, self._override = replace, override

  def vjp(self, grads, inputs, own, other):
    g, = grads
    self.calls.append((inputs, own, other))
    return ([g @ W.T] if inputs else [], [X.T @ g] if own else [],
            [g.sum(0)] if other else [])

  def weigh(self, grad, factor):
    return weigh(tf.constant(grad), factor).numpy()

  def arrived(self, grads):
    return self._tasks(grads) if self._tasks is not None else grads

  def transform(self, grads):
    return self._upstream(grads)

  def observe(self, grads):
    self.seen.append(grads)

  def replace(self, grads, chain_rule):
    return self._replace(grads, chain_rule)

  def override(self, grads):
    return self._override(grads)


def _assert(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)


def test_no_rule_is_one_vjp_of_the_gradient():
  steps = DenseSteps()
  out = layer_backward(LayerRule("l"), [G], steps)
  _assert(out.inputs, [G @ W.T])
  _assert(out.own, [X.T @ G])
  _assert(out.other, [G.sum(0)])
  assert steps.calls == [(True, True, True)]


@pytest.mark.parametrize("factor", [0.5, -2.0])
def test_a_linear_rule_weighs_one_vjp_as_two_would_give(factor):
  fn = gg.transforms.scale(factor)
  upstream = lambda g: [factor * g[0]]  # noqa: E731
  steps = DenseSteps(upstream=upstream)
  fused = layer_backward(LayerRule("l", Mode.LINEAR, fn, factor), [G], steps)
  assert steps.calls == [(True, True, True)] and len(steps.seen) == 1
  general = layer_backward(LayerRule("l", Mode.TRANSFORMED, fn), [G],
                           DenseSteps(upstream=upstream))
  for out in (fused, general):
    _assert(out.own, [X.T @ G])  # the own variable sees the plain gradient
    _assert(out.inputs, [factor * G @ W.T])
    _assert(out.other, [factor * G.sum(0)])


def test_a_zero_factor_sends_nothing_below():
  steps = DenseSteps()
  rule = LayerRule("l", Mode.LINEAR, gg.transforms.zero(), 0.0)
  out = layer_backward(rule, [G], steps)
  assert out.inputs is None and out.other == []
  _assert(out.own, [X.T @ G])
  assert steps.calls == [(False, True, False)]


def test_tasks_then_own_variables_then_upstream_then_replacement():
  def replace(g, chain_rule):
    _assert(g, [(G + 1.0) ** 2])
    _assert(chain_rule(), [(G + 1.0) ** 2 @ W.T])
    return [-g[0] @ W.T]

  rule = LayerRule("l", Mode.REPLACED, gg.transforms.scale(0.5),
                   replacement=object(),
                   tasks=TaskRule(("l",), None, gg.mtl.pcgrad()))
  steps = DenseSteps(tasks=lambda g: [g[0] + 1.0],
                     upstream=lambda g: [g[0] ** 2], replace=replace)
  out = layer_backward(rule, [G], steps)
  _assert(out.upstream, [G + 1.0])
  _assert(out.own, [X.T @ (G + 1.0)])
  _assert(out.inputs, [-((G + 1.0) ** 2) @ W.T])
  _assert(out.other, [((G + 1.0) ** 2).sum(0)])
  assert not steps.seen  # a replaced layer's factor is never used


def test_an_override_answers_for_the_inputs():
  rule = LayerRule("l", Mode.OVERRIDDEN, override=lambda op, *g: g)
  out = layer_backward(rule, [G], DenseSteps(
      override=lambda g: [np.ones_like(X)]))
  _assert(out.inputs, [np.ones_like(X)])
  _assert(out.own, [X.T @ G])
  _assert(out.other, [G.sum(0)])
