"""``gg.gradient_report``: one report for a tf.compat.v1 graph or a Keras model.

The first argument says which: a ``Session`` is measured by
``plan/_report`` (the graph's backward pass, run in the Session), a Keras
model by ``keras/_tape_report`` (a traced step under a tape). Both give a
``GradientReport`` of the same figures and flags (``core/_report_figures``).
"""

from typing import Any, Optional

from graphgrad.core._report_figures import GradientReport
from graphgrad.keras import _tape_report
from graphgrad.keras._layer_index import is_keras_layer
from graphgrad.plan import _report


def gradient_report(session_or_model: Any, net_or_loss: Any, /,
                    feed: Any = None, plan: Optional[Any] = None,
                    batches: int = 1, threshold: float = 2.0
                    ) -> GradientReport:
  """Measures each layer's gradients and flags vanishing or exploding ones.

  Two forms give one :class:`GradientReport`, with the same figures and the
  same flag rule (docs/inspection.md):

  * ``gradient_report(sess, net, feed=None, plan=None)``, for a
    ``tf.compat.v1`` graph: ``sess`` a Session on the loss's graph with the
    variables initialised, ``net`` the loss's ``gg.LayerGraph``, ``feed``
    ``None``, a feed dict (for every batch), a sequence of ``batches`` feed
    dicts or a callable batch index -> feed dict, and ``plan`` a
    ``gg.GradientPlan`` on the loss. It adds gradient ops to the graph.
  * ``gradient_report(model, loss, feed=None, plan=None)``, for a Keras
    model: ``loss`` a callable that runs the model on one batch and
    returns the scalar loss (for a plan that combines tasks, the list of
    task losses, whose sum is the loss); ``feed`` its arguments per
    batch: ``None``
    (``loss()``), one batch for every batch (a tuple is unpacked,
    ``loss(x, y)``), a list of ``batches`` batches, or a callable batch
    index -> batch; ``plan`` a ``gg.KerasPlan`` on the model. It runs in a
    ``tf.function``; every layer holding trainable variables of its own
    gets a row, in the model's order.

  Neither changes a variable. With a plan each figure comes ``before`` (the
  chain rule) and ``after`` (the plan's parameter gradients, and the
  gradient a layer's ``transform_upstream`` sends below).

  Args:
    session_or_model: the Session, or the Keras model.
    net_or_loss: the ``LayerGraph``, or the loss callable.
    feed: the batches, as above.
    plan: optional plan on the same loss or model.
    batches: number of batches; each figure is the mean over them.
    threshold: orders of magnitude beyond which a layer is flagged.

  Returns:
    A :class:`GradientReport`.

  Raises:
    GraphGradError: on a malformed argument; for a graph also as
      ``plan/_report.gradient_report`` says (functional control flow).

  Example:
    >>> import tensorflow as tf, graphgrad as gg
    >>> inp = tf.keras.Input((2,))
    >>> ones = dict(use_bias=False, kernel_initializer="ones")
    >>> h = tf.keras.layers.Dense(1, name="l1", **ones)(inp)
    >>> out = tf.keras.layers.Dense(1, name="l2", **ones)(h)
    >>> model = tf.keras.Model(inp, out)
    >>> plan = gg.KerasPlan(model).transform_upstream(
    ...     "l2", gg.transforms.scale(0.5))
    >>> loss = lambda x: tf.reduce_sum(model(x))
    >>> report = gg.gradient_report(model, loss, tf.constant([[1.0, 2.0]]),
    ...                             plan=plan)
    >>> {k: round(v, 3) for k, v in report["l1"]["grad_norm"].items()}
    {'before': 2.236, 'after': 1.118}
    >>> report["l2"]["upstream_norm"]
    {'before': 1.0, 'after': 0.5}
  """
  if is_keras_layer(session_or_model):
    return _tape_report.gradient_report(session_or_model, net_or_loss, feed,
                                        plan, batches, threshold)
  return _report.gradient_report(session_or_model, net_or_loss, feed, plan,
                                 batches, threshold)
