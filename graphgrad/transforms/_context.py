"""What a transform or a backward replacement sees of the plan applying it.

:class:`TransformContext` says where a transform is applied (layer, role,
variable, edge, tensor, global step). :class:`Resources` is the plan's store
of what its transforms and replacements create once per plan (feedback
matrices, synthetic-gradient modules, a counter), keyed by ``(layer, name)``.

Example:
  >>> import tensorflow as tf
  >>> store = Resources()
  >>> a = store.get_or_create("l1", "counter", lambda: tf.constant(3.0))
  >>> b = store.get_or_create("l1", "counter", lambda: tf.constant(4.0))
  >>> a is b, store.keys()
  (True, (('l1', 'counter'),))
"""

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import tensorflow as tf

T = TypeVar("T")
Key = Tuple[Optional[str], str]


class Resources:
  """A plan's store of what its transforms and replacements create.

  Values are created at most once per ``(layer, name)`` key, in creation
  order. ``layer`` is the layer the resource belongs to (``None`` for a
  plan-wide one); ``name`` says what it is, prefixed by its creator's name by
  convention (``"feedback_alignment"``, ``"synthetic/0/kernel_0"``).
  """

  def __init__(self, modules: Sequence[tf.Module] = ()):
    self._values: Dict[Key, Any] = {}
    self._modules = tuple(modules)

  def get_or_create(self, layer: Optional[str], name: str,
                    create: Callable[[], T]) -> T:
    """The value under ``(layer, name)``, made by ``create()`` at first."""
    key = (layer, name)
    if key not in self._values:
      self._values[key] = create()
    return self._values[key]

  def put(self, layer: Optional[str], name: str, value: Any) -> None:
    """Stores ``value`` under ``(layer, name)``, replacing an earlier one."""
    self._values[(layer, name)] = value

  def get(self, layer: Optional[str], name: str, default: Any = None) -> Any:
    """The value under ``(layer, name)``, or ``default``."""
    return self._values.get((layer, name), default)

  def keys(self) -> Tuple[Key, ...]:
    """Every ``(layer, name)`` key, in creation order."""
    return tuple(self._values)

  def of_layer(self, layer: Optional[str]) -> Dict[str, Any]:
    """``name -> value`` of one layer's resources."""
    return {n: v for (l, n), v in self._values.items() if l == layer}

  def variables(self) -> Tuple[tf.Variable, ...]:
    """Every ``tf.Variable`` the plan's transforms and methods made.

    Found among the values, inside lists, tuples and dicts, inside
    ``tf.Module`` values (a stateful method's state), and in the
    ``modules`` given at construction (a Keras plan's method variables).
    """
    found: Dict[int, tf.Variable] = {}
    for value in (*self._values.values(), *self._modules):
      for v in _variables_in(value):
        found.setdefault(id(v), v)
    return tuple(found.values())

  def __len__(self) -> int:
    return len(self._values)

  def __repr__(self) -> str:
    return f"Resources({list(self._values)})"


def _variables_in(value) -> List[tf.Variable]:
  if isinstance(value, tf.Variable):
    return [value]
  if isinstance(value, tf.Module):
    return list(value.variables)
  if isinstance(value, dict):
    value = list(value.values())
  if isinstance(value, (list, tuple)):
    return [v for item in value for v in _variables_in(item)]
  return []


@dataclasses.dataclass(frozen=True)
class TransformContext:
  """Where a transform is applied.

  Attributes:
    layer: name of the layer the gradient belongs to or flows out of.
    role: ``"upstream"``, ``"inputs"`` (``transform_inputs``),
      ``"gradients"`` or ``"edge"``.
    variable: the variable, for a parameter gradient; else ``None``.
    edge: ``(lower, upper)`` for an edge transform; else ``None``.
    tensor: the forward tensor whose gradient this is, when there is one.
    global_step: the plan's global step tensor, when one is known. A
      transform that reads it sets ``reads_global_step = True`` (see
      :class:`~graphgrad.transforms.Transform`), so that the plan's
      ``apply_gradients`` advances the step.
    resources: the plan's :class:`Resources`, where a stateful transform
      keeps what it creates, so that it is created once per plan.
  """
  layer: Optional[str] = None
  role: str = "upstream"
  variable: Optional[tf.Variable] = None
  edge: Optional[Tuple[str, str]] = None
  tensor: Optional[tf.Tensor] = None
  global_step: Optional[tf.Tensor] = None
  resources: Resources = dataclasses.field(default_factory=Resources)
