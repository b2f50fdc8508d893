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

# pylint: disable=g-bad-import-order,g-import-not-at-top
from graphgrad import _startup

with _startup.quiet_when_command_line():  # TF's start-up lines, see _startup
  import tensorflow as _tf  # noqa: F401
del _tf

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
