"""graphgrad: rewrite gradients at layer boundaries of tf.compat.v1 graphs.

The whole public API::

  net = gg.analyze(loss)                   # tf.Graph -> LayerGraph
  plan = gg.GradientPlan(loss, net)        # LayerGraph -> plan
  plan.transform_upstream("l2_dense", gg.transforms.add_noise(0.01))
  plan.transform_edge("features", "domain_head", gg.transforms.reverse())
  plan.replace_backward("l3", gg.backward.feedback_alignment(seed=0))
  plan.combine_tasks("trunk", [loss_a, loss_b], gg.mtl.upgrad())
  train_op = plan.apply_gradients(tf.compat.v1.train.AdamOptimizer(1e-3))

``gg.KerasPlan(model)`` declares the same rewrites on a TF2 Keras model.
``gg.transforms``, ``gg.backward``, ``gg.mtl``, ``gg.dp``, ``gg.cluster``,
``gg.demo`` and the errors (all ``gg.GraphGradError``) complete it.
"""

import importlib
from typing import TYPE_CHECKING, Any, List

from graphgrad import _startup

if TYPE_CHECKING:  # what type checkers and the API reference read
  from graphgrad import backward, cluster, demo, dp, mtl, transforms
  from graphgrad._errors import (
    GraphGradError,
    IncompatibleGradientError,
    LayerNotFoundError,
    NotConnectedError,
    UnsupportedGraphError,
  )
  from graphgrad._gradient_report import gradient_report
  from graphgrad.analysis._analyze import analyze
  from graphgrad.analysis._layer_graph import Layer, LayerGraph
  from graphgrad.analysis._thaw import thaw
  from graphgrad.core._report_figures import GradientReport
  from graphgrad.distributed._after_aggregation import AfterAggregation
  from graphgrad.keras._keras_plan import KerasPlan
  from graphgrad.plan._gradient_plan import (
    GATE_GRAPH,
    GATE_NONE,
    GATE_OP,
    GradientPlan,
  )

__version__ = "0.4.0"

__all__ = [
    "AfterAggregation",
    "GATE_GRAPH",
    "GATE_NONE",
    "GATE_OP",
    "GradientPlan",
    "GradientReport",
    "GraphGradError",
    "IncompatibleGradientError",
    "KerasPlan",
    "Layer",
    "LayerGraph",
    "LayerNotFoundError",
    "NotConnectedError",
    "UnsupportedGraphError",
    "analyze",
    "backward",
    "cluster",
    "gradient_report",
    "demo",
    "dp",
    "mtl",
    "thaw",
    "transforms",
]

# Each public name, and the module it is imported from on first use.
_MODULES = ("backward", "cluster", "demo", "dp", "mtl", "transforms")
_HOMES = {
    "GraphGradError": "graphgrad._errors",
    "IncompatibleGradientError": "graphgrad._errors",
    "LayerNotFoundError": "graphgrad._errors",
    "NotConnectedError": "graphgrad._errors",
    "UnsupportedGraphError": "graphgrad._errors",
    "gradient_report": "graphgrad._gradient_report",
    "analyze": "graphgrad.analysis._analyze",
    "Layer": "graphgrad.analysis._layer_graph",
    "LayerGraph": "graphgrad.analysis._layer_graph",
    "thaw": "graphgrad.analysis._thaw",
    "GradientReport": "graphgrad.core._report_figures",
    "AfterAggregation": "graphgrad.distributed._after_aggregation",
    "KerasPlan": "graphgrad.keras._keras_plan",
    "GATE_GRAPH": "graphgrad.plan._gradient_plan",
    "GATE_NONE": "graphgrad.plan._gradient_plan",
    "GATE_OP": "graphgrad.plan._gradient_plan",
    "GradientPlan": "graphgrad.plan._gradient_plan",
}


def __getattr__(name: str) -> Any:
  """Imports a public name on first use (PEP 562), so that ``import
  graphgrad`` imports no TensorFlow until the API is used."""
  if name in _MODULES:
    home, attribute = f"graphgrad.{name}", None
  elif name in _HOMES:
    home, attribute = _HOMES[name], name
  else:
    raise AttributeError(f"module 'graphgrad' has no attribute {name!r}")
  with _startup.quiet_when_command_line():  # TF's start-up lines, see _startup
    module = importlib.import_module(home)
  value = module if attribute is None else getattr(module, attribute)
  globals()[name] = value
  return value


def __dir__() -> List[str]:
  return sorted([*__all__, "__version__"])
