"""The declaration model and GradientPlan's read-only accessors."""

from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.core import _rules
from graphgrad.core._declaration_model import DeclarationKind, Declarations
from graphgrad.core._rules import compile_rules
from helpers import dense, evaluate

T = gg.transforms
tf1 = tf.compat.v1


def _two_layers():
  x = tf.constant(np.random.default_rng(0).normal(size=(4, 3)), tf.float32)
  h = tf.nn.relu(dense(x, 5, "l1"))
  out = dense(h, 2, "l2")
  return tf.reduce_sum(out ** 2), h


def test_declarations_keep_order_and_chain_per_layer():
  d = Declarations(resolve=lambda name, arg: name, owner="GradientPlan")
  d.add_upstream("l2", T.scale(0.5))
  d.add_gradients("l1", T.clip_by_global_norm(1.0))
  d.add_upstream("l2", T.identity())
  d.add_upstream("l1", T.identity())  # identity only: no rewrite at all
  d.add_edge("l1", "l2", T.reverse(0.3))
  K = DeclarationKind
  assert [x.kind for x in d] == [K.UPSTREAM, K.GRADIENTS, K.UPSTREAM,
                                 K.UPSTREAM, K.EDGE]
  assert repr(d.upstream) == "{'l2': chain(scale(0.5), scale(1))}"
  rules = compile_rules(d)
  assert rules.named == ("l2", "l1") and rules.rewrites_backward
  assert not rules.reads_global_step
  d.add_gradients("l1", T.chain(T.scale(2.0), T.add_noise(eta=0.3)))
  assert compile_rules(d).reads_global_step


def test_a_refused_declaration_leaves_nothing_and_frozen_refuses_all():
  d = Declarations(resolve=lambda name, arg: name, owner="GradientPlan")

  def refuse():
    raise gg.GraphGradError("no")
  with pytest.raises(gg.GraphGradError, match="no"):
    d.add_upstream("l1", T.scale(2.0), validate=refuse)
  with pytest.raises(gg.GraphGradError, match=r"transform_edge: .* is a group"):
    d.add_edge("l1", "l2", T.clip_by_global_norm(1.0))
  assert len(d) == 0
  d.freeze()
  with pytest.raises(
      gg.GraphGradError, match=r"this GradientPlan is already built"):
    d.resolve("l1")


class _NoOps:
  """A topology in which an override matches no op of any layer."""

  def layers_of_ops(self, match, key):
    return frozenset([key]) if match == "layer" else frozenset()

  replacement_view = None


def test_overrides_are_declarations_of_their_own_kind():
  d = Declarations(resolve=lambda name, arg: name, owner="KerasPlan")
  half = lambda op, g: 0.5 * g  # noqa: E731
  d.add_override(("type", "Round"), half, "override_gradient")
  d.add_override(("layer", "quant"), half, "straight_through")
  d.add_upstream("l2", T.scale(0.5))
  K = DeclarationKind
  assert [x.kind for x in d] == [K.OVERRIDE, K.OVERRIDE, K.UPSTREAM]
  assert d.overrides == {("type", "Round"): half, ("layer", "quant"): half}
  # Only a layer's override names a layer.
  assert compile_rules(d, _NoOps()).named == ("quant", "l2")
  assert "overrides=['Round', 'quant']" in d.summary()
  with pytest.raises(gg.GraphGradError, match=r"override_gradient: an override "
                                              r"matches an op by one of"):
    d.add_override(("scope", "l1"), half, "override_gradient")
  with pytest.raises(gg.GraphGradError, match=r"override_gradient: 'Round' "
                                              r"already has a backward pass "
                                              r"in this plan.*new KerasPlan"):
    d.add_override(("type", "Round"), half, "override_gradient")
  d.freeze()
  with pytest.raises(gg.GraphGradError, match=r"straight_through: this "
                                              r"KerasPlan is already built"):
    d.add_override(("name", "Round"), half, "straight_through")


@pytest.mark.parametrize("owner", ["GradientPlan", "KerasPlan"])
def test_a_layer_has_an_override_or_a_replacement_not_both(owner):
  d = Declarations(resolve=lambda name, arg: name, owner=owner)
  half = lambda op, g: 0.5 * g  # noqa: E731
  same = lambda ctx: list(ctx.upstream)  # noqa: E731
  d.add_override(("layer", "quant"), half, "straight_through")
  with pytest.raises(gg.GraphGradError,
                     match=r"replace_backward: layer 'quant' already has an "
                           r"override .*a layer has one of the two"):
    d.add_backward("quant", same)
  d.add_backward("fc2", same)
  with pytest.raises(gg.GraphGradError,
                     match=r"straight_through: layer 'fc2' already has the "
                           r"backward replacement .*a layer has one of the "
                           r"two"):
    d.add_override(("layer", "fc2"), half, "straight_through")
  # An op's override inside a replaced layer is no conflict: the
  # replacement's context.vjp takes it.
  d.add_override(("name", "fc2/Round"), half, "override_gradient")
  assert [type(x).__name__ for x in d] == [
      "OverrideDeclaration", "BackwardDeclaration", "OverrideDeclaration"]
  assert d.backward == {"fc2": same} and len(d.overrides) == 2


def test_each_kind_is_a_dataclass_of_its_own():
  d = Declarations(resolve=lambda name, arg: name, owner="GradientPlan")
  d.add_edge("l1", "l2", T.reverse(0.3))
  d.add_tasks("l1", [1.0, 2.0], gg.mtl.pcgrad())
  edge, tasks = d
  assert (edge.layer, edge.upper, edge.kind) == ("l1", "l2",
                                                 DeclarationKind.EDGE)
  assert tasks.losses == (1.0, 2.0) and d.tasks == {"l1": tasks}
  assert not hasattr(edge, "losses") and not hasattr(tasks, "upper")


def test_plan_accessors_and_trace(graph):
  loss, h = _two_layers()
  plan = gg.GradientPlan(loss, name="gg")
  assert plan.loss is loss and plan.name == "gg" and not plan.built
  assert plan.var_list == tuple(tf1.trainable_variables())
  plan.transform_upstream("l2", T.scale(0.5)).transform_gradients(
      "l1", T.scale(3.0))
  assert plan.trace == () and len(plan.declarations) == 2
  plan.compute_gradients()
  assert plan.built
  roles = [(r.context.role, r.context.layer) for r in plan.trace]
  assert roles == [("upstream", "l2"), ("gradients", "l1"), ("gradients", "l1")]
  pairs = evaluate([(r.before, r.after) for r in plan.trace])
  for (before, after), c in zip(pairs, (0.5, 3.0, 3.0)):
    np.testing.assert_allclose(after, c * before, rtol=1e-6)
  with pytest.raises(AttributeError):
    plan.loss = loss  # read-only


def test_linear_factor_and_parts():
  assert T.scale(0.5).linear_factor == 0.5
  assert T.reverse(0.3).linear_factor == -0.3
  assert T.zero().linear_factor == 0 and T.identity().linear_factor == 1
  assert T.chain(T.scale(2.0), T.reverse(0.5)).linear_factor == -1.0
  assert T.chain(T.scale(2.0), T.clip_by_norm(1.0)).linear_factor is None
  assert T.as_transform(lambda g: 2 * g).linear_factor is None
  assert T.scale(tf.constant(2.0)).linear_factor is None
  inner = T.chain(T.scale(2.0), T.clip_by_norm(1.0))
  assert [repr(p) for p in T.chain(inner, T.zero()).parts] == [
      "scale(2.0)", "clip_by_norm(1.0)", "scale(0)"]


def test_the_rules_are_compiled_once_per_state_of_the_declarations(graph):
  plan = gg.GradientPlan(gg.demo.two_layer_loss())
  with mock.patch.object(_rules, "compile_rules",
                         wraps=_rules.compile_rules) as compiled:
    first = plan.rules
    assert plan.rules is first and plan.rules is first
    assert compiled.call_count == 1
    plan.transform_upstream("l2", T.scale(0.5))
    assert plan.rules.rule("l2").factor == 0.5  # the next read sees it
    assert compiled.call_count == 2
    plan.apply_gradients(tf1.train.GradientDescentOptimizer(0.1))
    assert plan.rules.rule("l2").factor == 0.5
    assert compiled.call_count == 2


def test_a_declaration_after_a_read_of_the_rules_is_built(graph):
  loss = gg.demo.two_layer_loss()
  plan = gg.GradientPlan(loss)
  assert not plan.rules.upstream
  plan.transform_upstream("l2", T.scale(0.5))
  gv = plan.compute_gradients()
  variables = [v for _, v in gv]
  # l2's own gradient is the chain rule's; everything below it gets half.
  want = [g * (0.5 if plan.net.layer_of_variable(v) == "l1" else 1.0)
          for g, v in zip(tf.gradients(loss, variables), variables)]
  assert {plan.net.layer_of_variable(v) for v in variables} == {"l1", "l2"}
  got, ref = evaluate([g for g, _ in gv]), evaluate(want)
  for a, b in zip(got, ref):
    np.testing.assert_allclose(a, b, rtol=1e-6)
