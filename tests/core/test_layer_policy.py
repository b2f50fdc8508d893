"""The per-layer policy against hand-computed VJPs of one dense layer."""

import numpy as np
import pytest
import tensorflow as tf

from graphgrad.core._gradients import weigh
from graphgrad.core._layer_policy import LayerRules, layer_backward

RNG = np.random.default_rng(0)
X = RNG.normal(size=(4, 3)).astype(np.float32)
W = RNG.normal(size=(3, 2)).astype(np.float32)  # the layer's own variable
V = RNG.normal(size=(2,)).astype(np.float32)  # another layer's, read here
G = RNG.normal(size=(4, 2)).astype(np.float32)  # the upstream gradient


class DenseVJP:
  """y = x @ W + V: the VJPs are g @ W^T, x^T @ g and sum(g)."""

  def __init__(self):
    self.calls = []

  def __call__(self, grads, inputs, own, other):
    g, = grads
    self.calls.append((inputs, own, other))
    return ([g @ W.T] if inputs else [], [X.T @ g] if own else [],
            [g.sum(0)] if other else [])

  def weigh(self, grad, factor):
    return weigh(tf.constant(grad), factor).numpy()


def _assert(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)


def test_no_rule_is_one_vjp_of_the_gradient():
  vjp = DenseVJP()
  out = layer_backward(LayerRules(), [G], vjp)
  _assert(out.inputs, [G @ W.T])
  _assert(out.own, [X.T @ G])
  _assert(out.other, [G.sum(0)])
  assert vjp.calls == [(True, True, True)]


@pytest.mark.parametrize("factor", [0.5, -2.0])
def test_a_linear_rewrite_weighs_one_vjp_as_two_would_give(factor):
  seen = []
  rules = LayerRules(upstream=lambda g: [factor * g[0]], factor=factor,
                     observe=seen.append)
  vjp = DenseVJP()
  fused = layer_backward(rules, [G], vjp)
  assert vjp.calls == [(True, True, True)] and len(seen) == 1
  general = layer_backward(LayerRules(upstream=rules.upstream), [G],
                           DenseVJP())
  for out in (fused, general):
    _assert(out.own, [X.T @ G])  # the own variable sees the plain gradient
    _assert(out.inputs, [factor * G @ W.T])
    _assert(out.other, [factor * G.sum(0)])


def test_a_zero_factor_sends_nothing_below():
  vjp = DenseVJP()
  out = layer_backward(LayerRules(upstream=lambda g: [0 * g[0]], factor=0),
                       [G], vjp)
  assert out.inputs is None and out.other == []
  _assert(out.own, [X.T @ G])
  assert vjp.calls == [(False, True, False)]


def test_tasks_then_own_variables_then_upstream_then_replacement():
  def tasks(g):
    return [g[0] + 1.0]

  def upstream(g):
    return [g[0] ** 2]

  def replace(g, chain_rule):
    _assert(g, [(G + 1.0) ** 2])
    _assert(chain_rule(), [(G + 1.0) ** 2 @ W.T])
    return [-g[0] @ W.T]

  out = layer_backward(LayerRules(tasks=tasks, upstream=upstream,
                                  factor=0.5, replace=replace), [G],
                       DenseVJP())
  _assert(out.upstream, [G + 1.0])
  _assert(out.own, [X.T @ (G + 1.0)])
  _assert(out.inputs, [-((G + 1.0) ** 2) @ W.T])
  _assert(out.other, [((G + 1.0) ** 2).sum(0)])


def test_an_override_answers_for_the_inputs():
  out = layer_backward(LayerRules(override=lambda g: [np.ones_like(X)]),
                       [G], DenseVJP())
  _assert(out.inputs, [np.ones_like(X)])
  _assert(out.own, [X.T @ G])
  _assert(out.other, [G.sum(0)])
