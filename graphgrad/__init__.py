"""graphgrad: rewrite gradients at layer boundaries of tf.compat.v1 graphs.

The whole public API::

  net = gg.analyze(loss)                   # graph -> LayerGraph
  plan = gg.GradientPlan(loss, net)        # LayerGraph -> plan
  plan.transform_upstream("l2_dense", gg.transforms.add_noise(0.01))
  plan.transform_gradients("l2_dense", gg.transforms.scale(0.8))
  plan.transform_edge("features", "domain_head", gg.transforms.reverse())
  plan.replace_backward("l3", gg.backward.feedback_alignment(seed=0))
  plan.project_conflicts("trunk", losses=[loss_a, loss_b])   # PCGrad
  plan.combine_tasks("trunk", [loss_a, loss_b], gg.mtl.upgrad())  # multi-task
  train_op = plan.apply_gradients(tf.compat.v1.train.AdamOptimizer(1e-3))
  plan.summaries(), plan.declarations, plan.resources, plan.trace

  # transforms after a cross-replica sum:
  opt = gg.AfterAggregation(optimizer, net)

and the same plans for TF2 Keras models, eagerly or in tf.function::

  plan = gg.KerasPlan(model).transform_upstream("l2_dense",
                                                gg.transforms.scale(0.8))
  with plan.tape() as tape:
    loss = loss_fn(y, model(x))
  optimizer.apply_gradients(zip(tape.gradient(loss), model.trainable_variables))

with the modules ``gg.transforms`` (gradient transforms and their contract),
``gg.backward`` (backward replacements and theirs), ``gg.mtl`` (multi-task
gradient methods for ``combine_tasks``), ``gg.cluster`` (a local
parameter-server cluster: ``LocalCluster``, ``start_server``,
``session_config``) and ``gg.demo`` (the seed problem and network that the
notebooks and ``graphgrad demo`` use), and the errors, all subclasses of
``gg.GraphGradError``.
"""

# pylint: disable=g-bad-import-order,g-import-not-at-top
from graphgrad import _startup

with _startup.quiet_when_command_line():  # TF's start-up lines, see _startup
  import tensorflow as _tf  # noqa: F401
del _tf

from graphgrad import _compat, backward, cluster, demo, mtl, transforms
from graphgrad._errors import (
                               GraphGradError,
                               IncompatibleGradientError,
                               LayerNotFoundError,
                               NotConnectedError,
                               UnsupportedGraphError,
)
from graphgrad.analysis._analyze import analyze
from graphgrad.analysis._layer_graph import Layer, LayerGraph
from graphgrad.analysis._thaw import thaw
from graphgrad.distributed._after_aggregation import AfterAggregation
from graphgrad.keras._plan import KerasPlan
from graphgrad.plan._gradient_plan import (
                                           GATE_GRAPH,
                                           GATE_NONE,
                                           GATE_OP,
                                           GradientPlan,
)
from graphgrad.plan._report import GradientReport, gradient_report

__version__ = "0.1.0"

if not _startup.is_command_line():  # the command line checks after its args
  _compat.check_tensorflow()  # logs a warning outside the tested range

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
    "mtl",
    "thaw",
    "transforms",
]
