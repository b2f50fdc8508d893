"""The declarations of a plan: one value, which both executors read.

A plan is a list of declarations: "rewrite the upstream gradient of layer
``L`` with ``fn``", "rewrite what ``L`` sends to its inputs", "rewrite
``L``'s parameter gradients", "rewrite the edge
``lower -> upper``", "replace ``L``'s backward pass", "combine the task
gradients at ``L``'s outputs", "combine the task gradients of the parameters
of ``L1, L2, ...``", "give the op ``o`` the backward pass ``fn``", each a
small dataclass of its own kind. :class:`Declarations` holds them in
declaration order and checks each one once, for both plans, when it is
declared: the layer names (through the resolver its plan gives it), the
callables, group versus per-tensor transforms, duplicates, conflicts (a
layer's override or its replacement, not both), and declaring after the
plan was built. ``GradientPlan`` (the segment engine) and ``KerasPlan``
(its tape) read them through the read-only accessors.
"""

import dataclasses
import enum
from typing import (
  Any,
  Callable,
  ClassVar,
  Dict,
  Iterable,
  Iterator,
  List,
  Optional,
  Sequence,
  Tuple,
  Type,
  TypeVar,
)

from graphgrad import _errors
from graphgrad.methods._mtl_base import as_task_method
from graphgrad.transforms._group import GroupTransform
from graphgrad.transforms._transforms import (
  Transform,
  as_transform,
  compose,
  is_identity,
)

# resolve(name_or_layer, argument name) -> canonical layer name, or raises.
Resolver = Callable[[Any, str], str]
# An executor's own check of a declaration, run after the shared ones and
# before the declaration is recorded; it raises to refuse it.
Validate = Optional[Callable[[], Any]]


class DeclarationKind(enum.Enum):
  """The kinds of declaration."""
  UPSTREAM = "upstream"
  INPUTS = "inputs"
  GRADIENTS = "gradients"
  EDGE = "edge"
  BACKWARD = "backward"
  TASKS = "tasks"
  PARAMETER_TASKS = "parameter_tasks"
  OVERRIDE = "override"
  RECOMPUTE = "recompute"
  PRIVATIZE = "privatize"
  LOSS_SCALE = "loss_scale"


# How an override names what it overrides: an op's name, every op of a type,
# or (KerasPlan) the call of a layer.
MATCHES = ("name", "type", "layer")


@dataclasses.dataclass(frozen=True)
class Declaration:
  """One declaration of a plan; each kind is a subclass of its own.

  Attributes:
    layer: the layer it is declared on (``lower`` for an edge; for an
      override, the layer whose call is overridden, else ``""``).
    before_clip: why the kind cannot be combined with ``privatize`` (it
      acts on the backward pass the per-example norms are taken from), or
      ``None`` where it can (``core._privacy.refuse_declarations``).
  """
  kind: ClassVar[DeclarationKind]
  before_clip: ClassVar[Optional[str]] = None
  layer: str


@dataclasses.dataclass(frozen=True)
class UpstreamDeclaration(Declaration):
  """``transform_upstream(layer, fn)``."""
  kind: ClassVar[DeclarationKind] = DeclarationKind.UPSTREAM
  before_clip: ClassVar[Optional[str]] = (
      "transform_upstream acts on the whole batch's gradient at the "
      "layer's outputs before the clip (a clip_by_norm of a boundary mixes "
      "examples), and the per-example norms are taken from the chain rule")
  fn: Transform


@dataclasses.dataclass(frozen=True)
class InputsDeclaration(Declaration):
  """``transform_inputs(layer, fn)``: ``fn`` rewrites the gradient the
  layer's backward step gives each of its inputs."""
  kind: ClassVar[DeclarationKind] = DeclarationKind.INPUTS
  before_clip: ClassVar[Optional[str]] = (
      "transform_inputs acts on the whole batch's gradient at the "
      "layer's inputs before the clip (a clip_by_norm there mixes examples), "
      "and the per-example norms are taken from the chain rule")
  fn: Transform


@dataclasses.dataclass(frozen=True)
class GradientsDeclaration(Declaration):
  """``transform_gradients(layer, fn)``: a transform or a group transform.

  Attributes:
    fn: the transform or group transform.
    group: for a transform of several layers' parameters at once, their
      names (``layer`` is then ``""``); else ``()``.
  """
  kind: ClassVar[DeclarationKind] = DeclarationKind.GRADIENTS
  fn: Any
  group: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class EdgeDeclaration(Declaration):
  """``transform_edge(lower, upper, fn)``; ``layer`` is ``lower``."""
  kind: ClassVar[DeclarationKind] = DeclarationKind.EDGE
  before_clip: ClassVar[Optional[str]] = (
      "transform_edge acts on the whole batch's gradient of a boundary "
      "before the clip, and the per-example norms are taken from the chain "
      "rule")
  upper: str
  fn: Transform


@dataclasses.dataclass(frozen=True)
class BackwardDeclaration(Declaration):
  """``replace_backward(layer, fn)``."""
  kind: ClassVar[DeclarationKind] = DeclarationKind.BACKWARD
  before_clip: ClassVar[Optional[str]] = (
      "replace_backward changes what each example's gradient is, and "
      "the per-example norms are taken from the chain rule")
  fn: Any


@dataclasses.dataclass(frozen=True)
class TasksDeclaration(Declaration):
  """``combine_tasks(layer, losses, method)``.

  Attributes:
    losses: the task losses (``None`` where the executor gets them later,
      as ``KerasPlan`` does inside its tape).
    method: the task-combination method (``combine(grads)``).
  """
  kind: ClassVar[DeclarationKind] = DeclarationKind.TASKS
  before_clip: ClassVar[Optional[str]] = (
      "combine_tasks mixes examples before the clip: its weights come "
      "from the whole batch, so one example changes every other example's "
      "gradient")
  losses: Optional[Tuple[Any, ...]]
  method: Any


@dataclasses.dataclass(frozen=True)
class ParameterTasksDeclaration(Declaration):
  """``combine_tasks(layers, losses, method, at="parameters")``; ``layer``
  is ``""``.

  Attributes:
    layers: the layers whose variables' task gradients are combined, or
      ``None`` for every variable the plan differentiates.
    losses: the task losses (``None`` where the executor gets them later,
      as ``KerasPlan`` does inside its tape).
    method: the task-combination method (``combine(grads)``).
  """
  kind: ClassVar[DeclarationKind] = DeclarationKind.PARAMETER_TASKS
  before_clip: ClassVar[Optional[str]] = (
      "combine_tasks(at='parameters') mixes examples before the clip: "
      "its projections come from the whole batch's task gradients")
  layers: Optional[Tuple[str, ...]]
  losses: Optional[Tuple[Any, ...]]
  method: Any


@dataclasses.dataclass(frozen=True)
class OverrideDeclaration(Declaration):
  """``override_gradient`` / ``straight_through``.

  Attributes:
    op: what it matches: ``(match, key)``, ``match`` one of ``"name"``,
      ``"type"``, ``"layer"``.
    fn: the gradient function.
  """
  kind: ClassVar[DeclarationKind] = DeclarationKind.OVERRIDE
  before_clip: ClassVar[Optional[str]] = (
      "override_gradient changes what each example's gradient is, and "
      "the per-example norms are taken from the chain rule")
  op: Tuple[str, str]
  fn: Any


@dataclasses.dataclass(frozen=True)
class RecomputeDeclaration(Declaration):
  """``recompute(keep)``; ``layer`` is ``""``.

  Attributes:
    keep: the layers whose outputs the backward pass keeps, or ``None`` for
      the executor's choice.
    tensors: the names of the tensors kept besides, as the plan resolved
      them (on a KerasPlan, always empty: a tensor there is its layer's).
  """
  kind: ClassVar[DeclarationKind] = DeclarationKind.RECOMPUTE
  keep: Optional[Tuple[str, ...]] = None
  tensors: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PrivatizeDeclaration(Declaration):
  """``privatize(l2_norm_clip, noise_multiplier, seed)``; ``layer`` is ``""``.

  Attributes:
    privacy: the checked :class:`~graphgrad.core._privacy.Privacy`.
    after_aggregation: the noise is added after the workers' clipped sums
      are aggregated (a ``GradientPlan`` applied by a
      ``SyncReplicasOptimizer`` records it): each worker's backward pass
      builds its clipped sum, without noise.
  """
  kind: ClassVar[DeclarationKind] = DeclarationKind.PRIVATIZE
  privacy: Any = None
  after_aggregation: bool = False


@dataclasses.dataclass(frozen=True)
class LossScaleDeclaration(Declaration):
  """Training under a loss scale; ``layer`` is ``""``.

  A ``GradientPlan`` declares it once (``loss_scale=``, or the loss-scale
  optimizer ``apply_gradients`` adopts); a ``KerasPlan`` tape adds it to the
  plan's declarations for that tape (``plan.tape(loss_scale=...)``).

  Attributes:
    scale: what gives the scale: a TF1 ``LossScale``, a Keras
      loss-scale optimizer or a number.
  """
  kind: ClassVar[DeclarationKind] = DeclarationKind.LOSS_SCALE
  scale: Any = None


D = TypeVar("D", bound=Declaration)


class Declarations:
  """A plan's declarations, in declaration order, each checked once.

  Every ``add_*`` method takes an optional ``validate``: the executor's own
  check of the declaration (the layer has a floating-point output, the edge
  exists, the replacement can handle the layer), called after the shared
  checks and before the declaration is recorded, so that a refused
  declaration leaves nothing behind.

  Args:
    resolve: maps a layer reference and the argument's name to the
      canonical layer name, raising ``LayerNotFoundError`` for an unknown
      one. Each plan gives its own (a layer graph, a Keras model's tree).
    owner: the plan's class name, for messages.

  Example:
    >>> import graphgrad as gg
    >>> from graphgrad.core._declaration_model import Declarations
    >>> d = Declarations(resolve=lambda name, arg: name, owner="GradientPlan")
    >>> d.add_upstream("l2", gg.transforms.scale(0.5))
    >>> d.add_gradients("l2", gg.transforms.clip_by_global_norm(1.0))
    >>> [(x.kind.value, x.layer) for x in d]
    [('upstream', 'l2'), ('gradients', 'l2')]
    >>> d.upstream
    {'l2': scale(0.5)}
  """

  def __init__(self, resolve: Resolver, owner: str):
    self._resolve = resolve
    self._owner = owner
    self._items: List[Declaration] = []
    self._frozen = False
    self._version = 0

  @classmethod
  def read_only(cls, items: Iterable[Declaration]) -> "Declarations":
    """``items`` to read through the accessors: a plan's ``Declarations``
    itself, or any iterable of checked declarations (a tape adds its loss
    scale), frozen."""
    if isinstance(items, Declarations):
      return items
    out = cls(resolve=lambda layer, arg: layer, owner="Declarations")
    out._items, out._frozen = list(items), True
    return out

  # -- declaring -----------------------------------------------------------

  def resolve(self, layer, arg: str = "layer") -> str:
    """The canonical name of ``layer``; refuses once frozen."""
    self._check_open()
    return self._resolve(layer, arg)

  def add_upstream(self, layer, fn, validate: Validate = None) -> None:
    name = self.resolve(layer, "layer")
    fn = self._per_tensor(fn, "transform_upstream")
    self._add(UpstreamDeclaration(name, fn), validate)

  def add_inputs(self, layer, fn, validate: Validate = None) -> None:
    name = self.resolve(layer, "layer")
    fn = self._per_tensor(fn, "transform_inputs")
    self._add(InputsDeclaration(name, fn), validate)

  def add_gradients(self, layer, fn,
                    validate: Optional[Callable[..., Any]] = None) -> None:
    """``layer``: a layer, or a list of layers whose parameters ``fn`` sees
    together (a group transform over all of them), after each layer's own
    transforms; ``validate`` takes the layer's name, or the tuple of the
    names of a list."""
    if not isinstance(fn, GroupTransform):
      fn = as_transform(fn)
    if not isinstance(layer, (list, tuple)):
      name = self.resolve(layer, "layer")
      self._add(GradientsDeclaration(name, fn),
                (lambda: validate(name)) if validate is not None else None)
      return
    names = tuple(dict.fromkeys(self.resolve(l, "layer") for l in layer))
    if not names:
      raise _errors.GraphGradError(
          f"transform_gradients: `layer` is an empty {type(layer).__name__}; "
          f"pass a layer name, or a list of the layers whose parameter "
          f"gradients the transform sees together (every layer: "
          f"plan.layer_names).")
    self._add(GradientsDeclaration("", fn, group=names),
              (lambda: validate(names)) if validate is not None else None)

  def add_edge(self, lower, upper, fn, validate: Validate = None) -> None:
    lo = self.resolve(lower, "lower")
    up = self._resolve(upper, "upper")
    if lo == up:
      raise _errors.GraphGradError(
          f"transform_edge: `lower` and `upper` are both {lo!r}; an edge "
          f"joins two layers. Use transform_upstream({lo!r}, fn) instead.")
    fn = self._per_tensor(fn, "transform_edge")
    self._add(EdgeDeclaration(lo, up, fn), validate)

  def add_backward(self, layer, fn, validate: Validate = None) -> None:
    name = self.resolve(layer, "layer")
    if not callable(fn) or isinstance(fn, (Transform, GroupTransform)):
      raise _errors.GraphGradError(
          f"replace_backward: `fn` must be a gg.backward replacement or a "
          f"callable mapping a gg.backward.BackwardContext to one gradient "
          f"per input tensor; got {fn!r}. Pass e.g. "
          f"gg.backward.feedback_alignment(seed=0).")
    if name in self.backward:
      raise _errors.GraphGradError(
          f"replace_backward: layer {name!r} already has the replacement "
          f"{self.backward[name]!r}; a layer's backward pass is replaced "
          f"once. Make a new {self._owner} to try another.")
    if ("layer", name) in self.overrides:
      raise _errors.GraphGradError(
          f"replace_backward: layer {name!r} already has an override "
          f"(override_gradient or straight_through), which computes what "
          f"its inputs get; a layer has one of the two. Replace the "
          f"backward pass of a layer without an override.")
    self._add(BackwardDeclaration(name, fn), validate)

  def add_tasks(self, layer, losses: Optional[Sequence[Any]],
                method, validate: Validate = None) -> None:
    name = self.resolve(layer, "layer")
    method = as_task_method(method)
    if name in self.tasks:
      raise _errors.GraphGradError(
          f"combine_tasks: layer {name!r} already combines task gradients "
          f"with {self.tasks[name].method!r}; declare it once, with every "
          f"task loss.")
    self._add(TasksDeclaration(
        name, None if losses is None else tuple(losses), method), validate)

  def add_parameter_tasks(self, layers, losses: Optional[Sequence[Any]],
                          method, validate: Validate = None) -> None:
    """Records a task combination over the parameters of ``layers``.

    ``layers`` is a layer reference, a list of them, or ``None`` for every
    variable the plan differentiates. A plan has at most one.
    """
    names = self.resolve_layers(layers, "combine_tasks")
    method = as_task_method(method)
    before = self.parameter_tasks
    if before is not None:
      raise _errors.GraphGradError(
          f"combine_tasks(at='parameters'): this plan already combines task "
          f"gradients in parameter space, over "
          f"{'every layer' if before.layers is None else list(before.layers)}"
          f" with {before.method!r}; declare it once, with every layer "
          f"(a list of names, or layers=None for all).")
    self._add(ParameterTasksDeclaration(
        "", names, None if losses is None else tuple(losses), method),
        validate)

  def resolve_layers(self, layers, caller: str) -> Optional[Tuple[str, ...]]:
    """Canonical names of a layer reference or a list of them (``None``
    stays ``None``: every layer); refuses an empty list or a repeat."""
    if layers is None:
      self._check_open()
      return None
    many = isinstance(layers, (list, tuple))
    refs = list(layers) if many else [layers]
    if not refs:
      raise _errors.GraphGradError(
          f"{caller}: `layers` must name at least one layer; got an empty "
          f"{type(layers).__name__}. Pass a layer name, a list of names, or "
          f"None for every layer.")
    names = [self.resolve(r, "layers") for r in refs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
      raise _errors.GraphGradError(
          f"{caller}: `layers` names {', '.join(map(repr, twice))} more than "
          f"once; got {refs!r}. Name each layer once.")
    return tuple(names)

  def add_override(self, op: Tuple[str, str], fn, caller: str,
                   validate: Validate = None) -> None:
    """Records the backward pass ``fn`` for ``op``, a ``(match, key)`` pair.

    The plan resolves its own op references (an op of a ``tf.Graph``, a
    Keras layer) to the pair before calling this.
    """
    if self._frozen:
      raise _errors.GraphGradError(
          f"{caller}: this {self._owner} is already built (its gradients were "
          f"computed, or a tape was opened); declare every override before "
          f"that, or make a new {self._owner}.")
    if not callable(fn):
      raise _errors.GraphGradError(
          f"{caller}: `fn` must be a callable fn(op, *output_grads) -> one "
          f"gradient per input of op, like a function registered with "
          f"tf.RegisterGradient; got {type(fn).__name__}.")
    match, key = op
    if match not in MATCHES:
      raise _errors.GraphGradError(
          f"{caller}: an override matches an op by one of {MATCHES}; got "
          f"{match!r} for {key!r}. Resolve the op reference to one of them.")
    if op in self.overrides:
      raise _errors.GraphGradError(
          f"{caller}: {key!r} already has a backward pass in this plan; an "
          f"op's gradient is overridden once. Make a new {self._owner} to "
          f"try another.")
    if match == "layer" and key in self.backward:
      raise _errors.GraphGradError(
          f"{caller}: layer {key!r} already has the backward replacement "
          f"{self.backward[key]!r}, which computes what its inputs get; a "
          f"layer has one of the two. Override a layer without "
          f"replace_backward.")
    self._add(OverrideDeclaration(key if match == "layer" else "", op, fn),
              validate)

  def add_recompute(self, keep: Optional[Sequence[Any]], caller: str,
                    validate: Optional[Callable[..., Any]] = None,
                    read: Optional[Callable[[Any], Tuple[str, Any]]] = None
                    ) -> None:
    """Records ``recompute(keep)``; ``keep`` a list of layer references and
    tensors, or ``None``. A plan recomputes once; ``validate`` takes the
    kept layer names.

    ``read(item)`` is the plan's reading of one item: ``("tensor", name)``
    for a tensor it keeps by name, ``("layer", ref)`` for a layer reference
    (resolved here). Without it every item is a layer reference.
    """
    self._check_open()
    tensors: Tuple[str, ...] = ()
    if keep is not None:
      if isinstance(keep, str) or not isinstance(keep, (list, tuple, set)):
        raise _errors.GraphGradError(
            f"{caller}: `keep` must be a list of layers (names, paths or "
            f"layers) and tensors, or None; got {type(keep).__name__} "
            f"{keep!r}. Pass keep=[{keep!r}] for one.")
      pairs = [("layer", k) if read is None else read(k) for k in keep]
      tensors = tuple(dict.fromkeys(r for kind, r in pairs
                                    if kind == "tensor"))
      keep = tuple(dict.fromkeys(self.resolve(r, "keep")
                                 for kind, r in pairs if kind == "layer"))
    if self.of_kind(RecomputeDeclaration):
      raise _errors.GraphGradError(
          f"{caller}: this {self._owner} already recomputes; declare "
          f"recompute once, with every layer to keep.")
    self._add(RecomputeDeclaration("", keep, tensors),
              (lambda: validate(keep)) if validate is not None else None)

  def add_privatize(self, privacy: Any, caller: str) -> None:
    """Records ``privatize``: ``privacy`` is the checked ``Privacy``."""
    if self._frozen or self.of_kind(PrivatizeDeclaration):
      state = "built" if self._frozen else "private"
      raise _errors.GraphGradError(
          f"{caller}: the plan is already {state}; declare privatize once, "
          f"before its gradients are first computed (compute_gradients, "
          f"apply_gradients, plan.tape() or attach()).")
    self._add(PrivatizeDeclaration("", privacy), None)

  def add_after_aggregation(self) -> None:
    """Records that ``privatize``'s noise is added after the workers'
    clipped sums are aggregated (``PrivatizeDeclaration.after_aggregation``).
    """
    self._check_open()
    self._items = [dataclasses.replace(d, after_aggregation=True)
                   if isinstance(d, PrivatizeDeclaration) else d
                   for d in self._items]
    self._version += 1

  def add_loss_scale(self, scale: Any) -> None:
    """Records the plan's loss scale (a ``GradientPlan`` has one)."""
    self._check_open()
    self._items = [d for d in self._items
                   if not isinstance(d, LossScaleDeclaration)]
    self._add(LossScaleDeclaration("", scale), None)  # counts the change

  def freeze(self) -> None:
    """Refuses further declarations: the plan is being built."""
    self._frozen = True

  @property
  def frozen(self) -> bool:
    return self._frozen

  @property
  def version(self) -> int:
    """Counts the changes to the declarations: a plan compiles them again
    only when it has changed since its last compile."""
    return self._version

  @property
  def owner(self) -> str:
    """The plan's class name, for messages."""
    return self._owner

  # -- reading -------------------------------------------------------------

  def __iter__(self) -> Iterator[Declaration]:
    return iter(tuple(self._items))

  def __len__(self) -> int:
    return len(self._items)

  def of_kind(self, kind: Type[D]) -> Tuple[D, ...]:
    """The declarations of one kind (a :class:`Declaration` subclass)."""
    return tuple(d for d in self._items if isinstance(d, kind))

  @property
  def upstream(self) -> Dict[str, Transform]:
    """Layer -> its upstream transforms chained in declaration order.

    Layers whose transforms compose to the identity are left out: they need
    no rewrite at all.
    """
    out = _chained((d.layer, d.fn) for d in self.of_kind(UpstreamDeclaration))
    return {k: fn for k, fn in out.items() if not is_identity(fn)}

  @property
  def inputs(self) -> Dict[str, Transform]:
    """Layer -> its input transforms chained in declaration order
    (identities left out, as in :attr:`upstream`)."""
    out = _chained((d.layer, d.fn) for d in self.of_kind(InputsDeclaration))
    return {k: fn for k, fn in out.items() if not is_identity(fn)}

  @property
  def edges(self) -> Dict[Tuple[str, str], Transform]:
    """``(lower, upper)`` -> the edge's transforms chained in order."""
    return _chained(((d.layer, d.upper), d.fn)
                    for d in self.of_kind(EdgeDeclaration))

  @property
  def gradients(self) -> Dict[str, Tuple[Any, ...]]:
    """Layer -> its parameter transforms (group ones included), in order."""
    out: Dict[str, Tuple[Any, ...]] = {}
    for d in self.of_kind(GradientsDeclaration):
      if not d.group:
        out[d.layer] = out.get(d.layer, ()) + (d.fn,)
    return out

  @property
  def gradient_groups(self) -> Tuple[Tuple[Tuple[str, ...], Any], ...]:
    """``(layers, fn)`` of each parameter transform over several layers at
    once, in declaration order; applied after every layer's own."""
    return tuple((d.group, d.fn) for d in self.of_kind(GradientsDeclaration)
                 if d.group)

  @property
  def backward(self) -> Dict[str, Any]:
    """Layer -> its backward replacement."""
    return {d.layer: d.fn for d in self.of_kind(BackwardDeclaration)}

  @property
  def tasks(self) -> Dict[str, TasksDeclaration]:
    """Layer -> its task-combination declaration."""
    return {d.layer: d for d in self.of_kind(TasksDeclaration)}

  @property
  def parameter_tasks(self) -> Optional[ParameterTasksDeclaration]:
    """The task combination in parameter space, or ``None``."""
    found = self.of_kind(ParameterTasksDeclaration)
    return found[0] if found else None

  @property
  def overrides(self) -> Dict[Tuple[str, str], Any]:
    """``(match, key)`` -> the override's gradient function."""
    return {d.op: d.fn for d in self.of_kind(OverrideDeclaration)}

  @property
  def privacy(self) -> Any:
    """The ``Privacy`` that ``privatize`` declared, or ``None``."""
    found = self.of_kind(PrivatizeDeclaration)
    return found[0].privacy if found else None

  @property
  def recompute(self) -> Optional[RecomputeDeclaration]:
    """The ``recompute`` declaration, or ``None``."""
    found = self.of_kind(RecomputeDeclaration)
    return found[-1] if found else None

  @property
  def loss_scale(self) -> Any:
    """What gives the loss scale the plan trains with, or ``None``."""
    found = self.of_kind(LossScaleDeclaration)
    return found[-1].scale if found else None

  def summary(self) -> str:
    """``upstream=[...], gradients=[...], ...``, for a plan's repr."""
    parts = [("upstream", sorted(self.upstream)),
             ("gradients", sorted(self.gradients)
              + [list(g) for g, _ in self.gradient_groups]),
             ("edges", sorted(self.edges)),
             ("backward", sorted(self.backward)),
             ("tasks", sorted(self.tasks))]
    if self.inputs:
      parts.append(("inputs", sorted(self.inputs)))
    if self.overrides:
      parts.append(("overrides", sorted(k for _, k in self.overrides)))
    params = self.parameter_tasks
    if params is not None:
      parts.append(("parameter_tasks", "all" if params.layers is None
                    else list(params.layers)))
    return ", ".join(f"{k}={v}" for k, v in parts)

  # -- helpers -------------------------------------------------------------

  def _add(self, declaration: Declaration, validate: Validate) -> None:
    if validate is not None:
      validate()
    self._items.append(declaration)
    self._version += 1

  def _check_open(self) -> None:
    if self._frozen:
      raise _errors.GraphGradError(
          f"this {self._owner} is already built (its gradients were "
          f"computed, or a tape was opened); declare every rewrite before "
          f"that, or make a new {self._owner}.")

  @staticmethod
  def _per_tensor(fn, method: str) -> Transform:
    """``fn`` as a transform of one gradient; a group transform is refused."""
    if isinstance(fn, GroupTransform):
      raise _errors.GraphGradError(
          f"{method}: {fn!r} is a group transform, which rewrites a layer's "
          f"parameter gradients together; it has no meaning for one upstream "
          f"or edge gradient. Use plan.transform_gradients(layer, {fn!r}).")
    return as_transform(fn)


def _chained(pairs) -> Dict[Any, Transform]:
  grouped: Dict[Any, List[Transform]] = {}
  for key, fn in pairs:
    grouped.setdefault(key, []).append(fn)
  return {k: compose(fns) for k, fns in grouped.items()}

