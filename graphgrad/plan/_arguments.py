"""Checks of GradientPlan's constructor arguments and layer references."""

from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from graphgrad import _errors
from graphgrad.analysis import _graph_util
from graphgrad.analysis._analyze import check_loss
from graphgrad.analysis._layer_graph import LayerGraph
from graphgrad.plan._executor import GATE_GRAPH, GATE_NONE, GATE_OP


def check_net(loss: tf.Tensor, net: Optional[LayerGraph]) -> None:
  """Refuses a ``net`` that is not the layer graph of ``loss``."""
  if net is None:
    # Analysed on first use: a plan without transforms needs no analysis,
    # so it costs exactly what Optimizer.minimize costs.
    check_loss(loss)
  elif not isinstance(net, LayerGraph):
    raise _errors.GraphGradError(
        f"`net` must be a gg.LayerGraph from gg.analyze(loss); got "
        f"{type(net).__name__}. Pass net=gg.analyze(loss) or leave it None.")
  elif net.loss is not loss:
    raise _errors.GraphGradError(
        f"`net` was analysed for the loss {net.loss.name}, not for `loss` "
        f"{getattr(loss, 'name', loss)!r}. Pass net=gg.analyze(loss) for "
        f"this loss.")


def check_options(gate_gradients: int, reduce_fn: Optional[Callable],
                  replicas: Optional[int] = None) -> None:
  """Refuses an unknown gate, a ``reduce_fn`` that is not callable, and a
  ``replicas`` that is not a positive int or comes without ``reduce_fn``."""
  if reduce_fn is not None and not callable(reduce_fn):
    raise _errors.GraphGradError(
        f"`reduce_fn` must be a callable mapping a list of (gradient, "
        f"variable) pairs to the list of reduced gradients; got "
        f"{type(reduce_fn).__name__}. Pass e.g. "
        f"`lambda gv: [hvd.allreduce(g) for g, _ in gv]`, or None.")
  if replicas is not None and (not isinstance(replicas, int)
                               or isinstance(replicas, bool) or replicas < 1):
    raise _errors.GraphGradError(
        f"`replicas` must be a positive int, the number of replicas "
        f"`reduce_fn` reduces over; got {type(replicas).__name__} "
        f"{replicas!r}. Pass e.g. replicas=hvd.size(), or None.")
  if replicas is not None and reduce_fn is None:
    raise _errors.GraphGradError(
        f"`replicas` counts the replicas that `reduce_fn` reduces over; got "
        f"replicas={replicas} without a reduce_fn. Pass the reduction too, "
        f"e.g. reduce_fn=lambda gv: [hvd.allreduce(g) for g, _ in gv], or "
        f"leave replicas None.")
  if gate_gradients not in (GATE_NONE, GATE_OP, GATE_GRAPH):
    raise _errors.GraphGradError(
        f"`gate_gradients` must be GATE_NONE (0), GATE_OP (1) or GATE_GRAPH "
        f"(2); got {gate_gradients!r}.")


def check_var_list(loss: tf.Tensor, var_list: Optional[Sequence[tf.Variable]]
                   ) -> List[tf.Variable]:
  """``var_list`` as a list, defaulting to the tf.Graph's trainable ones."""
  graph = loss.graph
  if var_list is None:
    return _graph_util.trainable_variables(graph)
  var_list = list(var_list)
  for v in var_list:
    if not isinstance(v, tf.Variable):
      raise _errors.GraphGradError(
          f"`var_list` must hold tf.Variable objects; got "
          f"{type(v).__name__} {v!r}. Pass e.g. "
          f"tf.compat.v1.trainable_variables('l1_dense').")
    if v.graph is not graph:
      raise _errors.GraphGradError(
          f"`var_list` holds {v.name} from another tf.Graph than the loss; "
          f"expected variables of the tf.Graph of {loss.name}. Build "
          f"variables and loss in one graph.")
  if not var_list:
    raise _errors.GraphGradError(
        "`var_list` is empty. Pass None to train every trainable variable, "
        "or list the variables to train.")
  return var_list

