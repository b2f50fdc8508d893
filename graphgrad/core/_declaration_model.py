"""The declarations of a plan: one value, which both executors read.

A plan is a list of declarations: "rewrite the upstream gradient of layer
``L`` with ``fn``", "rewrite ``L``'s parameter gradients", "rewrite the edge
``lower -> upper``", "replace ``L``'s backward pass", "combine the task
gradients at ``L``", "give the op ``o`` the backward pass ``fn``".
:class:`Declarations` holds them in declaration order and checks each one
once, when it is declared: the layer names (through the resolver its plan
gives it), the callables, group versus per-tensor transforms, duplicates,
and declaring after the plan was built. ``GradientPlan`` (the segment
engine) and ``KerasPlan`` (its tape) read them through the read-only
accessors.
"""

import dataclasses
import enum
from typing import (
  Any,
  Callable,
  Dict,
  Iterator,
  List,
  Optional,
  Sequence,
  Tuple,
)

from graphgrad import _errors
from graphgrad.transforms._checks import compose, not_group
from graphgrad.transforms._group import GroupTransform
from graphgrad.transforms._transforms import (
  Transform,
  as_transform,
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
  GRADIENTS = "gradients"
  EDGE = "edge"
  BACKWARD = "backward"
  TASKS = "tasks"
  OVERRIDE = "override"

_TRANSFORMS = (DeclarationKind.UPSTREAM, DeclarationKind.GRADIENTS,
               DeclarationKind.EDGE)

# How an override names what it overrides: an op's name, every op of a type,
# or (KerasPlan) the call of a layer.
MATCHES = ("name", "type", "layer")


@dataclasses.dataclass(frozen=True)
class Declaration:
  """One declaration of a plan.

  Attributes:
    kind: what is rewritten.
    layer: the layer (``lower`` for an edge); for an override, the layer
      whose call is overridden, else ``""``.
    fn: the transform, group transform, backward replacement or override
      gradient function; ``None`` for a task combination.
    upper: ``upper`` of an edge; else ``None``.
    losses: the task losses of a task combination (``None`` where the
      executor gets them later, as ``KerasPlan`` does inside its tape).
    method: the task-combination method (``combine(grads)``); else ``None``.
    op: what an override matches: ``(match, key)``, ``match`` one of
      ``"name"``, ``"type"``, ``"layer"``; else ``None``.
    group: for a parameter transform of several layers at once, their
      names (``layer`` is then ``""``); else ``()``.
  """
  kind: DeclarationKind
  layer: str
  fn: Any = None
  upper: Optional[str] = None
  losses: Optional[Tuple[Any, ...]] = None
  method: Any = None
  op: Optional[Tuple[str, str]] = None
  group: Tuple[str, ...] = ()


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

  # -- declaring -----------------------------------------------------------

  def resolve(self, layer, arg: str = "layer") -> str:
    """The canonical name of ``layer``; refuses once frozen."""
    return self._layer(layer, arg)

  def add_upstream(self, layer, fn, validate: Validate = None) -> None:
    name = self._layer(layer, "layer")
    fn = self._per_tensor(fn, "transform_upstream")
    self._add(Declaration(DeclarationKind.UPSTREAM, name, fn), validate)

  def add_gradients(self, layer, fn,
                    validate: Optional[Callable[..., Any]] = None) -> None:
    """``layer``: a layer, or a list of layers whose parameters ``fn`` sees
    together (a group transform over all of them), after each layer's own
    transforms; ``validate`` then takes the list of names."""
    if not isinstance(fn, GroupTransform):
      fn = as_transform(fn)
    if not isinstance(layer, (list, tuple)):
      name = self._layer(layer, "layer")
      self._add(Declaration(DeclarationKind.GRADIENTS, name, fn), validate)
      return
    names = tuple(dict.fromkeys(self._layer(l, "layer") for l in layer))
    if not names:
      raise _errors.GraphGradError(
          f"transform_gradients: `layer` is an empty {type(layer).__name__}; "
          f"pass a layer name, or a list of the layers whose parameter "
          f"gradients the transform sees together (every layer: "
          f"plan.layer_names).")
    self._add(Declaration(DeclarationKind.GRADIENTS, "", fn, group=names),
              (lambda: validate(names)) if validate is not None else None)

  def add_edge(self, lower, upper, fn, validate: Validate = None) -> None:
    lo = self._layer(lower, "lower")
    up = self._resolve(upper, "upper")
    if lo == up:
      raise _errors.GraphGradError(
          f"transform_edge: `lower` and `upper` are both {lo!r}; an edge "
          f"joins two layers. Use transform_upstream({lo!r}, fn) instead.")
    fn = self._per_tensor(fn, "transform_edge")
    self._add(Declaration(DeclarationKind.EDGE, lo, fn, upper=up), validate)

  def add_backward(self, layer, fn, validate: Validate = None) -> None:
    name = self._layer(layer, "layer")
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
    self._add(Declaration(DeclarationKind.BACKWARD, name, fn), validate)

  def add_tasks(self, layer, losses: Optional[Sequence[Any]],
                method, validate: Validate = None) -> None:
    name = self._layer(layer, "layer")
    if not callable(getattr(method, "combine", None)):
      raise _errors.GraphGradError(
          f"combine_tasks: `method` must be a task-combination method with "
          f"a combine(grads) method, such as gg.mtl.pcgrad(); got "
          f"{type(method).__name__} {method!r}.")
    if name in self.tasks:
      raise _errors.GraphGradError(
          f"combine_tasks: layer {name!r} already combines task gradients "
          f"with {self.tasks[name].method!r}; declare it once, with every "
          f"task loss.")
    self._add(Declaration(
        DeclarationKind.TASKS, name,
        losses=None if losses is None else tuple(losses), method=method),
        validate)

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
    self._add(Declaration(DeclarationKind.OVERRIDE,
                          key if match == "layer" else "", fn, op=op),
              validate)

  def freeze(self) -> None:
    """Refuses further declarations: the plan is being built."""
    self._frozen = True

  @property
  def frozen(self) -> bool:
    return self._frozen

  # -- reading -------------------------------------------------------------

  def __iter__(self) -> Iterator[Declaration]:
    return iter(tuple(self._items))

  def __len__(self) -> int:
    return len(self._items)

  def of_kind(self, kind: DeclarationKind) -> Tuple[Declaration, ...]:
    return tuple(d for d in self._items if d.kind is kind)

  @property
  def upstream(self) -> Dict[str, Transform]:
    """Layer -> its upstream transforms chained in declaration order.

    Layers whose transforms compose to the identity are left out: they need
    no rewrite at all.
    """
    out = _chained((d.layer, d.fn)
                   for d in self.of_kind(DeclarationKind.UPSTREAM))
    return {k: fn for k, fn in out.items() if not is_identity(fn)}

  @property
  def edges(self) -> Dict[Tuple[str, str], Transform]:
    """``(lower, upper)`` -> the edge's transforms chained in order."""
    return _chained(((d.layer, d.upper), d.fn)
                    for d in self.of_kind(DeclarationKind.EDGE))

  @property
  def gradients(self) -> Dict[str, Tuple[Any, ...]]:
    """Layer -> its parameter transforms (group ones included), in order."""
    out: Dict[str, Tuple[Any, ...]] = {}
    for d in self.of_kind(DeclarationKind.GRADIENTS):
      if not d.group:
        out[d.layer] = out.get(d.layer, ()) + (d.fn,)
    return out

  @property
  def gradient_groups(self) -> Tuple[Tuple[Tuple[str, ...], Any], ...]:
    """``(layers, fn)`` of each parameter transform over several layers at
    once, in declaration order; applied after every layer's own."""
    return tuple((d.group, d.fn) for d in self.of_kind(
        DeclarationKind.GRADIENTS) if d.group)

  @property
  def backward(self) -> Dict[str, Any]:
    """Layer -> its backward replacement."""
    return {d.layer: d.fn for d in self.of_kind(DeclarationKind.BACKWARD)}

  @property
  def tasks(self) -> Dict[str, Declaration]:
    """Layer -> its task-combination declaration."""
    return {d.layer: d for d in self.of_kind(DeclarationKind.TASKS)}

  @property
  def overrides(self) -> Dict[Tuple[str, str], Any]:
    """``(match, key)`` -> the override's gradient function."""
    return {d.op: d.fn for d in self.of_kind(DeclarationKind.OVERRIDE) if d.op}

  @property
  def layers(self) -> Tuple[str, ...]:
    """Every layer named by a declaration, in first-declared order."""
    names: List[str] = []
    for d in self._items:
      names += ([d.layer] if d.layer else []) + ([d.upper] if d.upper else [])
    return tuple(dict.fromkeys(names))

  @property
  def reads_global_step(self) -> bool:
    """True when a declared transform reads the global step (annealed noise):
    the executor then advances it."""
    return any(getattr(d.fn, "reads_global_step", False) for d in self._items
               if d.kind in _TRANSFORMS)

  @property
  def rewrites_backward(self) -> bool:
    """True when the backward pass itself changes (not only parameters)."""
    return bool(self.upstream or self.edges or self.backward or self.tasks)

  def summary(self) -> str:
    """``upstream=[...], gradients=[...], ...``, for a plan's repr."""
    parts = [("upstream", sorted(self.upstream)),
             ("gradients", sorted(self.gradients)
              + [list(g) for g, _ in self.gradient_groups]),
             ("edges", sorted(self.edges)),
             ("backward", sorted(self.backward)),
             ("tasks", sorted(self.tasks))]
    if self.overrides:
      parts.append(("overrides", sorted(k for _, k in self.overrides)))
    return ", ".join(f"{k}={v}" for k, v in parts)

  # -- helpers -------------------------------------------------------------

  def _add(self, declaration: Declaration, validate: Validate) -> None:
    if validate is not None:
      validate()
    self._items.append(declaration)

  def _layer(self, layer, arg: str) -> str:
    if self._frozen:
      raise _errors.GraphGradError(
          f"this {self._owner} is already built (its gradients were "
          f"computed, or a tape was opened); declare every rewrite before "
          f"that, or make a new {self._owner}.")
    return self._resolve(layer, arg)

  @staticmethod
  def _per_tensor(fn, method: str) -> Transform:
    not_group(fn, method)
    return as_transform(fn)


def _chained(pairs) -> Dict[Any, Transform]:
  grouped: Dict[Any, List[Transform]] = {}
  for key, fn in pairs:
    grouped.setdefault(key, []).append(fn)
  return {k: compose(fns) for k, fns in grouped.items()}

