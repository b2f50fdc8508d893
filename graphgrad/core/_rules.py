"""The compiled form of a plan: typed rules that both executors read.

:func:`compile_rules` is the one reader of a plan's declarations. It checks
what can be checked once for both executors (the privacy and loss-scale
policies), composes each layer's upstream transforms once, decides each
layer's :class:`Mode` (the one place it is decided) and returns one
:class:`PlanRules`, which the TF1 segment engine and the Keras tape read.
``PLAIN``: the chain rule below the layer; ``LINEAR``: an upstream transform
``c * g``, one VJP weighted by ``c``; ``TRANSFORMED``: any other ``fn``, the
own variables see ``g`` and the inputs a VJP of ``fn(g)``; ``REPLACED`` and
``OVERRIDDEN``: ``replace_backward`` or the override of a Keras layer's call
computes what the inputs get, from ``fn(g)`` where an upstream transform is
declared too. A layer's ``transform_inputs`` is not a mode: in every mode it
rewrites what the inputs get, last.
"""

import dataclasses
import enum
import functools
from typing import (
  Any,
  Callable,
  Dict,
  FrozenSet,
  Iterable,
  List,
  Mapping,
  Optional,
  Protocol,
  Tuple,
)

from graphgrad import _errors
from graphgrad.core._declaration_model import (
  BackwardDeclaration,
  Declaration,
  Declarations,
  EdgeDeclaration,
  GradientsDeclaration,
  InputsDeclaration,
  LossScaleDeclaration,
  OverrideDeclaration,
  ParameterTasksDeclaration,
  PrivatizeDeclaration,
  TasksDeclaration,
  UpstreamDeclaration,
)
from graphgrad.core._gradients import straight_through
from graphgrad.core._privacy import Noise, Privacy, refuse_declarations
from graphgrad.methods._replacement import Replacement, as_replacement
from graphgrad.transforms._group import GroupTransform
from graphgrad.transforms._transforms import Transform

__all__ = ["CompiledRules", "EdgeRule", "LayerRule", "LossScaleRule", "Mode",
           "OpRule",
           "ParameterRule", "PlanRules", "PrivacyRule", "RecomputeRule",
           "TaskRule", "Topology", "compile_rules"]


class Topology(Protocol):
  """What compiling reads of a plan's layers; ``LayerGraph`` (a ``tf.Graph``)
  and the Keras layer index implement it."""

  def layers_of_ops(self, match: str, key: str) -> FrozenSet[str]:
    """The layers holding the ops an override matches (``match`` one of
    ``"name"``, ``"type"``, ``"layer"``)."""

  @property
  def replacement_view(self) -> Any:
    """The layers as a backward replacement's ``check``/``cuts`` see them
    (``context.net``)."""


class Mode(enum.Enum):
  """How a layer's backward pass treats the gradient it passes below."""
  PLAIN = "plain"
  LINEAR = "linear"
  TRANSFORMED = "transformed"
  REPLACED = "replaced"
  OVERRIDDEN = "overridden"


@dataclasses.dataclass(frozen=True)
class TaskRule:
  """A task combination.

  Attributes:
    layers: at a layer's outputs, that one layer; in parameter space, the
      layers whose variables are combined, or ``None`` for every variable.
    losses: the task losses, or ``None`` where the executor gets them per
      step (``KerasPlan``'s ``tape.gradient(task_losses=...)``).
    method: the task-combination method.
    at: ``"output"`` or ``"parameters"``.
  """
  layers: Optional[Tuple[str, ...]]
  losses: Optional[Tuple[Any, ...]]
  method: Any
  at: str = "output"

  @property
  def layer(self) -> str:
    """The layer of an output-level combination."""
    return self.layers[0] if self.layers else ""


@dataclasses.dataclass(frozen=True)
class LayerRule:
  """One layer's compiled backward rule.

  Attributes:
    layer: the layer's name (its path in a Keras model).
    mode: see :class:`Mode`.
    upstream: the layer's upstream transforms composed once, in
      declaration order, or ``None`` (identities are dropped).
    factor: ``c`` when ``mode`` is ``LINEAR``.
    replacement: the backward replacement (mode ``REPLACED``); a plain
      callable is wrapped in a ``FunctionReplacement``.
    override: the override of the layer's call (mode ``OVERRIDDEN``).
    tasks: the task combination at the layer's outputs, acting before
      everything else.
    inputs: the layer's input transforms composed once, in declaration
      order, or ``None``: applied to each input's gradient, after
      everything else.
    edge_upper: the upper end of a transformed edge: its inputs' gradient
      is handed to the edge's lower layers.
    read: a backward replacement reads the gradient at its outputs.
  """
  layer: str
  mode: Mode = Mode.PLAIN
  upstream: Optional[Transform] = None
  factor: Optional[float] = None
  replacement: Optional[Replacement] = None
  override: Optional[Callable] = None
  tasks: Optional[TaskRule] = None
  inputs: Optional[Transform] = None
  edge_upper: bool = False
  read: bool = False

  @property
  def instead(self) -> bool:
    """Something other than the chain rule computes the inputs' gradient."""
    return self.mode in (Mode.REPLACED, Mode.OVERRIDDEN)

  @property
  def rewrites(self) -> bool:
    """The gradient the layer passes below is not the chain rule's."""
    return self.mode is not Mode.PLAIN or self.inputs is not None

  @property
  def cut(self) -> bool:
    """The executor must stop at the layer's outputs: it rewrites, combines
    tasks, is the upper end of an edge, or its outputs' gradient is read."""
    return (self.rewrites or self.tasks is not None or self.edge_upper
            or self.read)

  @property
  def special(self) -> bool:
    """More than an upstream transform: a task combination, the upper end
    of an edge, a replacement, an override, an input transform (the
    executor must hand the step the layer's own inputs), or outputs a
    replacement reads."""
    return (self.instead or self.tasks is not None or self.edge_upper
            or self.read or self.inputs is not None)


@dataclasses.dataclass(frozen=True)
class EdgeRule:
  """``transform_edge(lower, upper, fn)``, composed.

  Attributes:
    lower: the layer whose output receives the edge's gradient.
    upper: the consumer layer.
    transform: the edge's transforms composed in declaration order.
    factor: ``c`` when ``transform`` is ``c * g``, else ``None``.
  """
  lower: str
  upper: str
  transform: Transform
  factor: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class OpRule:
  """An op's gradient function inside the plan (``override_gradient``,
  ``straight_through``) on a ``tf.Graph``.

  Attributes:
    match: ``"name"`` or ``"type"``.
    key: the op's name or type.
    fn: the gradient function.
    linear: ``fn`` is linear in the gradient (``straight_through``): a
      linear factor may be moved past it.
    layers: the layers holding the matched ops.
  """
  match: str
  key: str
  fn: Callable
  linear: bool
  layers: FrozenSet[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class ParameterRule:
  """A parameter-gradient transform.

  Attributes:
    layers: the layer (one name), or the layers a group transform sees at
      once.
    transform: the transform or group transform.
    group: declared over a list of layers (applied after every layer's own).
  """
  layers: Tuple[str, ...]
  transform: Any
  group: bool = False


@dataclasses.dataclass(frozen=True)
class RecomputeRule:
  """``plan.recompute(keep)``: the layers whose outputs are kept, or
  ``None`` for the executor's choice, and the names of the tensors kept
  besides."""
  keep: Optional[Tuple[str, ...]] = None
  tensors: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LossScaleRule:
  """The loss scale a plan trains with.

  Attributes:
    scale: what gives the scale ``S`` (a TF1 ``LossScale``, a Keras
      optimizer, a number); each executor reads it its own way.
  """
  scale: Any


@dataclasses.dataclass(frozen=True)
class PrivacyRule:
  """``privatize``, compiled: the declaration and the noise the plan adds.

  Each :class:`~graphgrad.core._privacy.Noise` is made here, once per
  compiled plan (its key drawn once); the step counter it draws with is the
  executor's (``NoiseCounter``).

  Attributes:
    declared: what ``privatize`` declared.
    noise: what the executor's backward pass adds and divides by: the
      declared noise, or, with ``after_aggregation``, that of each worker's
      clipped sum (no noise, divided by 1).
    after_aggregation: the noise added once the workers' clipped sums are
      aggregated (a ``SyncReplicasOptimizer``'s chief), or ``None``.
  """
  declared: Privacy
  noise: Noise
  after_aggregation: Optional[Noise] = None


@dataclasses.dataclass(frozen=True)
class PlanRules:
  """A plan, compiled: everything an executor reads of it.

  Attributes:
    layers: layer name -> its rule, for every layer a declaration names or
      a replacement reads; :meth:`rule` gives ``PLAIN`` for the rest.
    edges: ``(lower, upper)`` -> the edge's rule.
    ops: the op overrides of a ``tf.Graph`` plan.
    parameters: the parameter transforms, in the order they act: each
      layer's own in declaration order, layer by layer, then the group
      transforms in declaration order.
    parameter_tasks: the task combination in parameter space, or ``None``.
    recompute: the recompute rule, or ``None``.
    privacy: ``privatize`` compiled, or ``None``.
    loss_scale: the loss scale, or ``None``.
    reads_global_step: a transform reads the global step (the executor then
      advances it).
    named: every layer a declaration names, then those a replacement
      reads, in first-named order: the layers that must run.
  """
  layers: Mapping[str, LayerRule] = dataclasses.field(default_factory=dict)
  edges: Mapping[Tuple[str, str], EdgeRule] = dataclasses.field(
      default_factory=dict)
  ops: Tuple[OpRule, ...] = ()
  parameters: Tuple[ParameterRule, ...] = ()
  parameter_tasks: Optional[TaskRule] = None
  recompute: Optional[RecomputeRule] = None
  privacy: Optional[PrivacyRule] = None
  loss_scale: Optional[LossScaleRule] = None
  reads_global_step: bool = False
  named: Tuple[str, ...] = ()

  def rule(self, layer: str) -> LayerRule:
    """The rule of ``layer``: ``PLAIN`` where nothing is declared."""
    found = self.layers.get(layer)
    return found if found is not None else LayerRule(layer)

  @property
  def upstream(self) -> Dict[str, Transform]:
    """Layer -> its composed upstream transform, for layers that have one."""
    return {n: r.upstream for n, r in self.layers.items()
            if r.upstream is not None}

  @property
  def inputs(self) -> Dict[str, Transform]:
    """Layer -> its composed input transform, for layers that have one."""
    return {n: r.inputs for n, r in self.layers.items()
            if r.inputs is not None}

  @property
  def backward_transforms(self) -> Tuple[Tuple[str, Any, Transform], ...]:
    """Every transform that acts in the backward pass, as ``(declaring
    method, layer or edge, transform)``: the layers' upstream transforms,
    their input transforms, then the edges'. What reads transforms by their
    linearity (the loss-scale and optimizer advice) reads them here."""
    return (tuple(("transform_upstream", n, fn)
                  for n, fn in self.upstream.items())
            + tuple(("transform_inputs", n, fn)
                    for n, fn in self.inputs.items())
            + tuple(("transform_edge", k, e.transform)
                    for k, e in self.edges.items()))

  @property
  def own_parameters(self) -> Dict[str, Tuple[Any, ...]]:
    """Layer -> its own parameter transforms (not the group ones), in
    order."""
    out: Dict[str, Tuple[Any, ...]] = {}
    for r in self.parameters:
      if not r.group:
        out[r.layers[0]] = out.get(r.layers[0], ()) + (r.transform,)
    return out

  @property
  def replacements(self) -> Dict[str, Replacement]:
    """Layer -> its backward replacement."""
    return {n: r.replacement for n, r in self.layers.items()
            if r.replacement is not None}

  @property
  def tasks(self) -> Dict[str, TaskRule]:
    """Layer -> its task combination at the outputs."""
    return {n: r.tasks for n, r in self.layers.items() if r.tasks is not None}

  @property
  def has_tasks(self) -> bool:
    return bool(self.tasks) or self.parameter_tasks is not None

  @property
  def rewrites_backward(self) -> bool:
    """The backward pass itself changes (not only parameter gradients)."""
    return bool(self.edges) or any(
        r.rewrites or r.tasks is not None for r in self.layers.values())


# -- compiling ---------------------------------------------------------------

def compile_rules(declarations: Iterable[Declaration], topology: Any = None,
                  ) -> PlanRules:
  """Compiles a plan's declarations into its :class:`PlanRules`.

  Args:
    declarations: the plan's declarations in declaration order (a
      :class:`~graphgrad.core._declaration_model.Declarations`, or any
      iterable of them, with a :class:`LossScaleDeclaration` added by a
      tape that trains with one).
    topology: the plan's :class:`Topology`: read only for op overrides and
      backward replacements (a plan that declares neither is compiled
      without analysing its layers). A callable returning it is taken too.

  Returns:
    The :class:`PlanRules`.

  Raises:
    GraphGradError: for declarations that cannot be combined: ``privatize``
      with a declaration that acts before the clip; a loss scale with a
      task combination or replacement that is not homogeneous
      (docs/concepts.md, "Loss scaling and privatize: one policy").

  Example:
    >>> import graphgrad as gg
    >>> from graphgrad.core._declaration_model import Declarations
    >>> d = Declarations(resolve=lambda name, arg: name, owner="GradientPlan")
    >>> d.add_upstream("l2", gg.transforms.scale(0.5))
    >>> d.add_upstream("l3", gg.transforms.clip_by_norm(1.0))
    >>> rules = compile_rules(d)
    >>> rules.rule("l2").mode, rules.rule("l2").factor
    (<Mode.LINEAR: 'linear'>, 0.5)
    >>> rules.rule("l3").mode, rules.rule("l1").mode
    (<Mode.TRANSFORMED: 'transformed'>, <Mode.PLAIN: 'plain'>)
  """
  d = Declarations.read_only(declarations)

  @functools.lru_cache(maxsize=None)
  def layers() -> Topology:  # read on first use; a callable is called once
    got = topology() if callable(topology) and not hasattr(
        topology, "layers_of_ops") else topology
    if got is None:
      raise _errors.GraphGradError(
          "compiling this plan needs its layers (an override or a backward "
          "replacement is declared), but no topology was given.")
    return got
  privacy, loss_scale = d.privacy, d.loss_scale
  if privacy is not None:
    refuse_declarations(d)
  if loss_scale is not None:
    _check_loss_scale(d)
  ops = tuple(OpRule(match, key, fn, linear=fn is straight_through,
                     layers=frozenset(layers().layers_of_ops(match, key)))
              for (match, key), fn in d.overrides.items() if match != "layer")
  nonlinear = {n for o in ops if not o.linear for n in o.layers}
  rules = _layer_rules(d, layers, nonlinear)
  recompute, params = d.recompute, d.parameter_tasks
  return PlanRules(
      layers=rules,
      edges={k: EdgeRule(k[0], k[1], fn, fn.linear_factor)
             for k, fn in d.edges.items()},
      ops=ops,
      parameters=tuple(
          ParameterRule((layer,), fn) for layer, fns in d.gradients.items()
          for fn in fns) + tuple(ParameterRule(group, fn, group=True)
                                 for group, fn in d.gradient_groups),
      parameter_tasks=None if params is None else TaskRule(
          params.layers, params.losses, params.method, at="parameters"),
      recompute=None if recompute is None else RecomputeRule(
          recompute.keep, recompute.tensors),
      privacy=None if privacy is None else _privacy_rule(
          d.of_kind(PrivatizeDeclaration)[0]),
      loss_scale=None if loss_scale is None else LossScaleRule(loss_scale),
      named=tuple(dict.fromkeys(
          [n for x in d for n in (
              (x.layer, x.upper) if isinstance(x, EdgeDeclaration)
              else (x.layer,)) if n]
          + [n for n, r in rules.items() if r.read])),
      reads_global_step=any(
          isinstance(x, (UpstreamDeclaration, InputsDeclaration,
                         GradientsDeclaration, EdgeDeclaration))
          and isinstance(x.fn, (Transform, GroupTransform))
          and x.fn.reads_global_step for x in d))


class CompiledRules:
  """A plan's declarations, compiled once for each state of them.

  A plan reads its rules here: they are compiled again only when a
  declaration was added since (``Declarations.version``), or for another
  loss scale a Keras tape trains under.

  Args:
    declarations: the plan's declarations.
    topology: as :func:`compile_rules`'s.
  """

  def __init__(self, declarations: Declarations, topology: Any = None):
    self._declarations = declarations
    self._topology = topology
    self._version = -1
    self._plain: Optional[PlanRules] = None
    # (what gives the loss scale, the rules with it): the last one asked.
    self._scaled: Optional[Tuple[Any, PlanRules]] = None

  def rules(self, loss_scale: Any = None) -> PlanRules:
    """The rules, with a :class:`LossScaleDeclaration` of ``loss_scale``
    (a tape's) added to the declarations unless it is ``None``."""
    if self._version != self._declarations.version:
      self._version = self._declarations.version
      self._plain = self._scaled = None
    if loss_scale is None:
      if self._plain is None:
        self._plain = compile_rules(self._declarations, self._topology)
      return self._plain
    if self._scaled is None or self._scaled[0] is not loss_scale:
      self._scaled = (loss_scale, compile_rules(
          list(self._declarations) + [LossScaleDeclaration("", loss_scale)],
          self._topology))
    return self._scaled[1]


def _layer_rules(d: Declarations, layers: Callable[[], Topology],
                 nonlinear) -> Dict[str, LayerRule]:
  upstream, inputs = d.upstream, d.inputs
  replaced = {layer: as_replacement(fn) for layer, fn in d.backward.items()}
  overridden = {key: fn for (match, key), fn in d.overrides.items()
                if match == "layer"}
  tasks = {layer: TaskRule((layer,), t.losses, t.method)
           for layer, t in d.tasks.items()}
  uppers = {upper for _, upper in d.edges}
  read: List[str] = []
  if replaced:
    view = layers().replacement_view
    read = [c for layer, fn in replaced.items() for c in fn.cuts(view, layer)]
  names = list(dict.fromkeys(
      [x.layer for x in d if x.layer
       and isinstance(x, (UpstreamDeclaration, InputsDeclaration,
                          BackwardDeclaration, TasksDeclaration,
                          OverrideDeclaration))]
      + sorted(uppers) + read))
  out = {}
  for name in names:
    fn = upstream.get(name)
    factor = None if fn is None else fn.linear_factor
    if name in replaced:
      mode = Mode.REPLACED
    elif name in overridden:
      mode = Mode.OVERRIDDEN
    elif fn is None:
      mode = Mode.PLAIN
    elif factor is not None and name not in nonlinear:
      # An override inside the layer that may not be linear sees the
      # rewritten gradient itself: the factor cannot be moved past it.
      mode = Mode.LINEAR
    else:
      mode = Mode.TRANSFORMED
    out[name] = LayerRule(
        name, mode, upstream=fn,
        factor=factor if mode is Mode.LINEAR else None,
        replacement=replaced.get(name), override=overridden.get(name),
        tasks=tasks.get(name), inputs=inputs.get(name),
        edge_upper=name in uppers,
        read=name in read)
  return out


def _privacy_rule(d: PrivatizeDeclaration) -> PrivacyRule:
  """The noise of ``privatize``: added by the backward pass, or, after an
  aggregation, once on the aggregate (each worker then pushes its clipped
  sum, neither noised nor divided)."""
  if not d.after_aggregation:
    return PrivacyRule(d.privacy, Noise(d.privacy))
  worker = dataclasses.replace(d.privacy, noise_multiplier=0.0,
                               expected_batch_size=1.0)
  return PrivacyRule(d.privacy, Noise(worker), Noise(d.privacy))


def _check_loss_scale(d: Declarations) -> None:
  """The one loss-scale policy: a declaration that computes gradients of its
  own (a task combination, a backward replacement) is refused unless it is
  homogeneous, ``f(S g) = S f(g)``, so that the loss-scaled gradients it
  receives give the loss-scaled result."""
  bad = [f"combine_tasks({t.layer!r}, {t.method!r})"
         for t in d.tasks.values() if not t.method.homogeneous]
  bad += [f"combine_tasks(at='parameters', {t.method!r})"
          for t in d.of_kind(ParameterTasksDeclaration)
          if not t.method.homogeneous]
  bad += [f"replace_backward({layer!r}, {fn!r})"
          for layer, fn in d.backward.items()
          if not as_replacement(fn).homogeneous]
  if bad:
    raise _errors.GraphGradError(
        f"loss_scale: a loss scale multiplies every gradient of the backward "
        f"pass by S, but {', '.join(bad)} compute(s) gradients whose result "
        f"does not scale with S (not homogeneous), so they would be "
        f"silently wrong. Train this plan without a loss scale (float32), "
        f"or use methods that scale with their input (gg.mtl.pcgrad, "
        f"mean, sum; feedback_alignment, direct_feedback_alignment).")
