"""Graph-mode checks at the entry points of the tf.compat.v1 API.

``gg.analyze`` and ``gg.GradientPlan`` read a ``tf.Graph``'s collections and
add ops to it. Eagerly there is no graph, and inside a ``tf.function`` the
graph being traced (a ``FuncGraph``) keeps no trainable-variable collection:
there the plan would see no variable and return ``[]``, and the analysis would
say the loss depends on no variable. A finalized graph refuses new ops. Each
case gets one clear error instead; TF2 code has ``gg.KerasPlan``.
"""

from typing import Any

import tensorflow as tf

from graphgrad import _errors

_KERAS = ("graphgrad's {what} works on tf.compat.v1 graphs. For TF2 code, "
          "eager or in tf.function, use gg.KerasPlan(model) with "
          "`with plan.tape() as tape:`; for a TF1 graph, build the model, "
          "the loss and the plan inside `with tf.Graph().as_default():`.")


def check_graph_mode(what: str, loss: Any, adds_ops: bool = True) -> None:
  """Raises unless ``what`` runs on a plain, unfinalized ``tf.Graph``.

  Args:
    what: the entry point, for the message (``"gg.analyze"``).
    loss: the loss it was given; a non-tensor is left to the caller's own
      argument check.
    adds_ops: ``what`` adds ops, so a finalized graph is refused too.

  Raises:
    GraphGradError: eagerly (an eager tensor), inside a ``tf.function``, or
      for a finalized graph when ``adds_ops``.

  Example:
    >>> with tf.Graph().as_default() as g:
    ...   loss = tf.constant(1.0)
    ...   g.finalize()
    ...   check_graph_mode("gg.analyze", loss, adds_ops=False)
    ...   check_graph_mode("gg.GradientPlan", loss)
    Traceback (most recent call last):
    ...
    graphgrad._errors.GraphGradError: gg.GradientPlan: the tf.Graph of the loss
    Const:0 is finalized (graph.finalize() was called, e.g. by
    tf.compat.v1.train.MonitoredTrainingSession), so no op can be added to it.
    Build the plan, up to compute_gradients() or apply_gradients(), before
    finalize().
  """
  if not tf.is_tensor(loss) or isinstance(loss, tf.Variable):
    return
  if not tf.is_symbolic_tensor(loss):
    raise _errors.GraphGradError(
        f"{what}: `loss` is an eager tensor, not a tensor of a tf.Graph: "
        f"{_KERAS.format(what=what)}")
  if tf.inside_function() or loss.graph.building_function:
    raise _errors.GraphGradError(
        f"{what}: called inside a tf.function, whose traced graph keeps no "
        f"tf.compat.v1 variable collections, so the plan would see no "
        f"variable. {_KERAS.format(what=what)}")
  if adds_ops and loss.graph.finalized:
    raise _errors.GraphGradError(
        f"{what}: the tf.Graph of the loss {loss.name} is finalized "
        f"(graph.finalize() was called, e.g. by "
        f"tf.compat.v1.train.MonitoredTrainingSession), so no op can be added "
        f"to it. Build the plan, up to compute_gradients() or "
        f"apply_gradients(), before finalize().")
