"""Core's backward step against hand-computed VJPs of one dense layer.

Each mode of a compiled ``LayerRule`` is applied to ``y = x @ W + V`` with
the upstream gradient ``G``; the VJPs are ``g @ W^T``, ``x^T @ g`` and
``sum(g)``, computed by hand in numpy. The layer's :class:`DenseSite` is all
an executor supplies; the transforms, checks, trace, replacement context and
edges are core's.
"""

import contextlib
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
import helpers
from graphgrad.core._layer_step import BackwardPass, FusedSite
from graphgrad.core._rules import EdgeRule, LayerRule, Mode, TaskRule
from graphgrad.methods._replacement import as_replacement
from graphgrad.transforms._context import Resources

RNG = np.random.default_rng(0)
X = RNG.normal(size=(4, 3)).astype(np.float32)
W = RNG.normal(size=(3, 2)).astype(np.float32)  # the layer's own variable
V = RNG.normal(size=(2,)).astype(np.float32)  # another layer's, read here
G = RNG.normal(size=(4, 2)).astype(np.float32)  # the upstream gradient


class DenseSite:
  """What an executor supplies at ``y = x @ W + V``: a VJP, computed in
  numpy, and the layer's tensors."""

  def __init__(self, deltas=None):
    self.calls = []
    self.outputs = [tf.constant(X @ W + V)]
    self.inputs = [tf.constant(X)]
    self.layer, self.net, self.deltas = "the layer", "the net", deltas

  def vjp(self, grads, inputs, own, other):
    g = np.asarray(grads[0])
    self.calls.append((inputs, own, other))
    return ([tf.constant(g @ W.T)] if inputs else [],
            [X.T @ g] if own else [], [g.sum(0)] if other else [])

  def task_deltas(self, grads):
    return self.deltas

  def methods(self):
    return None

  def recording(self):
    return contextlib.nullcontext()

  paused = recording


def _pass(**kw):
  return BackwardPass(None, Resources(), **kw)


def _assert(got, want):
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)


def test_no_rule_is_one_vjp_of_the_gradient():
  site, step = DenseSite(), _pass()
  out = step.layer_backward(LayerRule("l"), site, [G])
  _assert(out.inputs, [G @ W.T])
  _assert(out.own, [X.T @ G])
  _assert(out.other, [G.sum(0)])
  assert site.calls == [(True, True, True)] and not step.trace


@pytest.mark.parametrize("factor", [0.5, -2.0])
def test_a_linear_rule_weighs_one_vjp_as_two_would_give(factor):
  fn = gg.transforms.scale(factor)
  site, step = DenseSite(), _pass()
  fused = step.layer_backward(LayerRule("l", Mode.LINEAR, fn, factor), site,
                              [G])
  assert site.calls == [(True, True, True)]
  general = _pass().layer_backward(LayerRule("l", Mode.TRANSFORMED, fn),
                                   DenseSite(), [G])
  for out in (fused, general):
    _assert(out.own, [X.T @ G])  # the own variable sees the plain gradient
    _assert(out.inputs, [factor * G @ W.T])
    _assert(out.other, [factor * G.sum(0)])
  # The linear step records g; its `after` is the transform, built on read.
  (record,) = step.trace
  assert record.context.role == "upstream" and record.context.layer == "l"
  _assert([record.before, record.after], [G, factor * G])


def test_a_zero_factor_sends_nothing_below():
  site = DenseSite()
  rule = LayerRule("l", Mode.LINEAR, gg.transforms.zero(), 0.0)
  out = _pass().layer_backward(rule, site, [G])
  assert out.inputs is None and out.other == []
  _assert(out.own, [X.T @ G])
  assert site.calls == [(False, True, False)]


def test_tasks_then_own_variables_then_upstream_then_replacement():
  def replace(ctx):
    _assert(ctx.upstream, [((G + 1.0) * 0.5)])
    _assert(ctx.chain_rule(), [(G + 1.0) * 0.5 @ W.T])
    _assert(ctx.upstream_of("l"), [G + 1.0])
    assert ctx.layer == "the layer" and ctx.net == "the net"
    return [-ctx.upstream[0] @ W.T]

  rule = LayerRule("l", Mode.REPLACED, gg.transforms.scale(0.5),
                   replacement=as_replacement(replace),
                   tasks=TaskRule(("l",), None, gg.mtl.pcgrad()))
  step = _pass()
  out = step.layer_backward(rule, DenseSite(deltas=[np.ones_like(G)]), [G])
  _assert(out.upstream, [G + 1.0])
  _assert(out.own, [X.T @ (G + 1.0)])
  _assert(out.inputs, [-((G + 1.0) * 0.5) @ W.T])
  _assert(out.other, [((G + 1.0) * 0.5).sum(0)])
  (record,) = step.trace  # the upstream transform, applied once
  _assert([record.before, record.after], [G + 1.0, (G + 1.0) * 0.5])


def test_an_override_answers_for_the_inputs():
  def fn(call, g):
    assert call.name == "l" and call.type == "str" and len(call.inputs) == 1
    return [tf.ones_like(call.inputs[0])]

  rule = LayerRule("l", Mode.OVERRIDDEN, override=fn)
  out = _pass().layer_backward(rule, DenseSite(), [G])
  _assert(out.inputs, [np.ones_like(X)])
  _assert(out.own, [X.T @ G])
  _assert(out.other, [G.sum(0)])


def test_a_plain_pass_records_nothing():
  step = _pass(plain=True)
  rule = LayerRule("l", Mode.TRANSFORMED, gg.transforms.clip_by_norm(1.0))
  step.layer_backward(rule, DenseSite(), [G])
  assert not step.trace and not step.done


@pytest.mark.parametrize("fn, want", [
    (gg.transforms.scale(-0.5), -0.5 * G),
    (gg.transforms.clip_by_value(-0.1, 0.1), np.clip(G, -0.1, 0.1)),
])
def test_an_edge_is_transformed_checked_and_traced(fn, want):
  step = _pass()
  rule = EdgeRule("lo", "up", fn, fn.linear_factor)
  t = tf.constant(np.zeros_like(G))
  _assert([step.edge_backward(rule, t, tf.constant(G))], [want])
  (record,) = step.trace
  assert record.context.role == "edge" and record.context.edge == ("lo", "up")
  _assert([record.after], [want])
  assert step.edge_backward(None, t, G) is G


def test_a_zero_edge_sends_nothing():
  rule = EdgeRule("lo", "up", gg.transforms.zero(), 0.0)
  assert _pass().edge_backward(rule, tf.constant(G), tf.constant(G)) is None


def test_under_a_loss_scale_a_transform_sees_the_unscaled_gradient():
  # The pass carries the scale S: a non-linear transform sees g / S and
  # its result is scaled back; a linear one runs on S * g as it is.
  step, s = _pass(scale=tf.constant(4.0)), 4.0
  clip = gg.transforms.clip_by_value(-0.1, 0.1)
  rule = LayerRule("l", Mode.TRANSFORMED, clip)
  out = step.layer_backward(rule, DenseSite(), [tf.constant(s * G)])
  _assert(out.inputs, [s * np.clip(G, -0.1, 0.1) @ W.T])
  _assert(out.own, [X.T @ (s * G)])
  (record,) = step.trace
  assert float(record.scale) == s


def test_a_fused_layer_takes_the_step_and_its_call_once():
  # A fused VJP (one call over several layers) weights inside the call:
  # the step records g and makes the call, weighting nothing again.
  calls = []
  step = _pass()
  rule = LayerRule("l", Mode.LINEAR, gg.transforms.scale(0.5), 0.5)
  out = step.layer_backward(rule, FusedSite([tf.constant(G)], calls.append),
                            [tf.constant(G)])
  assert len(calls) == 1 and (out.inputs, out.own, out.other) == ([], [], [])
  (record,) = step.trace
  _assert([record.before, record.after], [G, 0.5 * G])
  assert step.done["l"][0] is not None


def _rules_stepped(build):
  """The layers whose rule took core's step while ``build()`` ran."""
  seen = []
  original = BackwardPass.layer_backward

  def spy(self, rule, site, grads):
    seen.append((rule.layer, type(site).__name__))
    return original(self, rule, site, grads)

  with mock.patch.object(BackwardPass, "layer_backward", spy):
    build()
  return seen


def test_every_rule_takes_the_step_on_both_plans_fused_or_cut():
  # scale(0.5) on l2 and l3 (a TF1 span, Keras layers on scaled inputs),
  # clip on l4 (cut): each declared layer takes core's step once.
  def tf1_plan():
    with tf.Graph().as_default():
      h = tf.constant(X)
      for i in range(1, 5):
        h = helpers.dense(h, 3, f"l{i}", activation=tf.nn.relu)
      plan = gg.GradientPlan(tf.reduce_sum(h))
      for name in ("l2", "l3"):
        plan.transform_upstream(name, gg.transforms.scale(0.5))
      plan.transform_upstream("l4", gg.transforms.clip_by_norm(1.0))
      plan.compute_gradients()

  def keras_plan():
    model = keras.Sequential([keras.Input((3,))] + [
        keras.layers.Dense(3, activation="relu", name=f"l{i}")
        for i in range(1, 5)])
    plan = gg.KerasPlan(model)
    for name in ("l2", "l3"):
      plan.transform_upstream(name, gg.transforms.scale(0.5))
    plan.transform_upstream("l4", gg.transforms.clip_by_norm(1.0))
    with plan.tape() as tape:
      loss = tf.reduce_sum(model(X))
    tape.gradient(loss)

  for build in (tf1_plan, keras_plan):
    seen = _rules_stepped(build)
    assert sorted(layer for layer, _ in seen) == ["l2", "l3", "l4"], seen
    kinds = dict(seen)
    assert kinds["l2"] == kinds["l3"] == "FusedSite", seen
    assert kinds["l4"] != "FusedSite", seen
