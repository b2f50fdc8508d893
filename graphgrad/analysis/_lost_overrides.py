"""Gradient overrides a graph carries but this process never registered.

``gradient_override_map({"Identity": "FlipGradient0"})`` records the name
``FlipGradient0`` in the op's ``_gradient_op_type`` attribute; the function
itself lives only in the Python process that ran ``@tf.RegisterGradient``. A
MetaGraph exported there and imported elsewhere keeps the name and loses the
function, so ``tf.gradients`` stops at the op with ``LookupError``.
:func:`find` names each such op and its override, and guesses from the
override's name and the op (never from the lost function, which is gone) the
plan declaration that restores it: a gradient reversal, a straight-through
estimator, or else an ``override_gradient`` the user writes.
"""

import dataclasses
import re
from typing import Dict, Iterable, List, Optional, Sequence

import tensorflow as tf

from graphgrad.analysis import _graph_limits, _no_gradient

_REVERSAL = re.compile(r"flip|revers|grl|negat", re.IGNORECASE)
_PASS = re.compile(r"straight|through|^ste|pass|identity", re.IGNORECASE)
_FACTOR = re.compile(r"(^|/)(l|lam|lamb|lambd?a|lamda|alpha|grl\w*|flip\w*|"
                     r"revers\w*)(_\d+)?$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class LostOverride:
  """An op whose gradient override is not registered in this process.

  Attributes:
    op: the op.
    override: the name its ``_gradient_op_type`` attribute holds
      (``"FlipGradient0"``).
    kind: ``"reversal"``, ``"straight_through"`` or ``"unknown"``: what the
      override looks like it did, from its name and the op.
    declaration: the plan line that restores that behaviour.
    hint: why graphgrad guesses ``kind``, and what to check.
  """
  op: tf.Operation
  override: str
  kind: str
  declaration: str
  hint: str

  def describe(self) -> str:
    """One sentence: the op, its lost override, the guess and the fix."""
    return (f"{self.op.name} (type {self.op.type}) carried the gradient "
            f"override {self.override!r} when its graph was built, and no "
            f"gradient function of that name is registered in this process "
            f"(@tf.RegisterGradient ran in the process that exported the "
            f"graph); {self.hint}: {self.declaration}")


def override_name(op: tf.Operation) -> Optional[str]:
  """The op's ``_gradient_op_type`` (its ``gradient_override_map`` name).

  Raises:
    GraphLimitError: if the attr holds no string, or bytes that are not
      UTF-8 (a saved graph is refused before import; an op given such an
      attr after it is refused here).
  """
  # Reading the NodeDef is several times cheaper than a failing get_attr.
  return _graph_limits.gradient_override(op.node_def)


def find(fwd_ops: Sequence[tf.Operation], layer_of: Dict[str, Optional[str]],
         consumers) -> List[LostOverride]:
  """The forward ops whose override name has no registered gradient.

  Args:
    fwd_ops: the forward ops, in graph order.
    layer_of: op name -> layer name (glue ops absent or ``None``).
    consumers: tensor name -> consuming forward ops.

  Returns:
    One :class:`LostOverride` per such op, in graph order.
  """
  found = []
  for op in fwd_ops:
    name = override_name(op) if op.inputs else None
    if name is None or _no_gradient.has_gradient(op):
      continue
    found.append(_guess(op, name, layer_of, consumers))
  return found


def _guess(op, name, layer_of, consumers) -> LostOverride:
  if op.type == "Identity" and _REVERSAL.search(name):
    lower = _one(_layers_behind(op, layer_of))
    upper = layer_of.get(op.name) or _one(
        _layers_ahead(op, layer_of, consumers))
    factor = _factor_near(op)
    edge = (f"plan.straight_through({op.name!r}).transform_edge("
            f"{lower or 'LOWER'!r}, {upper or 'UPPER'!r}, "
            f"gg.transforms.reverse(l))")
    where = ("" if lower and upper else
             "; name the layers below and above it for LOWER and UPPER")
    near = (f" and the scalar {factor!r} near it, which may be its factor"
            if factor else "")
    return LostOverride(
        op, name, "reversal", edge,
        f"its name looks like a gradient reversal (identity forward, -l * "
        f"gradient backward){near}; the factor l and the sign are not "
        f"recorded in the graph, so check them against the original code"
        f"{where}. straight_through gives the Identity a backward again and "
        f"the edge reverses what the upper layer sends the lower one")
  if op.type == "Round" or (op.type == "Identity" and _PASS.search(name)):
    return LostOverride(
        op, name, "straight_through", f"plan.straight_through({op.name!r})",
        f"a {op.type} under an override looks like a straight-through "
        f"estimator (the gradient passed through unchanged); check that "
        f"against the original code")
  return LostOverride(
      op, name, "unknown", f"plan.override_gradient({op.name!r}, fn)",
      "graphgrad cannot tell what the lost function did; write it again as "
      "fn(op, *output_grads) -> input grads")


def _one(names: Iterable[str]) -> Optional[str]:
  names = set(names)
  return names.pop() if len(names) == 1 else None


def _layers_behind(op, layer_of) -> List[str]:
  """The layers whose outputs reach ``op``'s inputs through glue only."""
  found, stack, seen = [], [t.op for t in op.inputs], set()
  while stack:
    o = stack.pop()
    if o.name in seen:
      continue
    seen.add(o.name)
    if layer_of.get(o.name):
      found.append(layer_of[o.name])
    else:
      stack.extend(t.op for t in o.inputs)
  return found


def _layers_ahead(op, layer_of, consumers) -> List[str]:
  """The layers that ``op``'s outputs reach through glue only."""
  found, stack, seen = [], [op], set()
  while stack:
    o = stack.pop()
    for t in o.outputs:
      for c in consumers.get(t.name, ()):
        if c.name in seen:
          continue
        seen.add(c.name)
        if layer_of.get(c.name):
          found.append(layer_of[c.name])
        else:
          stack.append(c)
  return found


def _factor_near(op) -> Optional[str]:
  """A scalar float placeholder or constant named like a reversal factor.

  The classic ``flip_gradient(x, l)`` closes over ``l``, so a placeholder
  ``l`` fed per step sits in the graph with no edge to the op; its name is
  the only link. Scalars in the op's own name scope come first.
  """
  scope = op.name.rsplit("/", 1)[0] + "/" if "/" in op.name else ""
  best = None
  for other in op.graph.get_operations():
    if other.type not in ("Placeholder", "PlaceholderWithDefault", "Const"):
      continue
    out = other.outputs[0]
    if (not out.dtype.is_floating or out.shape.rank != 0
        or not _FACTOR.search(other.name)):
      continue
    if scope and other.name.startswith(scope):
      return other.name
    best = best or other.name
  return best
