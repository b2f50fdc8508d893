"""A Keras model's layer tree: layers by path and name, and their variables.

Works for Keras 3 (``keras``, ``tf.keras`` on TF 2.16+) and tf-keras alike.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from graphgrad import _compat, _errors
from graphgrad.core._gradients import is_float


def is_keras_layer(obj) -> bool:
  """True for a Keras 3 or tf-keras layer or model."""
  return _compat.has_sublayers_api(obj)


def tf_variable(v) -> Optional[tf.Variable]:
  """The ``tf.Variable`` behind a tf-keras or Keras 3 variable."""
  inner = getattr(v, "_variable", None)
  if isinstance(inner, tf.Variable):
    # tf-keras' AutoCastVariable (mixed precision): a layer's call reads the
    # float32 variable it wraps, and gradients are keyed by that one.
    return inner
  if isinstance(v, tf.Variable):
    return v
  inner = getattr(v, "value", None)  # Keras 3 wraps a tf.Variable
  return inner if isinstance(inner, tf.Variable) else None


def float_inputs(call: Callable, args, kwargs
                 ) -> Tuple[List[Any], Callable[..., Any]]:
  """A layer call's floating-point inputs ``xs``, and ``run(*xs)``: the call
  with those inputs replaced by ``xs`` (the rest as they were)."""
  return inputs_where(call, args, kwargs, is_float)


def inputs_where(call: Callable, args, kwargs, pick: Callable[[Any], bool]
                 ) -> Tuple[List[Any], Callable[..., Any]]:
  """The inputs ``xs`` of a layer call (nested in lists and dicts too) that
  ``pick`` chooses, and ``run(*xs)``: the call with those inputs replaced
  by ``xs`` (the rest as they were)."""
  flat = tf.nest.flatten((args, kwargs))
  idx = [i for i, a in enumerate(flat) if pick(a)]

  def run(*xs):
    flat_in = list(flat)
    for i, t in zip(idx, xs):
      flat_in[i] = t
    args_in, kwargs_in = tf.nest.pack_sequence_as((args, kwargs), flat_in)
    return call(*args_in, **kwargs_in)

  return [flat[i] for i in idx], run


def layer_variables(layer) -> List[tf.Variable]:
  """A layer's variables, nested layers' included, as ``tf.Variable``."""
  return [u for u in map(tf_variable, layer.weights) if u is not None]


def direct_variables(layer) -> List[tf.Variable]:
  """The variables ``layer`` holds directly, not in sublayers."""
  nested = {v.ref() for child in _compat.sublayers(layer)
            for v in layer_variables(child)}
  return [v for v in layer_variables(layer) if v.ref() not in nested]


def holds_variables(layer) -> bool:
  """True when ``layer`` holds variables directly, not only in sublayers."""
  return bool(direct_variables(layer))


def check_parameters(index: "LayerIndex", path: str) -> None:
  """Refuses ``transform_gradients`` on a layer without trainable variables.

  A built layer whose weights are all non-trainable (``layer.trainable =
  False``, a frozen backbone) or that holds no weights at all (``Dropout``,
  ``Activation``) has no parameter gradient to rewrite, so the declaration
  could only be a silent no-op. An unbuilt layer is not checked: its
  variables do not exist yet.

  Raises:
    GraphGradError: naming the layer and what it holds.
  """
  layer = index[path]
  weights = list(layer.weights)
  if layer.trainable_weights or not (weights or getattr(layer, "built", False)):
    return
  known = [p for p in index.paths
           if holds_variables(index[p]) and index[p].trainable_weights]
  others = (f"transform a layer with trainable variables: "
            f"{', '.join(known) or '(none)'}")
  if weights:
    names = ", ".join(getattr(v, "path", None) or v.name for v in weights[:6])
    raise _errors.GraphGradError(
        f"transform_gradients: layer {path!r} holds only non-trainable "
        f"variables ({names}), which get no gradient, so there is nothing to "
        f"transform. Make them trainable (layer.trainable = True) before "
        f"declaring, or {others}.")
  raise _errors.GraphGradError(
      f"transform_gradients: layer {path!r} holds no variables, so it has no "
      f"parameter gradients to transform. Use transform_upstream({path!r}, "
      f"fn) for the gradient it passes below, or {others}.")


def check_group_parameters(index: "LayerIndex", paths) -> None:
  """Refuses a group ``transform_gradients`` whose layers all fail
  :func:`check_parameters`; a group may hold layers without variables.

  Raises:
    GraphGradError: the first layer's refusal, when none has parameters.
  """
  first = None
  for path in paths:
    try:
      check_parameters(index, path)
      return
    except _errors.GraphGradError as e:
      first = first or e
  if first is not None:
    raise first


def nothing_below(model, path: str) -> Tuple[bool, List[str]]:
  """Whether no layer with trainable variables can feed ``path``, and the
  layers right above it, in a ``Sequential`` or functional model.

  Their ``model.layers`` is in topological order, so every layer that feeds
  a top-level layer comes before it. Anything else (a nested path, a
  subclassed model, an unbuilt layer before it) answers ``(False, [])``:
  unknown, so nothing to warn about.
  """
  kinds = {c.__name__ for c in type(model).__mro__}
  layers = list(getattr(model, "layers", ()) or ())
  names = [l.name for l in layers]
  if "/" in path or not kinds & {"Sequential", "Functional"} or (
      path not in names):
    return False, []
  i = names.index(path)
  before = layers[:i]
  if not all(getattr(l, "built", False) for l in before):
    return False, []
  if any(l.trainable_weights for l in before):
    return False, []
  above = ([l.name for l in layers[i + 1:i + 2]]
           if "Sequential" in kinds else [])
  return True, above


class LayerIndex:
  """Every layer of a model's tree, by path and by Keras name.

  Args:
    model: a Keras model or layer.

  Example:
    >>> import tensorflow as tf
    >>> model = tf.keras.Sequential([tf.keras.layers.Dense(2, name="a")])
    >>> index = LayerIndex(model)
    >>> index.paths, index.find("a", "layer")
    (('a',), 'a')
  """

  def __init__(self, model):
    self._layers: Dict[str, Any] = {}
    self._by_id: Dict[int, str] = {}
    stack = [(c, c.name) for c in reversed(_compat.sublayers(model))]
    while stack:
      layer, path = stack.pop()
      if id(layer) in self._by_id:  # a layer shared by two parents
        continue
      self._by_id[id(layer)] = path
      self._layers[path] = layer
      stack += [(c, f"{path}/{c.name}")
                for c in reversed(_compat.sublayers(layer))]

  @property
  def paths(self) -> Tuple[str, ...]:
    """Every layer's path, parents before their children."""
    return tuple(self._layers)

  def __getitem__(self, path: str):
    return self._layers[path]

  def find(self, layer, arg: str) -> str:
    """The path of ``layer`` (a name, a path or the layer itself).

    Raises:
      LayerNotFoundError: for a layer that is not in the model, or a name
        that several nested layers share.
    """
    if not isinstance(layer, str):
      if id(layer) in self._by_id:
        return self._by_id[id(layer)]
      raise _errors.LayerNotFoundError(
          f"`{arg}` must be a layer name or a layer of the model; got "
          f"{type(layer).__name__} {getattr(layer, 'name', layer)!r}, which "
          f"is not in the model. Known layers: {', '.join(self.paths)}.")
    if layer in self._layers:
      return layer
    matches = [p for p in self.paths if p.rsplit("/", 1)[-1] == layer]
    if len(matches) == 1:
      return matches[0]
    if matches:
      raise _errors.LayerNotFoundError(
          f"`{arg}` {layer!r} names {len(matches)} nested layers: "
          f"{', '.join(matches)}. Pass the path of the one you mean.")
    raise _errors.LayerNotFoundError(
        f"no layer named {layer!r} in the model; known layers: "
        f"{', '.join(self.paths) or '(none)'}. Use the Keras name of one of "
        f"them (layer.name), or its 'outer/inner' path.")


class CallPatches:
  """Keras layers whose ``call`` is replaced for a while, put back in reverse.

  The replacement is set on the layer instance, so the class and every other
  instance keep their own ``call``; :meth:`restore` removes it again (or puts
  back a ``call`` the instance held before).
  """

  def __init__(self):
    self._saved: List[Tuple[Any, bool, Any]] = []

  def replace(self, layer, call) -> None:
    """Makes ``call`` the ``call`` of ``layer``, until :meth:`restore`."""
    had = "call" in layer.__dict__
    self._saved.append((layer, had, layer.__dict__.get("call")))
    object.__setattr__(layer, "call", call)

  def restore(self) -> None:
    """Puts back every replaced ``call``, the last replaced first."""
    while self._saved:
      layer, had, call = self._saved.pop()
      if had:
        object.__setattr__(layer, "call", call)
      else:
        object.__delattr__(layer, "call")
