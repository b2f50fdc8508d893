"""The gradient-flow report both plans make: its figures and its flags.

``gg.gradient_report`` measures, per layer, ``grad_norm`` (the global norm
of its parameter gradients), ``grad_to_weight`` (that over its variables'
norm), ``upstream_norm`` (the norm of the upstream gradient at its outputs)
and ``zero_upstream`` (its fraction of exact zeros), the mean over the
batches; with a plan each comes ``before`` (the chain rule) and ``after``
(where it exists). ``plan/_report`` runs it in a ``Session``,
``keras/_tape_report`` in a ``tf.function``. A layer is *vanishing* when
``log10`` of its grad norm (``after`` with a plan) lies more than
``threshold`` below the median ``log10`` norm of the output layers (those
that feed no layer) its outputs reach, *exploding* when more than that
above both that and the median of all layers; an output layer is never
flagged but for *no gradient*, when none of its variables gets one.
"""

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import networkx as nx
import numpy as np

from graphgrad import _errors

_FIGURES = ("grad_norm", "grad_to_weight", "upstream_norm", "zero_upstream")


class GradientReport:
  """Per-layer gradient figures of one loss; made by :func:`gradient_report`.

  Attributes:
    loss: name of the loss tensor.
    batches: how many batches the figures are averaged over.
    threshold: the flag threshold, in orders of magnitude.
    has_plan: whether the figures have ``after`` values.
    layers: one dict per layer, in topological order, with keys ``name``,
      ``params``, ``flag`` (``"vanishing"``, ``"exploding"``,
      ``"no gradient"`` or ``None``)
      and, for each figure, ``{"before": x, "after": y}`` (``after`` is
      ``None`` without a plan or where the plan does not materialise it).
  """

  def __init__(self, loss: str, layers: List[Dict[str, Any]], batches: int,
               threshold: float, has_plan: bool):
    self.loss = loss
    self.layers = layers
    self.batches = batches
    self.threshold = threshold
    self.has_plan = has_plan

  def __getitem__(self, name: str) -> Dict[str, Any]:
    for row in self.layers:
      if row["name"] == name:
        return row
    raise _errors.layer_not_found(name, [r["name"] for r in self.layers])

  def flagged(self) -> Dict[str, str]:
    """Layer name -> ``"vanishing"``, ``"exploding"`` or ``"no gradient"``,
    for flagged layers."""
    return {r["name"]: r["flag"] for r in self.layers if r["flag"]}

  def to_dict(self) -> Dict[str, Any]:
    """A JSON-serialisable dict of everything in the report."""
    return {"loss": self.loss, "batches": self.batches,
            "threshold": self.threshold, "has_plan": self.has_plan,
            "layers": [dict(r) for r in self.layers]}

  @classmethod
  def from_dict(cls, data: Dict[str, Any]) -> "GradientReport":
    """The report :meth:`to_dict` wrote, checked entry by entry (it may come
    from a process that read an untrusted model).

    Raises:
      ValueError: naming the first entry that is not what ``to_dict``
        writes.
    """
    def want(value, kinds, what):
      kinds = kinds if isinstance(kinds, tuple) else (kinds,)
      if not isinstance(value, kinds) or (isinstance(value, bool)
                                          and bool not in kinds):
        raise ValueError(f"{what} is {type(value).__name__}")
      return value

    def number(value, what):
      if value is None:
        return None
      return float(want(value, (int, float), what))

    want(data, dict, "the report")
    layers = []
    for i, row in enumerate(want(data["layers"], list, "layers")):
      want(row, dict, f"layer {i}")
      flag = row["flag"]
      if flag not in (None, "vanishing", "exploding", "no gradient"):
        raise ValueError(f"layer {i}'s flag is {flag!r}")
      clean = {"name": want(row["name"], str, f"layer {i}'s name"),
               "params": want(row["params"], int, f"layer {i}'s params"),
               "flag": flag}
      for key in _FIGURES:
        pair = want(row[key], dict, f"layer {i}'s {key}")
        clean[key] = {side: number(pair.get(side), f"{key}.{side}")
                      for side in ("before", "after")}
      layers.append(clean)
    return cls(want(data["loss"], str, "loss"), layers,
               want(data["batches"], int, "batches"),
               float(want(data["threshold"], (int, float), "threshold")),
               want(data["has_plan"], bool, "has_plan"))

  def table(self) -> str:
    """A text table, one row per layer; ``before -> after`` with a plan."""
    head = ("layer", "params", "grad norm", "grad/weight", "upstream norm",
            "zero upstream", "flag")
    rows = [head]
    for r in self.layers:
      rows.append((r["name"], f"{r['params']:,}",
                   self._cell(r["grad_norm"]), self._cell(r["grad_to_weight"]),
                   self._cell(r["upstream_norm"]),
                   self._cell(r["zero_upstream"], percent=True),
                   r["flag"] or ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"loss {self.loss}; mean over {self.batches} batch(es); "
                 f"vanishing when log10(grad norm) is more than "
                 f"{self.threshold:g} below that of the output layers it "
                 f"reaches, exploding when more than {self.threshold:g} "
                 f"above both theirs and the median of all layers, 'no "
                 f"gradient' when none of its variables gets one")
    return "\n".join(lines)

  def _cell(self, pair: Dict[str, Optional[float]], percent=False) -> str:
    fmt = (lambda x: "-" if x is None else f"{100 * x:.1f}%") if percent else (
        lambda x: "-" if x is None else f"{x:.3g}")
    if not self.has_plan:
      return fmt(pair["before"])
    return f"{fmt(pair['before'])} -> {fmt(pair['after'])}"

  def plot(self, path: str, title: Optional[str] = None) -> str:
    """Draws the figures of every layer, in topological order, on a log scale.

    Args:
      path: the picture's file name (``.png``, ``.svg`` or ``.pdf``).
      title: the picture's title; defaults to the loss name.

    Returns:
      ``path``.

    Raises:
      GraphGradError: for another file extension, or without matplotlib.
    """
    from graphgrad.core import _report_plot  # pylint: disable=g-import-not-at-top
    return _report_plot.plot(self, path, title)

  def __repr__(self) -> str:
    return (f"GradientReport(loss={self.loss}, layers={len(self.layers)}, "
            f"flagged={self.flagged()})")


def check_counts(batches: Any, threshold: Any) -> None:
  """Refuses a ``batches`` or ``threshold`` of the wrong kind."""
  if not isinstance(batches, int) or isinstance(batches, bool) or batches < 1:
    raise _errors.GraphGradError(
        f"gradient_report: `batches` must be a positive int; got "
        f"{batches!r}.")
  if (not isinstance(threshold, (int, float)) or isinstance(threshold, bool)
      or not threshold > 0 or math.isinf(threshold)):
    raise _errors.GraphGradError(
        f"gradient_report: `threshold` must be a positive finite number of "
        f"orders of magnitude; got {threshold!r}. The default is 2.0.")


def _dense_values(value) -> np.ndarray:
  """The entries of a fetched gradient, duplicates of sparse rows summed."""
  if hasattr(value, "indices") and hasattr(value, "values"):
    idx, inverse = np.unique(np.asarray(value.indices), return_inverse=True)
    vals = np.asarray(value.values)
    summed = np.zeros((len(idx),) + vals.shape[1:], vals.dtype)
    np.add.at(summed, inverse.reshape(-1), vals)
    return summed
  return np.asarray(value)


def _norm(values: Sequence) -> Optional[float]:
  arrays = [_dense_values(v) for v in values]
  arrays = [a for a in arrays if a.size]
  if not arrays:
    return None
  return float(math.sqrt(sum(float(np.sum(np.square(a.astype(np.float64))))
                             for a in arrays)))


def _zero_fraction(values: Sequence) -> Optional[float]:
  arrays = [np.asarray(v) for v in values]
  arrays = [a for a in arrays if a.size]
  if not arrays:
    return None
  total = sum(a.size for a in arrays)
  return float(sum(int(np.sum(a == 0)) for a in arrays) / total)


def _mean(xs: Sequence[Optional[float]]) -> Optional[float]:
  present = [x for x in xs if x is not None]
  return float(np.mean(present)) if present else None


def _figures(run: Dict[str, Any], suffix: str) -> Dict[str, Optional[float]]:
  grad = _norm(run["grads" + suffix])
  weight = _norm(run["weights"])
  ups = run["upstream" + suffix]
  return {
      "grad_norm": grad,
      "grad_to_weight": (grad / weight if grad is not None and weight
                         else None),
      "upstream_norm": _norm(ups),
      "zero_upstream": _zero_fraction(ups),
  }


def layer_row(name: str, params: int, runs: List[Dict[str, Any]]):
  """The report's row of one layer: each figure's mean over the batches.

  ``runs`` holds, per batch, the layer's fetched ``weights``, ``grads`` and
  ``upstream`` (with a plan also ``grads_after`` and ``upstream_after``).
  """
  before = [_figures(r, "") for r in runs]
  after = ([_figures(r, "_after") for r in runs] if "grads_after" in runs[0]
           else None)
  row: Dict[str, Any] = {"name": name, "params": params}
  for key in _FIGURES:
    row[key] = {"before": _mean([f[key] for f in before]),
                "after": _mean([f[key] for f in after]) if after else None}
  row["flag"] = None
  return row


def flag(rows: List[Dict[str, Any]], feeds: Callable[[str], Set[str]],
         threshold: float) -> None:
  """Sets ``row["flag"]`` by the rule in the module docstring.

  Vanishing and exploding gradients shrink or grow as they flow from the
  loss down through the layers, so each layer is measured against the
  layers the gradient starts from: the output layers on its output side.
  A layer deep under a tiny output layer is vanishing however many layers
  share its fate; exploding also asks for more than the typical layer,
  so that one output layer with a small gradient of its own (a small
  input) does not make every other layer exploding.

  Args:
    rows: the report's rows, from :func:`layer_row`.
    feeds: layer name -> the layers its outputs feed directly.
    threshold: orders of magnitude.
  """
  key = "after" if any(r["grad_norm"]["after"] is not None for r in rows) else (
      "before")
  norm = {r["name"]: r["grad_norm"][key] for r in rows}
  logs = {n: math.log10(x) for n, x in norm.items() if x}
  flow = nx.DiGraph()
  flow.add_nodes_from(norm)
  flow.add_edges_from((n, m) for n in norm for m in feeds(n)
                      if m in norm and m != n)
  outputs = {n for n in flow if not flow.out_degree(n)}
  typical = float(np.median(list(logs.values()))) if logs else 0.0
  for r in rows:
    name = r["name"]
    mine = norm[name]
    if mine is None:  # not one variable of the layer has a gradient
      r["flag"] = "no gradient"
      continue
    ends = [logs[n] for n in sorted(nx.descendants(flow, name) & outputs)
            if n in logs]
    if not ends:  # an output layer, or one only zero gradients reach
      continue
    if mine == 0:
      r["flag"] = "vanishing"
      continue
    reference = float(np.median(ends))
    if logs[name] < reference - threshold:
      r["flag"] = "vanishing"
    elif logs[name] > max(reference, typical) + threshold:
      r["flag"] = "exploding"

