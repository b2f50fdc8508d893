"""compile_rules: declarations in, one typed PlanRules out, for both plans."""

import pytest
import tensorflow as tf

import graphgrad as gg
from graphgrad.core._declaration_model import (
  Declarations,
  LossScaleDeclaration,
)
from graphgrad.core._gradients import straight_through
from graphgrad.core._privacy import Privacy
from graphgrad.core._rules import CompiledRules, Mode, compile_rules

T = gg.transforms


class _Topology:
  """A layer graph of three layers l1 -> l2 -> l3; op ``"l2/Relu"`` and
  every ``"Relu"`` lie in l2, every ``"Tanh"`` in l1 and l3."""

  def __init__(self):
    self.reads = 0

  def layers_of_ops(self, match, key):
    self.reads += 1
    if match == "layer":
      return frozenset([key])
    if key in ("l2/Relu", "Relu"):
      return frozenset(["l2"])
    return frozenset(["l1", "l3"]) if key == "Tanh" else frozenset()

  @property
  def replacement_view(self):
    self.reads += 1
    return self


class _Refuses:
  """A topology that must not be read."""

  def layers_of_ops(self, match, key):
    raise AssertionError("read")

  @property
  def replacement_view(self):
    raise AssertionError("read")


def _declared():
  return Declarations(resolve=lambda name, arg: name, owner="GradientPlan")


def test_each_layer_gets_one_mode():
  d = _declared()
  d.add_upstream("l1", T.scale(0.5))
  d.add_upstream("l2", T.clip_by_norm(1.0))
  d.add_upstream("l3", T.scale(2.0))
  d.add_backward("l3", gg.backward.feedback_alignment(seed=0))
  d.add_override(("layer", "l4"), straight_through, "straight_through")
  rules = compile_rules(d, _Topology())
  assert rules.rule("l1").mode is Mode.LINEAR
  assert rules.rule("l1").factor == 0.5
  assert rules.rule("l2").mode is Mode.TRANSFORMED
  assert rules.rule("l2").factor is None
  # A replacement sees the rewritten gradient itself: never a factor.
  assert rules.rule("l3").mode is Mode.REPLACED
  assert rules.rule("l3").factor is None
  assert rules.rule("l3").upstream.linear_factor == 2.0
  assert rules.rule("l4").mode is Mode.OVERRIDDEN
  assert rules.rule("l4").override is straight_through
  assert rules.rule("l0").mode is Mode.PLAIN
  assert "l0" not in rules.layers
  assert rules.rewrites_backward


def test_upstream_transforms_compose_once_in_declaration_order():
  d = _declared()
  d.add_upstream("l2", T.scale(0.5))
  d.add_upstream("l2", T.scale(0.5))
  d.add_upstream("l3", T.scale(1.0))
  rules = compile_rules(d, _Refuses())
  assert rules.rule("l2").factor == 0.25
  g = tf.constant([4.0])
  ctx = gg.transforms.TransformContext(layer="l2", role="upstream")
  assert float(rules.rule("l2").upstream(g, ctx)[0]) == 1.0
  # scale(1.0) is the identity: no rewrite at all.
  assert rules.rule("l3").mode is Mode.PLAIN
  assert rules.upstream == {"l2": rules.rule("l2").upstream}


def test_the_topology_is_read_only_for_overrides_and_replacements():
  d = _declared()
  d.add_upstream("l2", T.scale(0.5))
  d.add_gradients("l1", T.clip_by_norm(1.0))
  d.add_edge("l1", "l2", T.reverse(1.0))
  compile_rules(d, _Refuses())
  topology = _Topology()
  d.add_override(("type", "Tanh"), straight_through, "straight_through")
  compile_rules(d, lambda: topology)
  assert topology.reads == 1


def test_a_nonlinear_op_override_inside_a_layer_removes_its_factor():
  def squared(op, dy):
    return [dy * tf.abs(dy)]

  for fn, mode in ((straight_through, Mode.LINEAR),
                   (squared, Mode.TRANSFORMED)):
    d = _declared()
    d.add_upstream("l2", T.scale(0.5))
    d.add_upstream("l3", T.scale(0.5))
    d.add_override(("name", "l2/Relu"), fn, "override_gradient")
    rules = compile_rules(d, _Topology())
    assert rules.rule("l2").mode is mode
    assert rules.rule("l3").mode is Mode.LINEAR
    (op,) = rules.ops
    assert (op.match, op.key, op.layers) == ("name", "l2/Relu",
                                             frozenset(["l2"]))
    assert op.linear is (fn is straight_through)


def test_edges_parameters_and_tasks():
  d = _declared()
  d.add_edge("l1", "l3", T.reverse(0.5))
  d.add_edge("l1", "l3", T.scale(2.0))
  d.add_gradients(["l1", "l2"], T.clip_by_global_norm(1.0))
  d.add_gradients("l2", T.scale(0.5))
  d.add_gradients("l1", T.clip_by_norm(1.0))
  d.add_gradients("l2", T.clip_by_norm(2.0))
  pc = gg.mtl.pcgrad()
  d.add_tasks("l2", None, pc)
  d.add_parameter_tasks(["l1"], None, gg.mtl.mean())
  rules = compile_rules(d, _Refuses())
  (edge,) = rules.edges.values()
  assert (edge.lower, edge.upper, edge.factor) == ("l1", "l3", -1.0)
  assert rules.rule("l3").edge_upper and rules.rule("l3").cut
  assert rules.rule("l3").mode is Mode.PLAIN
  # Each layer's own transforms in declaration order, layer by layer, then
  # the group transforms.
  assert [(r.layers, repr(r.transform), r.group) for r in rules.parameters] \
      == [(("l2",), "scale(0.5)", False),
          (("l2",), "clip_by_norm(2.0)", False),
          (("l1",), "clip_by_norm(1.0)", False),
          (("l1", "l2"), "clip_by_global_norm(1.0)", True)]
  task = rules.rule("l2").tasks
  assert (task.layer, task.method, task.at) == ("l2", pc, "output")
  assert rules.rule("l2").special and rules.rule("l2").cut
  assert rules.parameter_tasks.at == "parameters"
  assert rules.parameter_tasks.layers == ("l1",)
  assert rules.has_tasks
  assert rules.named == ("l1", "l3", "l2")


def test_a_replacement_reads_the_layers_it_cuts():
  d = _declared()
  d.add_backward("l1", gg.backward.direct_feedback_alignment(
      seed=0, error_layer="l3"))
  d.add_backward("l2", lambda context: list(context.upstream))

  class _Top(_Topology):
    def find(self, layer, arg):
      return layer

  rules = compile_rules(d, _Top())
  assert [n for n, r in rules.layers.items() if r.read] == ["l3"]
  assert rules.rule("l3").read and rules.rule("l3").mode is Mode.PLAIN
  assert rules.rule("l3").special
  assert set(rules.replacements) == {"l1", "l2"}


def test_the_global_step_is_read_through_the_transforms():
  d = _declared()
  d.add_upstream("l2", T.scale(0.5))
  assert not compile_rules(d).reads_global_step
  d.add_upstream("l1", T.add_noise(seed=1, eta=0.01))
  assert compile_rules(d).reads_global_step


@pytest.mark.parametrize("declare,kind", [
    (lambda d: d.add_upstream("l2", T.clip_by_norm(1.0)), "upstream"),
    (lambda d: d.add_edge("l1", "l2", T.scale(0.5)), "edge"),
    (lambda d: d.add_tasks("l2", None, gg.mtl.pcgrad()), "tasks"),
    (lambda d: d.add_parameter_tasks(None, None, gg.mtl.pcgrad()),
     "parameter_tasks"),
    (lambda d: d.add_backward("l2", gg.backward.feedback_alignment()),
     "backward"),
    (lambda d: d.add_override(("type", "Relu"), straight_through, "st"),
     "override"),
])
def test_privatize_refuses_what_acts_before_the_clip(declare, kind):
  d = _declared()
  d.add_privatize(Privacy(1.0, 1.0), "privatize")
  declare(d)
  with pytest.raises(gg.GraphGradError,
                     match=rf"privatize cannot be combined with {kind} "):
    compile_rules(d, _Topology())


def test_privatize_keeps_parameter_transforms_and_a_loss_scale():
  d = _declared()
  d.add_privatize(Privacy(1.0, 0.5, seed=3), "privatize")
  d.add_gradients("l1", T.scale(0.5))
  rules = compile_rules(d)
  assert rules.privacy.declared == Privacy(1.0, 0.5, seed=3)
  assert rules.privacy.noise.privacy == Privacy(1.0, 0.5, seed=3)
  assert rules.privacy.after_aggregation is None
  assert [r.transform for r in rules.parameters] == [
      d.gradients["l1"][0]]
  scaled = compile_rules(list(d) + [LossScaleDeclaration("", 128.0)])
  assert scaled.privacy.declared == rules.privacy.declared
  assert scaled.loss_scale.scale == 128.0


def test_privatize_after_aggregation_noises_the_aggregate_not_the_workers():
  d = _declared()
  d.add_privatize(Privacy(1.0, 0.5, seed=3, expected_batch_size=8.0),
                  "privatize")
  d.add_after_aggregation()
  rule = compile_rules(d).privacy
  assert rule.declared == Privacy(1.0, 0.5, seed=3, expected_batch_size=8.0)
  # Each worker: its clipped sum, neither noised nor divided.
  assert rule.noise.privacy == Privacy(1.0, 0.0, seed=3,
                                       expected_batch_size=1.0)
  assert rule.after_aggregation.privacy == rule.declared
  assert rule.after_aggregation.key == 3


def test_compiling_a_private_plan_makes_no_variable():
  d = _declared()
  d.add_privatize(Privacy(1.0, 0.5), "privatize")
  with tf.Graph().as_default() as g:
    rules = compile_rules(d)
    assert not g.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
  # Without a seed the key is drawn once, when compiling.
  assert 0 <= rules.privacy.noise.key < 2 ** 62


def test_one_loss_scale_policy():
  ok = _declared()
  ok.add_tasks("l2", None, gg.mtl.pcgrad())
  ok.add_parameter_tasks(None, None, gg.mtl.sum())
  ok.add_backward("l1", gg.backward.feedback_alignment(seed=0))
  ok.add_upstream("l3", T.clip_by_norm(1.0))
  rules = compile_rules(list(ok) + [LossScaleDeclaration("", 128.0)],
                        _Topology())
  assert rules.loss_scale.scale == 128.0
  for declare, named in (
      (lambda d: d.add_tasks("l2", None, gg.mtl.nash_mtl()),
       r"combine_tasks\('l2', nash_mtl"),
      (lambda d: d.add_parameter_tasks(None, None, gg.mtl.nash_mtl()),
       r"combine_tasks\(at='parameters', nash_mtl"),
      (lambda d: d.add_backward("l1", gg.backward.synthetic()),
       r"replace_backward\('l1', synthetic"),
      (lambda d: d.add_backward("l1", lambda context: context.upstream),
       r"replace_backward\('l1', <function"),
  ):
    d = _declared()
    declare(d)
    compile_rules(d, _Topology())  # without a loss scale: accepted
    with pytest.raises(gg.GraphGradError,
                       match=rf"loss_scale: .*{named}.*\(not homogeneous\)"):
      compile_rules(list(d) + [LossScaleDeclaration("", 128.0)], _Topology())


def test_recompute_is_a_declaration():
  d = _declared()
  d.add_recompute(["l1", "l3"], "recompute")
  assert compile_rules(d).recompute.keep == ("l1", "l3")
  with pytest.raises(gg.GraphGradError, match="already recomputes"):
    d.add_recompute(None, "recompute")
  with pytest.raises(gg.GraphGradError,
                     match=r"`keep` must be a list of layers .* got str"):
    _declared().add_recompute("l1", "recompute")
  assert compile_rules(_declared()).recompute is None


def test_an_override_without_a_topology_is_refused_by_name():
  d = _declared()
  d.add_override(("type", "Relu"), straight_through, "straight_through")
  with pytest.raises(gg.GraphGradError,
                     match=r"needs its layers \(an override or a backward "
                           r"replacement is declared\), but no topology"):
    compile_rules(d)


def test_compiled_rules_compile_again_only_after_a_change():
  d = _declared()
  compiled = CompiledRules(d)
  first = compiled.rules()
  assert compiled.rules() is first and not first.upstream
  scale = 128.0
  scaled = compiled.rules(scale)
  assert compiled.rules(scale) is scaled and scaled.loss_scale.scale is scale
  assert compiled.rules() is first and first.loss_scale is None
  version = d.version
  d.add_gradients("l2", T.scale(0.5))
  d.add_privatize(Privacy(1.0, 0.0), "privatize")
  d.add_loss_scale(64.0)
  d.add_after_aggregation()
  assert d.version == version + 4
  again = compiled.rules()
  assert again is not first and len(again.parameters) == 1
  assert again.privacy.after_aggregation is not None
  assert again.loss_scale.scale == 64.0
  assert compiled.rules(scale) is not scaled
