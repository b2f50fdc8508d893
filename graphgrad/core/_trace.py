"""What a plan did to the gradients: the figures of its trace.

The backward pass records a ``TraceRecord`` (``core._layer_step``) for
every transform it applies (a layer's upstream or inputs, an edge, a
parameter gradient): where, the gradient before and the gradient after.
:func:`figures` reads a trace and the plan's final ``(gradient,
variable)`` pairs into the figures its summaries show, the same for
``GradientPlan.summaries()`` (``tf.compat.v1.summary``) and
``KerasPlan.summaries()`` (``tf.summary``): per layer the norm of its
parameter gradients before and after its own transforms, and at every
rewritten upstream, layer's inputs or edge the norm before and after.
Under a loss scale every figure is of the unscaled gradient.
"""

import collections
import dataclasses
from typing import (
  Any,
  Callable,
  Dict,
  List,
  Optional,
  Sequence,
  Tuple,
)

import tensorflow as tf

from graphgrad._types import Gradient, gradient_values
from graphgrad.core._layer_step import TraceRecord


@dataclasses.dataclass(frozen=True)
class Figure:
  """One ``before``/``after`` pair of norms: ``tag/before``, ``tag/after``.

  Attributes:
    tag: ``grad_norm/<layer>``, ``upstream_norm/<layer>``,
      ``inputs_norm/<layer>`` or ``edge_norm/<lower>_to_<upper>``.
    before: the gradients before, each with its loss scale or ``None``.
    after: the gradients after, likewise.
  """
  tag: str
  before: Tuple[Tuple[Gradient, Any], ...]
  after: Tuple[Tuple[Gradient, Any], ...]

  def norms(self) -> Tuple[tf.Tensor, tf.Tensor]:
    """``(before, after)`` global norms; one op when they are the same."""
    after = global_norm(self.after, "norm")
    same = len(self.before) == len(self.after) and all(
        b is a for (b, _), (a, _) in zip(self.before, self.after))
    return (after if same else global_norm(self.before, "norm_before"),
            after)


def global_norm(grads: Sequence[Tuple[Gradient, Any]],
                name: str) -> tf.Tensor:
  """The global norm of the unscaled ``grads`` (a sparse one's values),
  in float32."""
  values = []
  for g, scale in grads:
    v = tf.cast(gradient_values(g), tf.float32)
    values.append(v if scale is None else v / tf.cast(scale, tf.float32))
  return tf.linalg.global_norm(values, name=name)


def figures(trace: Sequence[TraceRecord],
            pairs: Sequence[Tuple[Gradient, Any]],
            layer_of: Callable[[Any], Optional[str]],
            layers: Sequence[str], scale: Any = None) -> List[Figure]:
  """The summaries' figures of a plan's ``trace`` and final ``pairs``.

  Args:
    trace: the plan's records, in the order they were made.
    pairs: the plan's final ``(gradient, variable)`` pairs.
    layer_of: variable -> the name of the layer it belongs to, or ``None``.
    layers: the layer names, in the order the figures are listed.
    scale: the loss scale ``pairs`` are multiplied by, or ``None``.

  Returns:
    ``grad_norm`` of every layer with a gradient, then ``upstream_norm``
    of every layer with a rewritten upstream, then ``inputs_norm`` of every
    layer whose inputs' gradients are rewritten, then ``edge_norm`` of
    every rewritten edge.
  """
  first: Dict[Any, Tuple[Gradient, Any]] = {}  # variable -> its first before
  upstream: Dict[str, Tuple[list, list]] = collections.defaultdict(
      lambda: ([], []))
  inputs: Dict[str, Tuple[list, list]] = collections.defaultdict(
      lambda: ([], []))
  edges: Dict[Tuple[str, str], Tuple[list, list]] = collections.defaultdict(
      lambda: ([], []))
  for record in trace:
    ctx, before, after = record
    if before is None or after is None:
      continue
    if ctx.role == "gradients" and ctx.variable is not None:
      first.setdefault(ctx.variable.ref(), (before, record.scale))
    elif ctx.role in ("upstream", "inputs", "edge"):
      pair = (edges[ctx.edge] if ctx.role == "edge" else
              (upstream if ctx.role == "upstream" else inputs)[ctx.layer])
      pair[0].append((before, record.scale))
      pair[1].append((after, record.scale))

  by_layer: Dict[str, list] = collections.defaultdict(list)
  for g, v in pairs:
    layer = None if v is None else layer_of(v)
    if g is not None and layer is not None:
      by_layer[layer].append((g, v))

  out = []
  for layer in layers:
    own = by_layer.get(layer)
    if own:
      after = tuple((g, scale) for g, _ in own)
      before = tuple(first.get(v.ref(), (g, scale)) for g, v in own)
      out.append(Figure(f"grad_norm/{layer}", before, after))
  for layer in layers:
    if layer in upstream:
      before, after = upstream[layer]
      out.append(Figure(f"upstream_norm/{layer}", tuple(before),
                        tuple(after)))
  for layer in layers:
    if layer in inputs:
      before, after = inputs[layer]
      out.append(Figure(f"inputs_norm/{layer}", tuple(before), tuple(after)))
  for (lo, up), (before, after) in sorted(edges.items()):
    out.append(Figure(f"edge_norm/{lo}_to_{up}", tuple(before), tuple(after)))
  return out


def histograms(trace: Sequence[TraceRecord],
               pairs: Sequence[Tuple[Gradient, Any]],
               name_of: Callable[[Any], str],
               scale: Any = None) -> List[Tuple[str, tf.Tensor]]:
  """``(tag, values)`` of the histograms: each final parameter gradient
  (``grad_hist/<variable>``), and each rewritten upstream gradient
  (``upstream_hist/<layer>``), unscaled."""
  out = []
  for g, v in pairs:
    if g is not None and v is not None:
      out.append((f"grad_hist/{name_of(v)}", _unscaled(g, scale)))
  for record in trace:
    ctx = record.context
    if ctx.role == "upstream" and record.before is not None:
      after = record.after
      if after is not None:
        out.append((f"upstream_hist/{ctx.layer}",
                    _unscaled(after, record.scale)))
  return out


def _unscaled(g: Gradient, scale: Any) -> tf.Tensor:
  values = gradient_values(g)
  if scale is None:
    return values
  return tf.cast(values, tf.float32) / tf.cast(scale, tf.float32)
