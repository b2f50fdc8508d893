"""graphgrad: rewrite gradients at layer boundaries of tf.compat.v1 graphs.

The whole public API::

  net = gg.analyze(loss)                   # graph -> LayerGraph
  plan = gg.GradientPlan(loss, net)        # LayerGraph -> plan
  plan.transform_upstream("l2_dense", gg.transforms.add_noise(0.01))
  plan.transform_gradients("l2_dense", gg.transforms.scale(0.8))
  plan.transform_edge("features", "domain_head", gg.transforms.reverse())
  train_op = plan.apply_gradients(tf.compat.v1.train.AdamOptimizer(1e-3))
"""

from graphgrad import cluster, transforms
from graphgrad._analysis import Layer, LayerGraph, analyze
from graphgrad._distributed import AfterAggregation
from graphgrad._errors import (GraphGradError, IncompatibleGradientError,
                               LayerNotFoundError, NotConnectedError,
                               UnsupportedGraphError)
from graphgrad._plan import GATE_GRAPH, GATE_NONE, GATE_OP, GradientPlan

__version__ = "0.1.0"

__all__ = [
    "AfterAggregation",
    "GATE_GRAPH",
    "GATE_NONE",
    "GATE_OP",
    "GradientPlan",
    "GraphGradError",
    "IncompatibleGradientError",
    "Layer",
    "LayerGraph",
    "LayerNotFoundError",
    "NotConnectedError",
    "UnsupportedGraphError",
    "analyze",
    "cluster",
    "transforms",
]
