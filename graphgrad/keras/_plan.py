"""KerasPlan: the gradient plans of GradientPlan for TF2 Keras models.

TF2 code has no graph to analyse before it runs: a Keras model's layer
outputs exist only while the model is called. A :class:`KerasPlan` therefore
finds layers by their Keras name in the model's layer tree and rewrites
gradients while the forward pass runs under :meth:`KerasPlan.tape`, which
intercepts the targeted layers' ``call`` (see ``_keras_tape``). The model's
code is not changed, and everything is restored when the tape closes.

It works with Keras 3 (``keras``, and ``tf.keras`` on TF 2.16+) and with
tf-keras, for subclassed, functional and ``Sequential`` models, eagerly and
inside ``tf.function``.
"""

import logging
from typing import Any, Dict, List, Tuple, Union

from graphgrad import _errors
from graphgrad.keras._tape import PlanTape, children, layer_variables
from graphgrad.transforms._context import Resources
from graphgrad.transforms._transforms import (
  Transform,
  as_transform,
  chain,
  is_identity,
)

log = logging.getLogger("graphgrad")

LayerRef = Union[str, Any]  # a Keras layer name or path, or the layer itself


class KerasPlan:
  """Rewrites gradients at the layer boundaries of a Keras model.

  The semantics are those of :class:`GradientPlan`, with a layer being a
  Keras layer and its outputs the tensors its ``call`` returns:

  * ``transform_upstream(L, fn)``: with ``g`` the gradient at ``L``'s outputs
    (summed over all consumers), ``L``'s own variables get their gradients
    from ``g``; ``L``'s inputs, and everything below them, get what
    backpropagating ``fn(g)`` through ``L`` gives. Paths that bypass ``L``
    (skips, regularizers, second heads) are unchanged. Transforms on several
    layers compose top-down. A layer called several times is rewritten at
    each call.
  * ``transform_gradients(L, fn)``: each of ``L``'s parameter gradients,
    summed over all paths, becomes ``fn(g)``.
  * ``transform_edge(lower, upper, fn)``: only the gradient ``upper`` sends
    into ``lower``'s outputs directly, through ops and layers that hold no
    variables, is rewritten: ``upper``'s upstream transform, then the edge
    transform, then the sum at ``lower``'s outputs, then ``lower``'s
    upstream transform.

  A layer's variables are its Keras ``weights``, nested layers' included.
  Names are Keras layer names; a nested layer is found by its own name, or
  by its path ``"outer/inner"`` when the name is not unique.

  With no transforms, or only identity ones, the tape adds no op at all:
  its gradients are those of a plain ``tf.GradientTape``.

  Args:
    model: a Keras model or layer (Keras 3 or tf-keras).
    global_step: optional step counter handed to transforms in their
      context, e.g. ``optimizer.iterations``.
    name: name scope for the ops graphgrad adds.

  Raises:
    GraphGradError: if ``model`` is not a Keras layer.

  Example:
    >>> import tensorflow as tf, graphgrad as gg
    >>> model = tf.keras.Sequential([
    ...     tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
    ...                           name="l1"),
    ...     tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="ones",
    ...                           name="l2")])
    >>> plan = gg.KerasPlan(model).transform_upstream("l2", gg.transforms.scale(0.5))
    >>> with plan.tape() as tape:
    ...   loss = tf.reduce_sum(model(tf.constant([[2.0]])))
    >>> [g.numpy().tolist() for g in tape.gradient(loss)]
    [[[1.0]], [[2.0]]]
  """

  def __init__(self, model: Any, global_step=None, name: str = "graphgrad"):
    if not callable(getattr(model, "_flatten_layers", None)):
      raise _errors.GraphGradError(
          f"`model` must be a Keras model or layer (Keras 3 or tf-keras); got "
          f"{type(model).__name__}. For a tf.compat.v1 graph use "
          f"gg.GradientPlan(loss).")
    self.model = model
    self.global_step = global_step
    self._name = name
    self._upstream: Dict[str, List[Transform]] = {}
    self._gradients: List[Tuple[str, Transform]] = []
    self._edges: Dict[Tuple[str, str], List[Transform]] = {}
    self._frozen = False
    self._resources = Resources()
    self._index = _LayerIndex(model)

  # -- declaring -----------------------------------------------------------

  def transform_upstream(self, layer: LayerRef, fn) -> "KerasPlan":
    """Rewrites the gradient that ``layer`` passes to everything below it.

    Args:
      layer: a Keras layer name (or ``"outer/inner"`` path, or the layer).
      fn: a transform or a callable ``g -> g`` keeping shape and dtype.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is not in the model.
      GraphGradError: if ``fn`` is not callable or a tape was opened.
    """
    name = self._declare(layer, "layer")
    self._upstream.setdefault(name, []).append(as_transform(fn))
    return self

  def transform_gradients(self, layer: LayerRef, fn) -> "KerasPlan":
    """Rewrites each of ``layer``'s own parameter gradients.

    Args:
      layer: a Keras layer name (or ``"outer/inner"`` path, or the layer).
      fn: a transform or a callable ``g -> g`` keeping shape and dtype.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if ``layer`` is not in the model.
      GraphGradError: if ``fn`` is not callable or a tape was opened.
    """
    name = self._declare(layer, "layer")
    self._gradients.append((name, as_transform(fn)))
    return self

  def transform_edge(self, lower: LayerRef, upper: LayerRef, fn) -> "KerasPlan":
    """Rewrites only the gradient ``upper`` sends directly into ``lower``.

    Args:
      lower: the layer nearer the input.
      upper: the layer nearer the loss, fed by ``lower``'s outputs through
        ops and layers without variables.
      fn: a transform or a callable ``g -> g`` keeping shape and dtype.

    Returns:
      The plan, for chaining.

    Raises:
      LayerNotFoundError: if either name is not in the model.
      GraphGradError: if both name one layer, ``fn`` is not callable or a
        tape was opened. When ``upper``'s backward finds no gradient into
        ``lower``'s outputs, ``tape.gradient`` raises ``NotConnectedError``.
    """
    lo = self._declare(lower, "lower")
    up = self._declare(upper, "upper")
    if lo == up:
      raise _errors.GraphGradError(
          f"transform_edge: `lower` and `upper` are both {lo!r}; an edge joins "
          f"two layers. Use transform_upstream({lo!r}, fn) instead.")
    self._edges.setdefault((lo, up), []).append(as_transform(fn))
    return self

  # -- running -------------------------------------------------------------

  def tape(self, persistent: bool = False,
           watch_accessed_variables: bool = True) -> PlanTape:
    """A ``tf.GradientTape`` that applies this plan.

    Run the forward pass inside ``with plan.tape() as tape:``, then call
    ``tape.gradient(loss)``: it returns the gradients of
    ``model.trainable_variables`` (or of ``sources``) with the plan applied.
    Use it eagerly or inside a ``tf.function``; the plan is fixed once a
    tape is opened.

    Args:
      persistent: as for ``tf.GradientTape``.
      watch_accessed_variables: as for ``tf.GradientTape``.

    Returns:
      A :class:`PlanTape` context manager.
    """
    if not self._frozen:
      self._frozen = True
      log.info("graphgrad KerasPlan on %s: %d upstream, %d gradient, "
               "%d edge transforms", self.model.name, len(self._upstream),
               len(self._gradients), len(self._edges))
    return PlanTape(self, persistent, watch_accessed_variables)

  @property
  def layer_names(self) -> List[str]:
    """Paths of every layer in the model, e.g. ``["block", "block/dense"]``."""
    return list(self._index.paths)

  # -- what the tape reads -------------------------------------------------

  def _upstream_fns(self) -> Dict[str, Transform]:
    out = {}
    for name, fns in self._upstream.items():
      fn = fns[0] if len(fns) == 1 else chain(*fns)
      if not is_identity(fn):  # identity needs no interception at all
        out[name] = fn
    return out

  def _edge_fns(self) -> Dict[Tuple[str, str], Transform]:
    return {k: (fns[0] if len(fns) == 1 else chain(*fns))
            for k, fns in self._edges.items()}

  def _layer(self, path: str):
    return self._index.layers[path]

  def _all_layers(self):
    return self._index.layers

  def _own_refs(self, path: str) -> set:
    return {v.ref() for v in layer_variables(self._layer(path))}

  # -- helpers -------------------------------------------------------------

  def _declare(self, layer, arg: str) -> str:
    if self._frozen:
      raise _errors.GraphGradError(
          "this KerasPlan is fixed: a tape was already opened with "
          "plan.tape(), and a traced tf.function would not see a new "
          "transform. Declare every transform before the first plan.tape(), "
          "or make a new gg.KerasPlan.")
    return self._index.find(layer, arg)

  def __repr__(self):
    return (f"KerasPlan(model={self.model.name}, "
            f"upstream={sorted(self._upstream)}, "
            f"gradients={sorted({n for n, _ in self._gradients})}, "
            f"edges={sorted(self._edges)})")


class _LayerIndex:
  """Every layer of a model's tree, by path and by Keras name."""

  def __init__(self, model):
    self.layers: Dict[str, Any] = {}
    self.paths: List[str] = []
    self._by_id: Dict[int, str] = {}
    stack = [(c, c.name) for c in reversed(children(model))]
    while stack:
      layer, path = stack.pop()
      if id(layer) in self._by_id:  # a layer shared by two parents
        continue
      self._by_id[id(layer)] = path
      self.layers[path] = layer
      self.paths.append(path)
      stack += [(c, f"{path}/{c.name}") for c in reversed(children(layer))]

  def find(self, layer, arg: str) -> str:
    if not isinstance(layer, str):
      if id(layer) in self._by_id:
        return self._by_id[id(layer)]
      raise _errors.LayerNotFoundError(
          f"`{arg}` must be a layer name or a layer of the model; got "
          f"{type(layer).__name__} {getattr(layer, 'name', layer)!r}, which "
          f"is not in the model. Known layers: {', '.join(self.paths)}.")
    if layer in self.layers:
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
