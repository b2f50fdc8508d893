"""The picture of a :class:`~graphgrad.plan._report.GradientReport`.

One matplotlib figure: layers on the x axis in topological order, the
gradient norms on a log-scale y axis (solid: plain chain rule; dashed: after
the plan), the fraction of zero upstream entries as grey bars on a second
axis, and flagged layers marked in red.
"""

import os

import numpy as np

from graphgrad import _errors, _installed

_FORMATS = (".png", ".svg", ".pdf")
_SERIES = (("grad_norm", "parameter-gradient norm", "C0"),
           ("grad_to_weight", "gradient / weight norm", "C2"),
           ("upstream_norm", "upstream norm at outputs", "C1"))


def _values(report, key, side):
  out = []
  for r in report.layers:
    x = r[key][side]
    out.append(np.nan if x is None or x <= 0 else x)
  return np.array(out, dtype=float)


def plot(report, path: str, title=None) -> str:
  """Writes the report's picture to ``path``; see ``GradientReport.plot``."""
  path = str(path)
  if os.path.splitext(path)[1].lower() not in _FORMATS:
    raise _errors.GraphGradError(
        f"GradientReport.plot: `path` {path!r} must end in "
        f"{', '.join(_FORMATS)}, e.g. 'grads.png'.")
  if not _installed.has_module("matplotlib"):
    raise _errors.GraphGradError(
        "GradientReport.plot needs matplotlib: pip install 'graphgrad[draw]'.")
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  names = [r["name"] for r in report.layers]
  x = np.arange(len(names))
  fig = Figure(figsize=(max(8.0, 0.45 * len(names) + 3),
                        5.4 if report.has_plan else 4.8))
  ax = fig.add_subplot(1, 1, 1)
  bars = ax.twinx()
  zeros = [r["zero_upstream"]["before"] or 0.0 for r in report.layers]
  bars.bar(x, zeros, color="0.85", width=0.6, zorder=0,
           label="zero upstream entries (fraction)")
  bars.set_ylim(0, 1)
  bars.set_ylabel("fraction of zero upstream entries")
  ax.set_zorder(bars.get_zorder() + 1)
  ax.patch.set_visible(False)
  for key, label, color in _SERIES:
    ax.plot(x, _values(report, key, "before"), "o-", color=color, label=label)
    if report.has_plan:
      ax.plot(x, _values(report, key, "after"), "s--", color=color,
              alpha=0.8, label=label + " (plan)")
  flagged = [i for i, r in enumerate(report.layers) if r["flag"]]
  if flagged:
    side = "after" if report.has_plan else "before"
    norms = _values(report, "grad_norm", side)
    ax.scatter(x[flagged], norms[flagged], s=160, facecolors="none",
               edgecolors="red", linewidths=2, zorder=5,
               label="flagged (vanishing / exploding)")
  ax.set_yscale("log")
  ax.set_xticks(x)
  ax.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
  ax.set_xlabel("layer (topological order, input side first)")
  ax.set_ylabel("norm (log scale)")
  ax.grid(True, which="major", axis="y", alpha=0.3)
  ax.set_title(title or f"gradient flow of {report.loss}")
  handles, labels = ax.get_legend_handles_labels()
  h2, l2 = bars.get_legend_handles_labels()
  fig.legend(handles + h2, labels + l2, fontsize=7, loc="lower center",
             ncol=3, frameon=False)
  fig.tight_layout(rect=(0, 0.16 if report.has_plan else 0.1, 1, 1))
  fig.savefig(path, dpi=110)
  return path
